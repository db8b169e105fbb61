"""The BM25 retriever: scores against a readable Lucene BM25 and against bm25s itself,
deterministic ranking, the index saved beside the corpus, and the gRPC server (batched
queries, bad requests, a killed server: a clear error, then recovery on restart)."""

import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from env_servers.retriever import client as client_lib
from env_servers.retriever import index as index_lib
from env_servers.search import dataset

DOCS = [("Alpha", "the red fox jumps over the red fence"),
        ("Beta", "a blue fox sleeps"),
        ("Gamma", "red red red paint"),
        ("Delta", "fence posts and blue paint"),
        ("Epsilon", "nothing in common here")]
PASSAGES = [dataset.Passage(str(i), t, x) for i, (t, x) in enumerate(DOCS)]


def _reference_bm25(query, passages, k1=index_lib.K1, b=index_lib.B):
  """Lucene BM25 (bm25s method "lucene"), float64, one passage and term at a time."""
  docs = [index_lib.tokenize(index_lib.passage_text(p)) for p in passages]
  n, avgdl = len(docs), sum(map(len, docs)) / len(docs)
  out = []
  for doc in docs:
    score = 0.0
    for term in index_lib.tokenize(query):
      df = sum(term in d for d in docs)
      tf = doc.count(term)
      if tf:
        idf = math.log(1 + (n - df + 0.5) / (df + 0.5))
        score += idf * tf / (tf + k1 * (1 - b + b * len(doc) / avgdl))
    out.append(score)
  return np.array(out)


@pytest.mark.parametrize("query", ["red fox", "blue paint", "fence", "Red RED fence?",
                                   "alpha", "unknown words", "the and of"])
def test_scores_equal_the_reference_and_bm25s(query):
  idx = index_lib.BM25Index.build(PASSAGES)
  np.testing.assert_allclose(idx.scores(query), _reference_bm25(query, PASSAGES), rtol=1e-6,
                             atol=1e-7)
  bm25s = index_lib.bm25s
  direct = bm25s.BM25(k1=0.9, b=0.4, method="lucene")
  direct.index([index_lib.tokenize(index_lib.passage_text(p)) for p in PASSAGES],
               show_progress=False)
  tokens = [t for t in index_lib.tokenize(query) if t in direct.vocab_dict]
  expected = direct.get_scores(tokens) if tokens else np.zeros(len(PASSAGES))
  np.testing.assert_array_equal(idx.scores(query), np.asarray(expected, np.float32))


def test_ranking_golden_and_ties_by_corpus_order():
  idx = index_lib.BM25Index.build(PASSAGES)
  hits = idx.search(["red fox", "paint", "zzz", "fox"], topk=3)
  assert [[h.index for h in q] for q in hits] == [[0, 2, 1], [2, 3], [], [1, 0]]
  assert hits[1][0].score == hits[1][1].score  # a tie: corpus order
  assert hits[0][0].score == pytest.approx(_reference_bm25("red fox", PASSAGES)[0], rel=1e-6)
  twins = [dataset.Passage(str(i), "Same", "same words") for i in range(4)]
  assert [h.index for h in index_lib.BM25Index.build(twins).search(["same"], 3)[0]] == [0, 1, 2]
  with pytest.raises(ValueError, match="topk must be >= 1"):
    idx.search(["x"], 0)


def test_the_streamed_build_equals_bm25s_own_index():
  """`build_bm25s` (chunks of passages, numpy pairs) against `bm25s.BM25.index` over the
  tokenised corpus: per term the same documents and bitwise the same scores (bm25s orders
  its vocabulary by a set, the streamed build by first appearance), and bitwise the same
  query scores."""
  import random
  import scipy.sparse as sp
  rng = random.Random(0)
  words = [f"w{i}" for i in range(300)] + sorted(index_lib.STOPWORDS)
  passages = [dataset.Passage(str(i), f"T{rng.randrange(50)} title",
                              " ".join(rng.choice(words) for _ in range(rng.randrange(1, 40))))
              for i in range(2000)]
  ref = index_lib.bm25s.BM25(k1=index_lib.K1, b=index_lib.B, method="lucene")
  ref.index([index_lib.tokenize(index_lib.passage_text(p)) for p in passages], show_progress=False)
  got = index_lib.build_bm25s(passages, chunk=333)  # 7 chunks, the last one short

  def by_term(model):
    s = model.scores
    mat = sp.csc_matrix((s["data"], s["indices"], s["indptr"]),
                        shape=(s["num_docs"], len(s["indptr"]) - 1))
    names = sorted(k for k in model.vocab_dict if k)
    return names, mat[:, [model.vocab_dict[k] for k in names]].toarray()

  (ref_names, ref_mat), (names, mat) = by_term(ref), by_term(got)
  assert names == ref_names and mat.dtype == ref_mat.dtype == np.float32
  np.testing.assert_array_equal(mat, ref_mat)
  assert got.vocab_dict[""] == ref.vocab_dict[""] == len(names)
  for query in (["w1", "w2", "t3"], ["title"], ["w299", "w299"]):
    np.testing.assert_array_equal(got.get_scores(query), ref.get_scores(query))
  assert list(got.vocab_dict)[:2] == ["t24", "title"]  # first appearance: deterministic


