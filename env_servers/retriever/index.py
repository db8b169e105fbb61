"""BM25 over a passage corpus with `bm25s`, saved beside the corpus, deterministic ranking.

Search-R1's sparse retriever is pyserini's Lucene BM25 with its defaults k1 = 0.9,
b = 0.4; `bm25s`'s "lucene" method computes the same formula,

  score(q, d) = sum over query terms t in d of  idf(t) * tf / (tf + k1 (1 - b + b |d| / avgdl)),
  idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)),

over this module's tokens (lower-cased alphanumeric words without Lucene's English stop
words; no stemming, unlike Lucene's Porter analyzer, so scores are close to, not equal
to, pyserini's). Ranking: descending score, ties by ascending corpus position, only
passages sharing a term with the query (Lucene returns no zero-score hit), so a query
gives the same hits on every run and machine.

`BM25Index.for_corpus(path)` loads the index saved in `<corpus>.bm25s/` when its
`meta.json` matches the corpus (size, modification time, passages, parameters) and
otherwise builds it once and saves it there, atomically (`save=False`, or a directory it
cannot write, keeps it in memory only).

The build streams: passages are tokenised a chunk at a time into (term id, count) pairs
held as numpy arrays (12 bytes a pair) instead of bm25s's lists of token strings, and the
score matrix is assembled from them in bm25s's own layout (`build_bm25s`: the same
vocabulary order, scores and column-compressed arrays as `bm25s.BM25.index`, which the
tests check), so the peak memory of a build is a few times the index's, not the
tokenised corpus's.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile
from typing import Callable, Sequence

import numpy as np

from env_servers.search import dataset

log = logging.getLogger("env_servers.retriever")
K1, B = 0.9, 0.4  # pyserini's LuceneSearcher defaults (Search-R1's BM25 retriever)
INDEX_VERSION = 1  # bump when tokenisation or the saved layout changes
BUILD_CHUNK = 8192  # passages tokenised per step of the streamed build
_TOKEN = re.compile(r"[a-z0-9]+")
# Lucene's EnglishAnalyzer stop set (ENGLISH_STOP_WORDS_SET).
STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their "
    "then there these they this to was will with".split())


def _import_bm25s():
  """bm25s with JAX hidden: it imports and runs JAX when it can (an optional backend not
  used here), and env servers must never initialise the accelerator."""
  saved = sys.modules.get("jax")
  sys.modules["jax"] = None  # makes `import jax` raise ImportError
  try:
    import bm25s
  finally:
    if saved is None:
      del sys.modules["jax"]
    else:
      sys.modules["jax"] = saved
  return bm25s


bm25s = _import_bm25s()


def saved_meta(index_dir: pathlib.Path) -> dict | None:
  """The `meta.json` of an index saved in `index_dir` (None: none, or unreadable)."""
  try:
    return json.loads((index_dir / "meta.json").read_text())
  except (OSError, json.JSONDecodeError):
    return None


def save_index_dir(write: Callable[[pathlib.Path], None], index_dir: pathlib.Path, meta: dict,
                   what: str) -> None:
  """Writes an index with `write(directory)` into a private directory, then renames it into
  place with its `meta.json`, so servers starting together never read a half-written index; a
  directory that cannot be written (a read-only corpus location) leaves the index in memory
  only (`what`, e.g. "BM25", names it in the warning). The BM25 and dense indexes both save
  through it."""
  try:
    tmp = pathlib.Path(tempfile.mkdtemp(dir=index_dir.parent, prefix=f".{index_dir.name}-"))
  except OSError as e:
    log.warning("%s index not saved beside the corpus (%s); it is rebuilt at every start", what, e)
    return
  try:
    write(tmp)
    (tmp / "meta.json").write_text(json.dumps(meta, sort_keys=True))
    if saved_meta(index_dir) == meta:  # another process saved the same index first
      return
    if index_dir.exists():
      shutil.rmtree(index_dir)  # the index of an older corpus file
    os.rename(tmp, index_dir)
  except OSError as e:
    log.warning("%s index not saved to %s (%s)", what, index_dir, e)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def tokenize(text: str) -> list[str]:
  """Lower-cased alphanumeric words without stop words (documents and queries alike)."""
  return [t for t in _TOKEN.findall(text.lower()) if t not in STOPWORDS]


def passage_text(p: dataset.Passage) -> str:
  """What a passage is indexed under: its title and text (Search-R1 indexes `contents`)."""
  return f"{p.title}\n{p.text}"


def build_bm25s(passages: Sequence[dataset.Passage], k1: float = K1, b: float = B,
                chunk: int = BUILD_CHUNK):
  """The `bm25s.BM25` (method "lucene") that `index([tokenize(passage_text(p)) ...])`
  builds, built a chunk of passages at a time (module docstring).

  bm25s's score of term t in document d: idf(t) * tf / (k1 (1 - b + b |d| / avgdl) + tf),
  idf(t) = ln(1 + (N - df + 0.5) / (df + 0.5)) as a float32, the product computed in
  float64 and stored as float32, as bm25s computes them (`bm25s.scoring`).
  """
  vocab: dict[str, int] = {}
  n = len(passages)
  doc_len = np.empty(n, dtype=np.int64)
  terms, counts, docs = [], [], []  # per chunk: int32, float32, int32 arrays of its pairs
  for start in range(0, n, chunk):
    t_chunk, c_chunk, d_chunk = [], [], []
    for d in range(start, min(n, start + chunk)):
      ids = [vocab.setdefault(t, len(vocab)) for t in tokenize(passage_text(passages[d]))]
      doc_len[d] = len(ids)
      tf: dict[int, int] = {}
      for i in ids:
        tf[i] = tf.get(i, 0) + 1
      t_chunk.extend(tf)
      c_chunk.extend(tf.values())
      d_chunk.extend([d] * len(tf))
    terms.append(np.asarray(t_chunk, dtype=np.int32))
    counts.append(np.asarray(c_chunk, dtype=np.float32))
    docs.append(np.asarray(d_chunk, dtype=np.int32))
  num_terms = len(vocab)
  df = np.zeros(num_terms, dtype=np.int64)
  for t in terms:
    df += np.bincount(t, minlength=num_terms)
  idf = np.array([math.log(1 + (n - x + 0.5) / (x + 0.5)) for x in df.tolist()], dtype=np.float32)
  avg_len = doc_len.mean()
  scores = []
  for t, c, d in zip(terms, counts, docs):  # chunk by chunk: float64 only for one chunk
    tf64 = c.astype(np.float64)
    tfc = tf64 / (k1 * ((1 - b) + b * doc_len[d] / avg_len) + tf64)
    scores.append((idf[t].astype(np.float64) * tfc).astype(np.float32))
  del counts
  terms, docs, scores = np.concatenate(terms), np.concatenate(docs), np.concatenate(scores)
  order = np.argsort(terms, kind="stable")  # by term, documents ascending within a term
  indptr = np.zeros(num_terms + 1, dtype=np.int64)
  np.cumsum(df, out=indptr[1:])
  model = bm25s.BM25(k1=k1, b=b, method="lucene")
  model.scores = {"data": scores[order], "indices": docs[order],
                  "indptr": indptr,
                  "num_docs": n}
  model.vocab_dict = {**vocab, "": num_terms}  # bm25s's empty token, after the terms
  model.unique_token_ids_set = set(model.vocab_dict.values())
  model.nonoccurrence_array = None
  return model


@dataclasses.dataclass(frozen=True)
class Hit:
  index: int  # position in the corpus
  score: float


class BM25Index:
  """BM25 scores of a fixed passage list; `search` ranks a batch of queries."""

  def __init__(self, model, num_passages: int):
    self._model, self.num_passages = model, num_passages

  @classmethod
  def build(cls, passages: Sequence[dataset.Passage], k1: float = K1, b: float = B) -> "BM25Index":
    if not passages:
      raise ValueError("cannot build a BM25 index over an empty corpus")
    return cls(build_bm25s(passages, k1, b), len(passages))

  @classmethod
  def for_corpus(cls, corpus_path: str | os.PathLike, passages: Sequence[dataset.Passage],
                 save: bool = True) -> "BM25Index":
    """The index of `passages` (read from `corpus_path`), loaded from beside the corpus when
    saved there for this very file, else built (and saved when `save`)."""
    corpus_path = pathlib.Path(corpus_path)
    index_dir = corpus_path.with_name(corpus_path.name + ".bm25s")
    stat = corpus_path.stat()
    meta = {"version": INDEX_VERSION, "corpus_bytes": stat.st_size,
            "corpus_mtime_ns": stat.st_mtime_ns, "num_passages": len(passages), "k1": K1, "b": B}
    if saved_meta(index_dir) == meta:
      model = bm25s.BM25.load(str(index_dir), show_progress=False)
      return cls(model, len(passages))
    index = cls.build(passages)
    if save:
      save_index_dir(lambda d: index._model.save(str(d), show_progress=False), index_dir, meta,
                     "BM25")
    return index

  def scores(self, query: str) -> np.ndarray:
    """f32[num_passages]: the BM25 score of every passage for `query` (corpus order)."""
    tokens = tokenize(query)
    vocab = self._model.vocab_dict
    tokens = [t for t in tokens if t in vocab]  # a term no passage has scores 0 everywhere
    if not tokens:
      return np.zeros(self.num_passages, dtype=np.float32)
    return np.asarray(self._model.get_scores(tokens), dtype=np.float32)

  def search(self, queries: Sequence[str], topk: int) -> list[list[Hit]]:
    """The `topk` best passages with a positive score for each query, best first."""
    if topk < 1:
      raise ValueError(f"topk must be >= 1, got {topk}")
    out = []
    for query in queries:
      scores = self.scores(query)
      positive = np.flatnonzero(scores > 0)
      ranked = positive[np.argsort(-scores[positive], kind="stable")][:topk]
      out.append([Hit(int(i), float(scores[i])) for i in ranked])
    return out
