"""The retriever server: BM25 (or dense) top-k over a corpus, behind `retriever.proto`.

  python -m env_servers.retriever --corpus PATH/corpus.jsonl --port 0 [--host 127.0.0.1]
      [--max-topk 50] [--parent-pid PID] [--token-file FILE] [--tls-cert C --tls-key K]
      [--dense-model ENCODER_DIR [--pooling mean] [--max-length 256]]

Loads the corpus, loads or builds its index (saved beside the corpus: `index.BM25Index`,
or with `--dense-model` a faiss index of the encoder's embeddings, `dense.DenseIndex`),
prints `PORT <n>` once it serves and stops on SIGTERM/SIGINT, as the env servers do (same
loopback default, token and TLS options: `env_servers.serve`). A request's queries are
answered in one call; topk outside 1..--max-topk is INVALID_ARGUMENT. Like the env
servers it never imports JAX.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import signal
import sys
import threading
from typing import Sequence

import grpc

from env_servers import protos  # noqa: F401  (generates the stubs when missing)
from env_servers import serve
from env_servers.protos import retriever_pb2
from env_servers.protos import retriever_pb2_grpc
from env_servers.retriever import client as client_lib
from env_servers.retriever import index as index_lib
from env_servers.search import dataset

log = logging.getLogger("env_servers.retriever")
PROTOCOL_VERSION = "1.0"
SERVICE_NAME = "hgpo_jax.retriever.v1.Retriever"


class RetrieverServicer(retriever_pb2_grpc.RetrieverServicer):

  def __init__(self, retriever: client_lib.LocalRetriever, max_topk: int):
    self.retriever, self.max_topk = retriever, max_topk

  def Describe(self, request, context):
    del request, context
    return retriever_pb2.RetrieverDescribeReply(
        num_passages=len(self.retriever.passages), corpus=self.retriever.corpus_path,
        method=f"bm25 k1={index_lib.K1} b={index_lib.B}", protocol_version=PROTOCOL_VERSION)

  def Retrieve(self, request, context):
    if not 1 <= request.topk <= self.max_topk:
      context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"topk={request.topk} outside 1..{self.max_topk} (--max-topk)")
    results = self.retriever.search(list(request.queries), request.topk)
    return retriever_pb2.RetrieveReply(results=[
        retriever_pb2.Hits(passages=[
            retriever_pb2.Passage(index=r.index, id=r.passage.id,
                                  title=r.passage.title, text=r.passage.text, score=r.score)
            for r in hits]) for hits in results])


def make_server(retriever, host: str, port: int, *, max_topk: int = 50, workers: int = 4,
                token: str | None = None, tls: tuple[bytes, bytes] | None = None):
  """Builds and starts the server; returns (server, bound port)."""
  server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=workers),
                       options=[("grpc.max_send_message_length", 64 * 2**20),
                                ("grpc.so_reuseport", 0)],
                       interceptors=[serve.TokenInterceptor(token)] if token is not None else None)
  retriever_pb2_grpc.add_RetrieverServicer_to_server(RetrieverServicer(retriever, max_topk), server)
  bound, _ = serve.start_serving(server, host, port, tls, SERVICE_NAME)
  return server, bound


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description="Serve BM25 (or dense) top-k passages over gRPC.")
  parser.add_argument("--corpus", default=str(dataset.SYNTHETIC_DIR / dataset.CORPUS_FILE),
                      help="corpus jsonl ({'id', 'contents': 'title\\ntext'}); default: the "
                      "synthetic corpus")
  parser.add_argument("--port", type=int, default=0, help="0 = any free port (printed)")
  parser.add_argument("--host", default="127.0.0.1")
  parser.add_argument("--max-topk", type=int, default=50)
  parser.add_argument("--workers", type=int, default=4)
  parser.add_argument("--no-save-index", action="store_true",
                      help="build the index in memory only (read-only corpus directory)")
  parser.add_argument("--dense-model", default="",
                      help="a transformers encoder directory (E5: intfloat/e5-base-v2): dense "
                      "retrieval with faiss instead of BM25 (pip install torch transformers "
                      "faiss-cpu)")
  parser.add_argument("--pooling", default="mean", help="dense: mean | cls | pooler")
  parser.add_argument("--max-length", type=int, default=256, help="dense: tokens per text")
  parser.add_argument("--parent-pid", type=int, default=0)
  parser.add_argument("--token-file", default="")
  parser.add_argument("--tls-cert", default="")
  parser.add_argument("--tls-key", default="")
  parser.add_argument("--log-level", default="INFO")
  args = parser.parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                      format="%(asctime)s retriever[%(process)d] %(levelname)s %(message)s")
  try:
    if bool(args.tls_cert) != bool(args.tls_key):
      raise ValueError("--tls-cert and --tls-key go together; pass both or neither")
    tls = None
    if args.tls_cert:
      with open(args.tls_cert, "rb") as cert, open(args.tls_key, "rb") as key:
        tls = (cert.read(), key.read())
    dense = None
    if args.dense_model:
      from env_servers.retriever import dense as dense_lib
      dense = dense_lib.EncoderSpec(args.dense_model, args.pooling, args.max_length)
    retriever = client_lib.LocalRetriever(args.corpus, save_index=not args.no_save_index,
                                          dense=dense)
    server, port = make_server(retriever, args.host, args.port, max_topk=args.max_topk,
                               workers=args.workers, token=serve.read_token(args.token_file),
                               tls=tls)
  except (ValueError, OSError) as e:
    print(f"retriever: {e}", file=sys.stderr, flush=True)
    return 2
  stop = threading.Event()
  for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, lambda *_: stop.set())
  log.info("serving %d passages of %s on %s:%d", len(retriever.passages), args.corpus, args.host,
           port)
  print(f"PORT {port}", flush=True)
  while not stop.wait(0.5):
    if args.parent_pid and os.getppid() != args.parent_pid:
      stop.set()
  server.stop(grace=2.0).wait()
  return 0
