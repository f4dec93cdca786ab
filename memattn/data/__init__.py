"""Corpora for language modelling: loaders, splits, vocabularies and their cache.

    from memattn.data import load_corpus
    corpus = load_corpus("shakespeare")        # Corpus with .train / .val / .test / .vocab
    ids = corpus.vocab.encode("To be, or not to be")
    corpus.vocab.decode(ids)

See `memattn.data.corpus` for the split rules and the cache, `memattn.data.vocab` for the
vocabularies and `memattn.data.shakespeare` for the plays and their markup.
"""

from memattn.data.corpus import Corpus, load_corpus
from memattn.data.shakespeare import strip_markdown
from memattn.data.vocab import Vocab

__all__ = ["Corpus", "Vocab", "load_corpus", "strip_markdown"]
