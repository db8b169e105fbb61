"""What the search env calls: `LocalRetriever` (the index in this process) or
`RemoteRetriever` (a `python -m env_servers.retriever` server over gRPC).

Both answer `search(queries, topk) -> [[Retrieved, ...] per query]` with the same ranking.
A remote call has a deadline and is retried with backoff when the server is unreachable or
slow (UNAVAILABLE, DEADLINE_EXCEEDED): a restarted server on the same address is picked up
by the next try. When every try fails, or the server refuses the call, `RetrieverError`
says so in one line: an env step then fails loudly (the env server reports it as that
slot's error) instead of showing the agent an empty search result.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import pathlib
import time
from typing import TYPE_CHECKING, Sequence

from env_servers.retriever import index as index_lib
from env_servers.search import dataset

if TYPE_CHECKING:  # torch, transformers and faiss load only when a dense index is asked for
  from env_servers.retriever import dense as dense_lib

RETRYABLE = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED")


class RetrieverError(RuntimeError):
  """The retriever could not answer; the message names the address and what to do."""


@dataclasses.dataclass(frozen=True)
class Retrieved:
  passage: dataset.Passage
  score: float
  index: int  # position in the corpus file


class LocalRetriever:
  """BM25 (or, given an encoder, dense retrieval: `dense.DenseIndex`) over a corpus loaded
  into this process (shared by every env of the process)."""

  def __init__(self, corpus_path: str | os.PathLike, save_index: bool = True,
               dense: "dense_lib.EncoderSpec | None" = None):
    self.corpus_path = str(corpus_path)
    self.passages, self.index = _load(str(pathlib.Path(corpus_path).resolve()), save_index, dense)

  def search(self, queries: Sequence[str], topk: int) -> list[list[Retrieved]]:
    return [[Retrieved(self.passages[h.index], h.score, h.index) for h in hits]
            for hits in self.index.search(queries, topk)]


@functools.lru_cache(maxsize=4)
def _load(corpus_path: str, save_index: bool, dense: "dense_lib.EncoderSpec | None" = None):
  passages = dataset.load_corpus(corpus_path)
  if dense is not None:
    from env_servers.retriever import dense as dense_lib  # torch, transformers, faiss
    return passages, dense_lib.DenseIndex.for_corpus(corpus_path, passages, dense,
                                                     save=save_index)
  return passages, index_lib.BM25Index.for_corpus(corpus_path, passages, save=save_index)


class RemoteRetriever:
  """gRPC client of a retriever server at `address` ("host:port")."""

  def __init__(self, address: str, *, token: str | None = None, tls_root_cert: bytes | None = None,
               timeout_s: float = 10.0, tries: int = 3, backoff_s: float = 0.5):
    import grpc

    from env_servers import protos  # noqa: F401  (generates the stubs when missing)
    from env_servers.protos import retriever_pb2
    from env_servers.protos import retriever_pb2_grpc
    if ":" not in address:
      raise ValueError(f"retriever address {address!r} is not host:port")
    if tries < 1 or timeout_s <= 0:
      raise ValueError(f"retriever: need tries >= 1 and timeout_s > 0, got {tries}, {timeout_s}")
    self.address, self.timeout_s, self.tries, self.backoff_s = address, timeout_s, tries, backoff_s
    self._grpc, self._pb2 = grpc, retriever_pb2
    # Reconnect quickly to a restarted server; calls wait for the connection (up to their
    # deadline) instead of failing at once while the channel is backing off.
    options = [("grpc.max_receive_message_length", 64 * 2**20),
               ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if tls_root_cert is not None:
      channel = grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_root_cert), options)
    else:
      channel = grpc.insecure_channel(address, options)
    self._stub = retriever_pb2_grpc.RetrieverStub(channel)
    self._channel = channel
    self._metadata = (("authorization", f"Bearer {token}"),) if token else None

  def _call(self, method: str, request):
    last = None
    for attempt in range(self.tries):
      try:
        return getattr(self._stub, method)(request, timeout=self.timeout_s,
                                           metadata=self._metadata, wait_for_ready=True)
      except self._grpc.RpcError as e:
        code = e.code().name if e.code() is not None else "UNKNOWN"
        last = f"{code}: {(e.details() or '').splitlines()[0] if e.details() else ''}"
        if code not in RETRYABLE:
          raise RetrieverError(f"retriever at {self.address} refused {method} ({last})") from None
        if attempt + 1 < self.tries:
          time.sleep(self.backoff_s * (attempt + 1))
    raise RetrieverError(
        f"retriever at {self.address} did not answer {method} after {self.tries} tries of "
        f"{self.timeout_s:g} s ({last}); start `python -m env_servers.retriever --corpus ... "
        f"--port {self.address.rpartition(':')[2]}` there, or fix the search env's "
        "retriever= argument")

  def describe(self):
    return self._call("Describe", self._pb2.RetrieverDescribeRequest())

  def search(self, queries: Sequence[str], topk: int) -> list[list[Retrieved]]:
    reply = self._call("Retrieve", self._pb2.RetrieveRequest(queries=list(queries), topk=topk))
    if len(reply.results) != len(queries):
      raise RetrieverError(f"retriever at {self.address} answered {len(reply.results)} hit "
                           f"lists for {len(queries)} queries; is it an older server?")
    return [[Retrieved(dataset.Passage(p.id, p.title, p.text), float(p.score), int(p.index))
             for p in hits.passages]
            for hits in reply.results]

  def close(self) -> None:
    self._channel.close()


def make_retriever(address: str, corpus_path: str, *, token_file: str = "",
                   tls_cert: str = "", timeout_s: float = 10.0, tries: int = 3,
                   dense_model: str = ""):
  """`RemoteRetriever(address)` when an address is given, else `LocalRetriever(corpus)`
  (dense over the encoder directory `dense_model`, E5's settings, when given; a server's
  encoder is its own `--dense-model`)."""
  if not address:
    dense = None
    if dense_model:
      from env_servers.retriever import dense as dense_lib
      dense = dense_lib.EncoderSpec(dense_model)
    return LocalRetriever(corpus_path, dense=dense)
  if dense_model:
    raise ValueError(f"retriever_model={dense_model!r} embeds in this process; the retriever "
                     f"server at {address} embeds with its own --dense-model")
  token = None
  if token_file:
    token = pathlib.Path(token_file).read_text(encoding="utf-8").strip() or None
  cert = pathlib.Path(tls_cert).read_bytes() if tls_cert else None
  return RemoteRetriever(address, token=token, tls_root_cert=cert, timeout_s=timeout_s,
                         tries=tries)
