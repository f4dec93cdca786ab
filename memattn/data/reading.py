"""A seeded synthetic reading task: documents of entity facts, cloze queries about them.

A document is a few hundred to a few thousand word tokens: fact sentences
("entity_17 lives in place_4 .") spread among filler sentences, some of which mention
entities and places without stating a fact ("the river entity_3 was place_9 quiet ."),
so that neither an entity nor a place token alone marks the answer. Each document has
several cloze queries about its facts ("entity_17 lives in @placeholder"); the answer is
the place the document states for that entity and relation. With `p_update` > 0 some
facts are restated later with a new place ("entity_17 now lives in place_8 .") and the
answer is the later one.

Places are drawn uniformly for every fact of every document, so the query alone says
nothing about its answer: a reader that ignores the document is right with probability
1 / n_places (`ReadingTask.chance`). Every answer is stated in its document.

    task = ReadingTask(ReadingConfig(doc_len=(200, 800)))
    batch = task.batch(32, seed=0)      # ReadingBatch of padded tensors
    task.decode(batch.docs[0, :12])     # 'the market entity_3 ... .'
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from memattn.errors import ConfigError

PAD, STOP, BLANK, UPDATE = "<pad>", ".", "@placeholder", "now"
RELATIONS = (("lives", "in"), ("works", "in"), ("studies", "in"), ("travels", "to"),
             ("was", "born", "in"), ("got", "married", "in"))
FILLER = ("the", "a", "old", "new", "river", "market", "weather", "was", "is", "quiet", "busy",
          "road", "morning", "evening", "people", "talked", "about", "news", "rain", "sun",
          "train", "late", "early", "music", "played", "children", "laughed", "bread", "smelled",
          "fresh", "city", "council", "met", "again", "many", "few", "visitors", "arrived",
          "letters", "came", "near", "with", "and", "but", "then", "after", "bridge", "garden")
FILLER_LEN = (3, 10)  # tokens in a filler sentence, its full stop included


@dataclass(frozen=True)
class ReadingConfig:
    """The task's sizes.

    n_entities, n_places: how many entity and place tokens exist (places are the answers).
    n_relations: how many of the relations ("lives in", "works in", ...) facts use (<= 6).
    doc_len: (shortest, longest) document in tokens, both included; lengths are uniform.
    queries_per_doc: cloze queries asked about each document (distinct facts).
    fact_every: one fact a this many tokens of document, on average.
    p_update: probability that a fact is restated later with another place.
    p_mention: probability that a filler sentence mentions an entity, and again a place.
    """

    n_entities: int = 40
    n_places: int = 30
    n_relations: int = 4
    doc_len: tuple[int, int] = (200, 800)
    queries_per_doc: int = 4
    fact_every: int = 25
    p_update: float = 0.0
    p_mention: float = 0.5

    def __post_init__(self) -> None:
        for name in ("n_entities", "n_places", "queries_per_doc", "fact_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"reading.{name}: expected a positive integer, got {value!r}")
        if self.n_places < 2:
            raise ConfigError(f"reading.n_places: expected at least 2, got {self.n_places}")
        if not 1 <= self.n_relations <= len(RELATIONS):
            raise ConfigError(f"reading.n_relations: expected 1 to {len(RELATIONS)}, "
                              f"got {self.n_relations!r}")
        lo, hi = self.doc_len
        shortest = self.queries_per_doc * self.fact_budget
        if not (isinstance(lo, int) and isinstance(hi, int)) or lo > hi or lo < shortest:
            raise ConfigError(f"reading.doc_len: expected (shortest, longest) integers with "
                              f"{shortest} <= shortest <= longest (room for {self.queries_per_doc} "
                              f"facts and their updates), got {self.doc_len!r}")
        if self.queries_per_doc > self.n_entities * self.n_relations:
            raise ConfigError(f"reading.queries_per_doc: at most n_entities * n_relations = "
                              f"{self.n_entities * self.n_relations} distinct facts exist, "
                              f"got {self.queries_per_doc}")
        for name in ("p_update", "p_mention"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"reading.{name}: expected a probability in [0, 1], "
                                  f"got {getattr(self, name)!r}")

    @property
    def fact_budget(self) -> int:
        """Most tokens one fact can take: its sentence (entity, relation, place, full stop)
        and, when facts may be updated, its restatement (one word longer)."""
        sentence = 1 + max(len(r) for r in RELATIONS[: self.n_relations]) + 2
        return sentence + (sentence + 1 if self.p_update > 0 else 0)


@dataclass
class ReadingBatch:
    """Documents with their queries, as padded tensors (pad id 0).

    docs [N, T] (T the longest document), doc_lengths [N]; queries [N, Q, Lq],
    query_lengths [N, Q]; answers [N, Q]: the index of the answer among the places
    (0 … n_places - 1), i.e. a class label.
    """

    docs: torch.Tensor
    doc_lengths: torch.Tensor
    queries: torch.Tensor
    query_lengths: torch.Tensor
    answers: torch.Tensor

    def __len__(self) -> int:
        return self.docs.shape[0]

    def to(self, device) -> ReadingBatch:
        return ReadingBatch(self.docs.to(device), self.doc_lengths.to(device), self.queries.to(device),
                            self.query_lengths.to(device), self.answers.to(device))


class ReadingTask:
    """The vocabulary and the generator of the reading task for one `ReadingConfig`.

    vocab: the word tokens, id = position (0 is padding); places: their token ids, in
    answer-class order.
    """

    def __init__(self, config: ReadingConfig | None = None) -> None:
        self.config = config = config or ReadingConfig()
        relation_words = sorted({w for r in RELATIONS[: config.n_relations] for w in r})
        self.entities = [f"entity_{i}" for i in range(config.n_entities)]
        place_words = [f"place_{i}" for i in range(config.n_places)]
        self.vocab = [PAD, STOP, BLANK, UPDATE, *FILLER,
                      *(w for w in relation_words if w not in FILLER),
                      *self.entities, *place_words]
        self.index = {w: i for i, w in enumerate(self.vocab)}
        self.places = [self.index[w] for w in place_words]
        self.relations = [[self.index[w] for w in r] for r in RELATIONS[: config.n_relations]]

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def n_answers(self) -> int:
        return self.config.n_places

    @property
    def chance(self) -> float:
        """Accuracy of any reader that does not look at the document: 1 / n_places."""
        return 1.0 / self.config.n_places

    def decode(self, ids) -> str:
        """Token ids (a list or a 1-d tensor) -> the words, padding dropped."""
        return " ".join(self.vocab[int(i)] for i in ids if int(i) != 0)

    def document(self, rng: random.Random) -> tuple[list[int], list[list[int]], list[int]]:
        """One document: (tokens, queries (token lists), answers (place classes))."""
        cfg = self.config
        length = rng.randint(*cfg.doc_len)
        n_facts = max(cfg.queries_per_doc, round(length / cfg.fact_every))
        n_facts = min(n_facts, cfg.n_entities * cfg.n_relations, length // cfg.fact_budget)
        pairs = rng.sample(range(cfg.n_entities * cfg.n_relations), n_facts)
        facts = []  # (entity, relation, place, restated place or None)
        for pair in pairs:
            restated = None
            if rng.random() < cfg.p_update:
                restated = rng.randrange(cfg.n_places)
            facts.append((pair // cfg.n_relations, pair % cfg.n_relations,
                          rng.randrange(cfg.n_places), restated))

        def sentence(entity, relation, place, update=False):
            head = [self.index[UPDATE]] if update else []
            return [self.index[self.entities[entity]], *head, *self.relations[relation],
                    self.places[place], self.index[STOP]]

        # Fact sentences in a random order, each update after the fact it replaces.
        stated = [(i, False) for i in range(n_facts)]
        rng.shuffle(stated)
        for i, (_, _, _, restated) in enumerate(facts):
            if restated is not None:
                first = stated.index((i, False))
                stated.insert(rng.randint(first + 1, len(stated)), (i, True))
        fact_sentences = [sentence(*facts[i][:2], facts[i][3] if update else facts[i][2], update)
                          for i, update in stated]
        fillers = self._fillers(rng, length - sum(map(len, fact_sentences)))  # budget >= 0
        # Merge: fillers into the fact order at random places, the facts' order kept.
        slots = [True] * len(fact_sentences) + [False] * len(fillers)
        rng.shuffle(slots)
        fact_iter, filler_iter = iter(fact_sentences), iter(fillers)
        tokens = [t for is_fact in slots for t in next(fact_iter if is_fact else filler_iter)]

        asked = rng.sample(range(n_facts), cfg.queries_per_doc)
        queries = [[self.index[self.entities[facts[i][0]]], *self.relations[facts[i][1]],
                    self.index[BLANK]] for i in asked]
        answers = [facts[i][3] if facts[i][3] is not None else facts[i][2] for i in asked]
        return tokens, queries, answers

    def _fillers(self, rng: random.Random, budget: int) -> list[list[int]]:
        """Filler sentences of exactly `budget` tokens in all."""
        lo, hi = FILLER_LEN
        lengths = []
        while budget > 0:
            n = rng.randint(lo, hi)
            if budget - n < lo:
                n = budget
            lengths.append(n)
            budget -= n
        out = []
        for n in lengths:
            words = [self.index[rng.choice(FILLER)] for _ in range(n - 1)]
            if n >= 3 and rng.random() < self.config.p_mention:
                words[rng.randrange(n - 1)] = self.index[rng.choice(self.entities)]
                if rng.random() < self.config.p_mention:
                    words[rng.randrange(n - 1)] = rng.choice(self.places)
            out.append(words + [self.index[STOP]])
        return out

    def batch(self, n: int, seed: int | str) -> ReadingBatch:
        """`n` documents drawn from `seed` (the same seed gives the same batch)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"n: expected a positive number of documents, got {n!r}")
        rng = random.Random(f"memattn-reading/{seed}")
        docs = [self.document(rng) for _ in range(n)]
        Q = self.config.queries_per_doc
        T = max(len(d[0]) for d in docs)
        Lq = max(len(q) for d in docs for q in d[1])
        out = ReadingBatch(torch.zeros(n, T, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                           torch.zeros(n, Q, Lq, dtype=torch.long),
                           torch.zeros(n, Q, dtype=torch.long), torch.zeros(n, Q, dtype=torch.long))
        for i, (tokens, queries, answers) in enumerate(docs):
            out.docs[i, : len(tokens)] = torch.tensor(tokens)
            out.doc_lengths[i] = len(tokens)
            for j, q in enumerate(queries):
                out.queries[i, j, : len(q)] = torch.tensor(q)
                out.query_lengths[i, j] = len(q)
            out.answers[i] = torch.tensor(answers)
        return out
