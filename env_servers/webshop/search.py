"""BM25 product search (WebShop uses Lucene BM25 through pyserini; here `bm25s`, no Java).

Documents are a product's title (twice, so title words weigh more, as a title field
boost would), attributes, bullet points, description and option values. Ranking is deterministic:
descending BM25 score, ties broken by ascending product id; only products sharing at
least one query term are returned (Lucene returns no zero-score hits), at most
`SEARCH_RETURN_N` = 50 as in WebShop.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

import numpy as np

# bm25s imported with JAX hidden (env servers never initialise the accelerator).
from env_servers.retriever.index import bm25s

SEARCH_RETURN_N = 50

_TOKEN = re.compile(r"[a-z0-9]+")
_STOPWORDS = frozenset(
    "a an and are as at be by for from i i'm im in is it looking me my need of on or please "
    "that the this to want with would like lower than price dollars".split())


def tokenize(text: str) -> list[str]:
  """Lower-cased alphanumeric words without stop words (same for documents and queries)."""
  return [t for t in _TOKEN.findall(text.lower()) if t not in _STOPWORDS]


def document_text(product: Mapping[str, Any]) -> str:
  """The text a product is indexed under."""
  return " ".join([product["Title"], product["Title"], " ".join(product["Attributes"]),
                   " ".join(product["BulletPoints"]), product["Description"],
                   " ".join(v for vals in product["options"].values() for v in vals)])


class SearchIndex:
  """BM25 over a list of products; `search(query)` returns product ids, best first."""

  def __init__(self, products: Sequence[Mapping[str, Any]]):
    if not products:
      raise ValueError("cannot build a search index over an empty catalog")
    order = sorted(range(len(products)), key=lambda i: products[i]["asin"])
    # Documents are indexed in product-id order so that a stable sort on the score
    # breaks ties by product id.
    self._asins = np.array([products[i]["asin"] for i in order])
    self._bm25 = bm25s.BM25()
    self._bm25.index([tokenize(document_text(products[i])) for i in order],
                     show_progress=False)

  def __len__(self) -> int:
    return len(self._asins)

  def scores(self, query: str) -> np.ndarray:
    """f32[N] BM25 score of every product (product-id order) for `query`."""
    tokens = tokenize(query)
    if not tokens:  # only stop words or punctuation: nothing matches
      return np.zeros(len(self._asins), dtype=np.float32)
    return self._bm25.get_scores(tokens)

  def search(self, query: str, top_n: int = SEARCH_RETURN_N) -> list[str]:
    """Ids of the `top_n` best-scoring products with a score > 0."""
    scores = self.scores(query)
    positive = np.flatnonzero(scores > 0)
    if positive.size > top_n:
      # Exact top-n with ties: keep everything >= the n-th best score, then sort.
      kth = np.partition(scores[positive], positive.size - top_n)[positive.size - top_n]
      positive = positive[scores[positive] >= kth]
    ranked = positive[np.argsort(-scores[positive], kind="stable")][:top_n]
    return self._asins[ranked].tolist()
