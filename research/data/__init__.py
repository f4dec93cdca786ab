"""Corpora the experiments build for themselves (the Bible pairs of abc-mt)."""