def _write_corpus(path: pathlib.Path, passages=PASSAGES):
  path.write_text("".join(json.dumps({"id": p.id, "contents": f"{p.title}\n{p.text}"}) + "\n"
                          for p in passages))


def test_index_saved_beside_the_corpus_and_rebuilt_when_it_changes(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  _write_corpus(corpus)
  passages = dataset.load_corpus(corpus)
  first = index_lib.BM25Index.for_corpus(corpus, passages)
  meta = tmp_path / "corpus.jsonl.bm25s" / "meta.json"
  assert meta.is_file()
  stamp = meta.stat().st_mtime_ns
  again = index_lib.BM25Index.for_corpus(corpus, passages)  # loaded, not rebuilt
  assert meta.stat().st_mtime_ns == stamp
  for q in ["red fox", "blue paint"]:
    np.testing.assert_array_equal(first.scores(q), again.scores(q))
  _write_corpus(corpus, PASSAGES[:3])
  os.utime(corpus, ns=(stamp + 10**9, stamp + 10**9))
  rebuilt = index_lib.BM25Index.for_corpus(corpus, dataset.load_corpus(corpus))
  assert rebuilt.num_passages == 3


def test_synthetic_retrieval_is_deterministic_across_processes():
  code = ("from env_servers.retriever import client; r = client.LocalRetriever("
          f"{str(dataset.SYNTHETIC_DIR / 'corpus.jsonl')!r}); "
          "print([[(h.index, round(h.score, 5)) for h in q] for q in r.search("
          "['Who founded Liorkexkuth Works?', 'Ruvin', 'poet glass lenses'], 3)])")
  outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout for _ in range(2)}
  assert len(outs) == 1
  # the organisation first; equal scores in corpus order
  assert outs.pop().startswith("[[(336, 6.93425), (240, 2.98641), (245, 2.98641)], [(378, ")


# -- the gRPC server -----------------------------------------------------------------------
def _start(corpus, port=0, extra=()):
  proc = subprocess.Popen([sys.executable, "-m", "env_servers.retriever", "--corpus", str(corpus),
                           "--port", str(port), *extra], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  line = proc.stdout.readline()
  if not line.startswith("PORT "):
    proc.kill()
    raise AssertionError(f"retriever did not start: {line!r} {proc.stderr.read()[-2000:]}")
  return proc, int(line.split()[1])


def _stop(proc):
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=20) == 0


