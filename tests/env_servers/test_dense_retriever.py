"""Dense retrieval (env_servers/retriever/dense.py) on a tiny random BERT encoder: hits equal
a readable reference (each text alone through transformers, masked mean of the last hidden
states, unit norm, inner products of every passage, best first, ties by corpus position),
E5's prefixes by the encoder's name, the index saved beside the corpus and loaded back,
the server's `--dense-model` answering as in process, and bad encoders in one line."""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("faiss")

from env_servers.retriever import client as client_lib  # noqa: E402
from env_servers.retriever import dense  # noqa: E402
from env_servers.retriever import index as index_lib  # noqa: E402
from env_servers.search import dataset  # noqa: E402
from hgpo_jax.envs import launcher  # noqa: E402

DOCS = [("Alpha", "the red fox jumps over the red fence"),
        ("Beta", "a blue fox sleeps"),
        ("Gamma", "red red red paint"),
        ("Delta", "fence posts and blue paint"),
        ("Epsilon", "nothing in common here"),
        ("Alpha", "the red fox jumps over the red fence")]  # a duplicate: a tie by position
QUERIES = ["red fox", "blue paint fence", "nothing", "sleeps"]


@pytest.fixture(name="encoder_dir", scope="module")
def fixture_encoder_dir(tmp_path_factory) -> str:
  """A random 2-layer BERT with a word-level vocabulary of the corpus; the directory name
  holds "e5", so the E5 prefixes apply."""
  path = tmp_path_factory.mktemp("models") / "tiny-e5-encoder"
  words = sorted({w for t, x in DOCS for w in f"{t} {x}".lower().split()}
                 | {w for q in QUERIES for w in q.split()} | {"query", "passage", ":"})
  path.mkdir()
  (path / "vocab.txt").write_text("\n".join(
      ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
  transformers.BertTokenizerFast(vocab_file=str(path / "vocab.txt")).save_pretrained(path)
  config = transformers.BertConfig(vocab_size=5 + len(words), hidden_size=32,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, max_position_embeddings=64)
  torch.manual_seed(0)
  transformers.BertModel(config).eval().save_pretrained(path)
  return str(path)


def _corpus(tmp_path: pathlib.Path) -> pathlib.Path:
  path = tmp_path / "corpus.jsonl"
  path.write_text("".join(json.dumps({"id": str(i), "contents": f"{t}\n{x}"}) + "\n"
                          for i, (t, x) in enumerate(DOCS)))
  return path


@functools.lru_cache(maxsize=2)
def _reference_model(model_dir: str):
  return (transformers.AutoTokenizer.from_pretrained(model_dir),
          transformers.AutoModel.from_pretrained(model_dir).eval())


def _reference_embedding(model_dir: str, text: str) -> np.ndarray:
  """One text alone (no padding) through transformers: masked mean, unit norm."""
  tok, model = _reference_model(model_dir)
  with torch.no_grad():
    h = model(**tok([text], return_tensors="pt")).last_hidden_state[0].double().numpy()
  v = h.mean(axis=0)
  return v / np.linalg.norm(v)


def _reference_search(model_dir: str, query: str, topk: int) -> list[tuple[int, float]]:
  q = _reference_embedding(model_dir, "query: " + query)
  scores = [float(q @ _reference_embedding(model_dir, f"passage: {t}\n{x}")) for t, x in DOCS]
  order = sorted(range(len(DOCS)), key=lambda i: (-round(scores[i], 5), i))[:topk]
  return [(i, scores[i]) for i in order]


def test_hits_equal_the_reference_with_e5_prefixes_and_ties_by_position(encoder_dir, tmp_path):
  spec = dense.EncoderSpec(encoder_dir)
  assert (spec.query_prefix, spec.passage_prefix) == ("query: ", "passage: ")
  assert dense.EncoderSpec("/models/bge-base").query_prefix == ""  # not an E5 name
  corpus = _corpus(tmp_path)
  passages = dataset.load_corpus(corpus)
  idx = dense.DenseIndex.for_corpus(corpus, passages, spec, batch_size=4)  # two batches
  for query in QUERIES:
    got = idx.search([query], topk=4)[0]
    want = _reference_search(encoder_dir, query, 4)
    assert [h.index for h in got] == [i for i, _ in want], query
    np.testing.assert_allclose([h.score for h in got], [s for _, s in want], atol=1e-5)
  # the duplicate passage scores as its twin and ranks right after it
  hits = idx.search(["red fox"], topk=len(DOCS))[0]
  pos = {h.index: k for k, h in enumerate(hits)}
  assert abs(pos[5] - pos[0]) == 1 and pos[0] < pos[5]
  assert idx.search([], 3) == [] and len(idx.search(["fox"], 50)[0]) == len(DOCS)
  with pytest.raises(ValueError, match="topk must be >= 1"):
    idx.search(["fox"], 0)


def test_the_index_is_saved_beside_the_corpus_and_loaded_back(encoder_dir, tmp_path, monkeypatch):
  corpus = _corpus(tmp_path)
  passages = dataset.load_corpus(corpus)
  spec = dense.EncoderSpec(encoder_dir)
  first = dense.DenseIndex.for_corpus(corpus, passages, spec).search(QUERIES, 3)
  saved = list(tmp_path.glob("corpus.jsonl.dense-*"))
  assert len(saved) == 1 and (saved[0] / "index.faiss").is_file()

  def no_build(*args, **kwargs):
    raise AssertionError("rebuilt although saved")
  monkeypatch.setattr(dense.DenseIndex, "build", no_build)
  assert dense.DenseIndex.for_corpus(corpus, passages, spec).search(QUERIES, 3) == first
  other = dense.EncoderSpec(encoder_dir, pooling="cls")  # another encoder setting: rebuilt
  with pytest.raises(AssertionError, match="rebuilt"):
    dense.DenseIndex.for_corpus(corpus, passages, other)


def test_the_server_with_a_dense_model_answers_as_in_process(encoder_dir, tmp_path):
  corpus = _corpus(tmp_path)
  local = client_lib.make_retriever("", str(corpus), dense_model=encoder_dir)  # the env's
  assert isinstance(local.index, dense.DenseIndex)
  proc = launcher.start_retriever(str(corpus), dense_model=encoder_dir)
  try:
    remote = client_lib.RemoteRetriever(proc.endpoint)
    got = remote.search(QUERIES, 3)
    want = local.search(QUERIES, 3)
    assert [[r.index for r in hits] for hits in got] == [[r.index for r in hits] for hits in want]
    np.testing.assert_allclose([r.score for hits in got for r in hits],
                               [r.score for hits in want for r in hits], atol=1e-6)
    remote.close()
  finally:
    proc.stop()


def test_bad_encoders_are_one_line(tmp_path):
  corpus = _corpus(tmp_path)
  (tmp_path / "not-a-model").mkdir()
  proc = subprocess.run([sys.executable, "-m", "env_servers.retriever", "--corpus", str(corpus),
                         "--dense-model", str(tmp_path / "not-a-model")],
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and "Traceback" not in proc.stderr
  assert proc.stderr.strip().splitlines()[-1].startswith(
      "retriever: cannot load the encoder"), proc.stderr
  with pytest.raises(dense.DenseRetrievalError, match="pooling='max': use one of"):
    dense.EncoderSpec("x", pooling="max")
  with pytest.raises(ValueError, match="embeds with its own --dense-model"):
    client_lib.make_retriever("127.0.0.1:1", str(corpus), dense_model="x")
  assert index_lib.passage_text(dataset.Passage("0", "T", "x")) == "T\nx"
