"""Dense retrieval: passages embedded by a transformers encoder, searched with faiss.

Search-R1's published runs retrieve with E5 (`intfloat/e5-base-v2`) over wiki-18 through a
flat faiss index (Search-R1 `search_r1/search/retrieval_server.py`, `Encoder` and
`DenseRetriever`; its `index_builder.py` builds `e5_Flat.index`). This module computes the
same thing with the encoder directory a user supplies:

  embedding(text) = normalize( sum_t mask_t h_t / sum_t mask_t )      ("mean" pooling)

over the encoder's last hidden states h of the prefixed text, truncated to `max_length`
tokens ("cls": h_0; "pooler": the model's pooler output); E5 models are given the prefixes
"query: " and "passage: " (Search-R1 adds them when the model name contains "e5"; here
`prefixes=None` follows that rule on the directory name). A passage is embedded as its
`contents` ("title\\ntext", `index.passage_text`). Scores are inner products of unit
vectors (faiss `IndexFlatIP`: exact search, no approximation); a query's hits are its
`topk` best passages, best first, ties by corpus position.

`DenseIndex.for_corpus` loads the index saved beside the corpus in
`<corpus>.dense-<encoder fingerprint>/` when its `meta.json` matches the corpus file and
the encoder, and otherwise builds it and saves it there. Building embeds the corpus in
batches of `batch_size` passages, adding each batch to the faiss index as it is encoded,
so memory holds the index and one batch, not a second copy of every embedding.

torch, transformers and faiss-cpu are imported only here, when a dense index is asked for:
`pip install torch transformers faiss-cpu` (one-line error otherwise).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import pathlib
from typing import Sequence

import numpy as np

from env_servers.retriever import index as index_lib
from env_servers.search import dataset

log = logging.getLogger("env_servers.retriever")
INDEX_VERSION = 1  # bump when the embedding or the saved layout changes
POOLINGS = ("mean", "cls", "pooler")
E5_PREFIXES = ("query: ", "passage: ")


class DenseRetrievalError(ValueError):
  """A dense index cannot be built or used (missing packages, a bad encoder directory)."""


def _imports():
  try:
    import faiss
    import torch
    import transformers
  except ImportError as e:
    raise DenseRetrievalError(f"dense retrieval needs torch, transformers and faiss-cpu ({e}): "
                              "pip install torch transformers faiss-cpu") from None
  return faiss, torch, transformers


@dataclasses.dataclass(frozen=True)
class EncoderSpec:
  """Which encoder embeds, and how (what the saved index is checked against)."""

  model_dir: str
  pooling: str = "mean"
  max_length: int = 256  # Search-R1's retrieval_query_max_length
  prefixes: tuple[str, str] | None = None  # (query, passage); None: E5's when "e5" is in the name

  def __post_init__(self):
    if self.pooling not in POOLINGS:
      raise DenseRetrievalError(f"pooling={self.pooling!r}: use one of {POOLINGS}")
    if self.max_length < 1:
      raise DenseRetrievalError(f"max_length={self.max_length} must be >= 1")

  @property
  def query_prefix(self) -> str:
    return self._prefixes()[0]

  @property
  def passage_prefix(self) -> str:
    return self._prefixes()[1]

  def _prefixes(self) -> tuple[str, str]:
    if self.prefixes is not None:
      return self.prefixes
    name = pathlib.Path(self.model_dir.rstrip("/")).name.lower()
    return E5_PREFIXES if "e5" in name else ("", "")

  def fingerprint(self) -> str:
    """A hash of the encoder's files and settings: an index of another encoder is rebuilt."""
    h = hashlib.sha256()
    root = pathlib.Path(self.model_dir)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
      stat = path.stat()
      h.update(f"{path.relative_to(root)}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    h.update(json.dumps([self.pooling, self.max_length, self._prefixes()]).encode())
    return h.hexdigest()[:16]


class Encoder:
  """Unit-norm embeddings of texts with a transformers encoder on the CPU (float32)."""

  def __init__(self, spec: EncoderSpec):
    _, torch, transformers = _imports()
    self.spec, self._torch = spec, torch
    try:
      self.tokenizer = transformers.AutoTokenizer.from_pretrained(spec.model_dir)
      self.model = transformers.AutoModel.from_pretrained(spec.model_dir).eval()
    except (OSError, ValueError) as e:
      first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise DenseRetrievalError(f"cannot load the encoder {spec.model_dir!r}: {first}") from None

  def encode(self, texts: Sequence[str], *, query: bool) -> np.ndarray:
    """f32[len(texts), dim], each row of unit norm."""
    torch, spec = self._torch, self.spec
    prefix = spec.query_prefix if query else spec.passage_prefix
    inputs = self.tokenizer([prefix + t for t in texts], max_length=spec.max_length,
                            padding=True, truncation=True, return_tensors="pt")
    with torch.no_grad():
      out = self.model(**inputs, return_dict=True)
      if spec.pooling == "mean":
        mask = inputs["attention_mask"].unsqueeze(-1).to(out.last_hidden_state.dtype)
        emb = (out.last_hidden_state * mask).sum(dim=1) / mask.sum(dim=1)
      elif spec.pooling == "cls":
        emb = out.last_hidden_state[:, 0]
      else:
        emb = out.pooler_output
      emb = torch.nn.functional.normalize(emb.float(), dim=-1)
    return np.ascontiguousarray(emb.numpy(), dtype=np.float32)


class DenseIndex:
  """Exact inner-product search over the embedded passages (faiss `IndexFlatIP`)."""

  def __init__(self, encoder: Encoder, faiss_index, num_passages: int):
    self.encoder, self._index, self.num_passages = encoder, faiss_index, num_passages

  @classmethod
  def build(cls, passages: Sequence[dataset.Passage], encoder: Encoder,
            batch_size: int = 64) -> "DenseIndex":
    """Embeds `passages` in batches, adding each to the index as it is encoded."""
    faiss, _, _ = _imports()
    if not passages:
      raise DenseRetrievalError("cannot build a dense index over an empty corpus")
    index = None
    for start in range(0, len(passages), batch_size):
      emb = encoder.encode([index_lib.passage_text(p) for p in passages[start:start + batch_size]],
                           query=False)
      if index is None:
        index = faiss.IndexFlatIP(emb.shape[1])
      index.add(emb)
    return cls(encoder, index, len(passages))

  @classmethod
  def for_corpus(cls, corpus_path: str | os.PathLike, passages: Sequence[dataset.Passage],
                 spec: EncoderSpec, save: bool = True, batch_size: int = 64) -> "DenseIndex":
    """The index of `passages` (read from `corpus_path`) under `spec`'s encoder, loaded
    from beside the corpus when saved there for this file and encoder, else built (and
    saved when `save`)."""
    faiss, _, _ = _imports()
    encoder = Encoder(spec)
    corpus_path = pathlib.Path(corpus_path)
    fingerprint = spec.fingerprint()
    index_dir = corpus_path.with_name(f"{corpus_path.name}.dense-{fingerprint}")
    stat = corpus_path.stat()
    meta = {"version": INDEX_VERSION, "corpus_bytes": stat.st_size,
            "corpus_mtime_ns": stat.st_mtime_ns, "num_passages": len(passages),
            "encoder": fingerprint}
    if index_lib.saved_meta(index_dir) == meta:
      return cls(encoder, faiss.read_index(str(index_dir / "index.faiss")), len(passages))
    index = cls.build(passages, encoder, batch_size)
    if save:
      index_lib.save_index_dir(lambda d: faiss.write_index(index._index, str(d / "index.faiss")),
                               index_dir, meta, "dense")
    return index

  def search(self, queries: Sequence[str], topk: int) -> list[list[index_lib.Hit]]:
    """The `topk` most similar passages of each query, best first, ties by corpus position."""
    if topk < 1:
      raise ValueError(f"topk must be >= 1, got {topk}")
    if not queries:
      return []
    k = min(topk, self.num_passages)
    scores, ids = self._index.search(self.encoder.encode(list(queries), query=True), k)
    return [[index_lib.Hit(int(i), float(s))
             for s, i in sorted(zip(row_s, row_i), key=lambda si: (-si[0], si[1])) if i >= 0]
            for row_s, row_i in zip(scores, ids)]
