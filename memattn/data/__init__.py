"""Corpora for language modelling and translation: loaders, splits, vocabularies, caches.

    from memattn.data import load_corpus, load_parallel
    corpus = load_corpus("shakespeare")        # Corpus with .train / .val / .test / .vocab
    corpus = load_corpus("hf", name="wikitext:wikitext-2-raw-v1", tokenizer="gpt2")
    ids = corpus.vocab.encode("To be, or not to be")
    corpus.vocab.decode(ids)
    pairs = load_parallel(source="train.de", target="train.en")   # ParallelCorpus
    pairs.split("val").source_text[0], pairs.split("val").source[0]

See `memattn.data.corpus` for the split rules and the cache, `memattn.data.vocab` for the
character and byte vocabularies, `memattn.data.bpe` for the BPE vocabulary (it needs the
package tokenizers), `memattn.data.pretrained` for a pretrained tokenizer as the vocabulary,
`memattn.data.hf_datasets` for reading Hugging Face datasets (the package datasets),
`memattn.data.parallel` for parallel text and `memattn.data.shakespeare` for the plays and
their markup.
"""

from memattn.data.bpe import BPEVocab
from memattn.data.corpus import Corpus, load_corpus
from memattn.data.parallel import ParallelCorpus, ParallelSplit, load_parallel
from memattn.data.pretrained import PretrainedVocab
from memattn.data.shakespeare import strip_markdown
from memattn.data.vocab import Vocab

__all__ = ["BPEVocab", "Corpus", "ParallelCorpus", "ParallelSplit", "PretrainedVocab", "Vocab", "load_corpus",
           "load_parallel", "strip_markdown"]