def test_server_answers_batches_as_in_process(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  _write_corpus(corpus)
  proc, port = _start(corpus)
  try:
    remote = client_lib.RemoteRetriever(f"127.0.0.1:{port}", timeout_s=5)
    local = client_lib.LocalRetriever(corpus)
    queries = ["red fox", "paint", "zzz", "fence"]
    assert remote.search(queries, 2) == local.search(queries, 2)
    d = remote.describe()
    assert (d.num_passages, d.method) == (5, "bm25 k1=0.9 b=0.4")
    with pytest.raises(client_lib.RetrieverError, match=r"refused Retrieve \(INVALID_ARGUMENT: "
                       r"topk=99 outside 1\.\.50"):
      remote.search(["x"], 99)
    remote.close()
  finally:
    _stop(proc)


def test_killed_retriever_is_a_clear_error_then_recovers(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  _write_corpus(corpus)
  proc, port = _start(corpus)
  remote = client_lib.RemoteRetriever(f"127.0.0.1:{port}", timeout_s=1, tries=2, backoff_s=0.1)
  assert [h.index for h in remote.search(["fox"], 3)[0]] == [1, 0]
  proc.kill()
  proc.wait()
  start = time.perf_counter()
  with pytest.raises(client_lib.RetrieverError) as e:
    remote.search(["fox"], 3)
  assert time.perf_counter() - start < 10
  message = str(e.value)
  assert "\n" not in message and f"retriever at 127.0.0.1:{port} did not answer Retrieve after " \
      "2 tries of 1 s (DEADLINE_EXCEEDED" in message
  proc, _ = _start(corpus, port)  # restarted on the same port: the same client recovers
  try:
    assert [h.index for h in remote.search(["fox"], 3)[0]] == [1, 0]
  finally:
    _stop(proc)


def test_server_token(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  _write_corpus(corpus)
  (tmp_path / "token").write_text("s3cret\n")
  proc, port = _start(corpus, extra=["--token-file", str(tmp_path / "token")])
  try:
    with pytest.raises(client_lib.RetrieverError, match="UNAUTHENTICATED"):
      client_lib.RemoteRetriever(f"127.0.0.1:{port}").search(["fox"], 1)
    good = client_lib.make_retriever(f"127.0.0.1:{port}", "", token_file=str(tmp_path / "token"))
    assert good.search(["fox"], 1)[0][0].passage.title == "Beta"
  finally:
    _stop(proc)


def test_tls_with_a_self_signed_certificate_and_token(tmp_path):
  """The retriever server over TLS (and a token), as the env servers serve: a client that
  trusts the certificate gets the in-process hits; a plaintext client and a client that
  trusts another CA fail at the transport, after their tries, in one line."""
  import shutil

  from env_servers.retriever import server as server_lib
  if shutil.which("openssl") is None:
    pytest.skip("openssl is not installed")

  def certificate(name):
    key, cert = tmp_path / f"{name}.key", tmp_path / f"{name}.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert.read_bytes(), key.read_bytes()
  cert, key = certificate("server")
  other, _ = certificate("other")
  corpus = tmp_path / "corpus.jsonl"
  _write_corpus(corpus)
  local = client_lib.LocalRetriever(corpus, save_index=False)
  server, port = server_lib.make_server(local, "127.0.0.1", 0, token="s3cret", tls=(cert, key))
  try:
    address = f"localhost:{port}"
    good = client_lib.RemoteRetriever(address, token="s3cret", tls_root_cert=cert, timeout_s=5)
    assert good.search(["red fox", "paint"], 2) == local.search(["red fox", "paint"], 2)
    good.close()
    for client in (client_lib.RemoteRetriever(address, token="s3cret", timeout_s=1, tries=2,
                                              backoff_s=0.01),
                   client_lib.RemoteRetriever(address, token="s3cret", tls_root_cert=other,
                                              timeout_s=1, tries=2, backoff_s=0.01)):
      with pytest.raises(client_lib.RetrieverError, match="did not answer Retrieve after 2 "
                         r"tries of 1 s \((UNAVAILABLE|DEADLINE_EXCEEDED)") as e:
        client.search(["fox"], 1)
      assert "\n" not in str(e.value)
      client.close()
  finally:
    server.stop(None)


def test_bad_server_arguments_are_one_line(tmp_path):
  out = subprocess.run([sys.executable, "-m", "env_servers.retriever", "--corpus",
                        str(tmp_path / "missing.jsonl")], capture_output=True, text=True)
  assert out.returncode == 2
  assert out.stderr.strip().splitlines()[-1].startswith("retriever: search corpus ")
  with pytest.raises(ValueError, match="is not host:port"):
    client_lib.RemoteRetriever("localhost")


def test_servers_building_the_index_at_once_leave_one_complete_index(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  _write_corpus(corpus)
  code = ("from env_servers.retriever import client; r = client.LocalRetriever("
          f"{str(corpus)!r}); print([h.index for h in r.search(['red fox'], 3)[0]])")
  procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
           for _ in range(3)]
  assert [p.communicate(timeout=120)[0].strip() for p in procs] == ["[0, 2, 1]"] * 3
  assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "corpus.jsonl.bm25s"]
  assert (tmp_path / "corpus.jsonl.bm25s" / "meta.json").is_file()
