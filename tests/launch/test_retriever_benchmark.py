"""launch.benchmarks.retriever on a tiny corpus: its printed figures and last line, the
generated corpus, and its one-line refusals."""

import re
import subprocess
import sys

import numpy as np
import pytest

from env_servers.search import dataset
from launch.benchmarks import retriever as bench

LAST_LINE = re.compile(r"batched gRPC / one-query-per-call gRPC: (\d+\.\d\d)x queries/s")
RATE = re.compile(r"\s+(in-process|gRPC batched|gRPC one per call): +([\d,]+\.\d) queries/s "
                  r"\(([\d.]+) ms per query\)")


def test_main_prints_positive_rates_and_their_ratio_last(capsys):
  lines = bench.main(["--passages", "300", "--words", "40", "--vocab", "3000", "--batch", "6",
                      "--reps", "2", "--build-reps", "2"])
  assert capsys.readouterr().out.splitlines() == lines
  m = LAST_LINE.fullmatch(lines[-1])
  assert m, lines[-1]
  rates = {r.group(1): float(r.group(2).replace(",", "")) for r in map(RATE.fullmatch, lines) if r}
  assert sorted(rates) == ["gRPC batched", "gRPC one per call", "in-process"]
  assert all(v > 0 for v in rates.values()) and float(m.group(1)) > 0
  ratio = rates["gRPC batched"] / rates["gRPC one per call"]
  assert float(m.group(1)) == pytest.approx(ratio, rel=0.01, abs=0.006)
  build = re.match(r"index build .*: ([\d.]+) s \(median of 2: ([\d.]+), ([\d.]+)\)", lines[1])
  assert build and all(float(x) > 0 for x in build.groups()), lines[1]
  assert lines[0].startswith("corpus: 300 passages x 40 words (vocabulary 3,000, seed 0)")


def test_the_generated_corpus_is_deterministic_and_shaped_like_wiki18(tmp_path):
  args = dict(passages=120, words=100, vocab=2000, queries=9, seed=3)
  q1 = bench.write_corpus(tmp_path / "a.jsonl", **args, chunk=50)
  q2 = bench.write_corpus(tmp_path / "b.jsonl", **args)  # chunking changes nothing
  assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
  assert q1 == q2 and len(q1) == 9
  assert bench.write_corpus(tmp_path / "c.jsonl", **dict(args, seed=4)) != q1
  passages = dataset.load_corpus(tmp_path / "a.jsonl")
  assert [p.id for p in passages] == [str(i) for i in range(120)]
  assert all(len(p.title.split()) == 2 and len(p.text.split()) == 100 for p in passages)
  texts = {f"{p.title} {p.text}" for p in passages}
  # a query is a passage's title and four of its words
  assert all(any(set(q.split()) <= set(t.split()) for t in texts) for q in q1)
  words = [w for p in passages for w in p.text.split()]
  assert words.count("the") > words.count("of") > words.count("and") > 0  # Zipf's head
  vocab = bench.vocabulary(2000, np.random.default_rng(0))
  assert len(set(vocab)) == 2000 and vocab[:3] == ["the", "of", "and"]


@pytest.mark.parametrize("argv, message", [
    (["--passages", "0"], "--passages must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--reps", "0"], "--reps must be >= 1, got 0"),
    (["--build-reps", "-1"], "--build-reps must be >= 1, got -1"),
    (["--topk", "51"], "--topk must be in 1..50 (the server's --max-topk), got 51"),
    (["--vocab", "10"], "--vocab must be >= "),
    (["--timeout-s", "0"], "--timeout-s must be > 0, got 0.0"),
    (["--tmp-dir", "/no/such/dir"], "--tmp-dir /no/such/dir is not a directory"),
])
def test_bad_arguments_are_refused_in_one_line(capsys, argv, message):
  with pytest.raises(SystemExit) as e:
    bench.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith(f"{bench.PROG}: error: {message}"), err


def test_a_bad_argument_from_the_command_line_is_one_line_without_a_traceback():
  done = subprocess.run([sys.executable, "-m", "launch.benchmarks.retriever", "--passages",
                         "-5"], capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and "Traceback" not in done.stderr
  assert done.stderr.strip().splitlines()[-1] == (
      "python -m launch.benchmarks.retriever: error: --passages must be >= 1, got -5")


def test_a_server_that_cannot_start_is_one_line(tmp_path):
  with pytest.raises(SystemExit, match=r"^python -m launch.benchmarks.retriever: error: the "
                     r"retriever server exited \(2\) before serving: retriever: search corpus "
                     r".*missing.jsonl not found"):
    bench._start_server(tmp_path / "missing.jsonl", tmp_path / "server.log")
