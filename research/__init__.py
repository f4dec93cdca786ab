"""The research harness beside the library: the papers' experiments (`memattn experiment NAME`),
the benchmark drivers (`memattn bench`) and the builders of their corpora (the Bible pairs of
abc-mt). It lives in the repository, not in the installed package: the two commands find it
when memattn runs from a clone (`memattn.cli.common.research`)."""
