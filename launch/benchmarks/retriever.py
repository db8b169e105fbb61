"""The BM25 retriever's queries/s: in process, and through its gRPC server batched and one
query per call, on a generated corpus of wiki-18-like passages.

  python -m launch.benchmarks.retriever                       # 10,000 passages, < 1 min
  python -m launch.benchmarks.retriever --passages 1000000 --build-reps 1

A corpus of `--passages` passages (Search-R1's corpus format, `{"id", "contents":
"title\\ntext"}`, each a 2-word title and `--words` words of text, 100 by default as
wiki-18's passages) is generated into a temporary directory, deleted afterwards: English
function words (Lucene's stop words among them, which the tokenizer drops) and invented
words (random syllables), drawn with Zipf frequencies (rank r with weight 1 / r) from a
vocabulary of `--vocab` words. Queries are a passage's title and four words of its text,
so each has hits. Everything derives from `--seed` (numpy's PCG64), so a size gives the
same corpus and queries on every run. This is not wiki-18: its term statistics are
Zipf's law, not Wikipedia's.

Measured, as the search env and `python -m env_servers.retriever` use the retriever:

  * index build: `BM25Index.for_corpus` without a saved index (tokenise, bm25s index,
    save beside the corpus), median of `--build-reps`; then the start of a process that
    finds it saved (`LocalRetriever`: corpus load + index load) and of the server
    subprocess (until it prints `PORT`);
  * queries/s of three sides, each answering the same `--batch` queries (top `--topk`) per
    repetition, the sides alternating repetition by repetition after one untimed
    repetition each (`harness.alternating_medians`), medians of `--reps`:
      in-process            `LocalRetriever.search(batch)` in this process;
      gRPC batched          `RemoteRetriever.search(batch)`: one `Retrieve` call;
      gRPC one per call     `RemoteRetriever.search([q])` for each query, as an env
                            server searches (one query per step).
    The gRPC sides must return the in-process hits (index and score) or the run fails;
  * peak resident memory of this process (which built the index) and of the server
    (which loaded it).

The last line is the ratio of the batched gRPC side to the one-query-per-call side:
  batched gRPC / one-query-per-call gRPC: N.NNx queries/s
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

from env_servers.retriever import client as client_lib
from env_servers.retriever import index as index_lib
from env_servers.search import dataset
from launch.benchmarks import harness

PROG = "python -m launch.benchmarks.retriever"
MAX_TOPK = 50  # the server's default --max-topk
# The most frequent words of English text, most frequent first: the head of the Zipf
# distribution, as in Wikipedia (Lucene's stop words among them: the tokenizer drops those).
FUNCTION_WORDS = ("the of and in a to was is for on as by with he at from his an were are "
                  "which be this has or it also its first their one after two new who they "
                  "been had her she not but time into year years other all more most").split()
_ONSETS = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
           "br", "ch", "dr", "gr", "pl", "sh", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ea", "io", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "m", "t", "nd", "rk", "st"]


def vocabulary(size: int, rng: np.random.Generator) -> list[str]:
  """`size` distinct words, most frequent first: the function words, then invented ones."""
  words, seen = list(FUNCTION_WORDS[:size]), set(FUNCTION_WORDS)
  while len(words) < size:
    draws = 2 * (size - len(words)) + 64
    syllables = rng.integers(1, 4, size=draws)
    parts = rng.integers(0, [len(_ONSETS), len(_VOWELS), len(_CODAS)], size=(draws, 3, 3))
    for n, word_parts in zip(syllables.tolist(), parts.tolist()):
      word = "".join(_ONSETS[o] + _VOWELS[v] + _CODAS[c] for o, v, c in word_parts[:n])
      if word not in seen and len(word) >= 3:
        seen.add(word)
        words.append(word)
        if len(words) == size:
          break
  return words


def write_corpus(path: pathlib.Path, passages: int, words: int, vocab: int, queries: int,
                 seed: int, chunk: int = 10_000) -> list[str]:
  """Writes the corpus jsonl of `passages` passages to `path`; returns `queries` queries
  (each the title and four text words of a passage drawn uniformly)."""
  # one stream per kind of draw, so that the chunk size changes nothing
  vocab_rng, source_rng, text_rng, title_rng, pick_rng = (
      np.random.default_rng([seed, k]) for k in range(5))
  vocab_words = np.array(vocabulary(vocab, vocab_rng), dtype=object)
  cdf = np.cumsum(1.0 / np.arange(1, vocab + 1))
  cdf /= cdf[-1]
  sources = source_rng.integers(0, passages, size=queries)
  wanted = {}
  for q, p in enumerate(sources.tolist()):
    wanted.setdefault(p, []).append(q)
  out = [""] * queries
  with open(path, "w", encoding="utf-8") as f:
    for start in range(0, passages, chunk):
      n = min(chunk, passages - start)
      text_ids = np.minimum(np.searchsorted(cdf, text_rng.random((n, words))), vocab - 1)
      # titles from the rarer half of the head: names, not function words
      title_ids = title_rng.integers(len(FUNCTION_WORDS), min(vocab, 5000), size=(n, 2))
      lines = []
      for i in range(n):
        title = " ".join(w.capitalize() for w in vocab_words[title_ids[i]])
        text = " ".join(vocab_words[text_ids[i]])
        lines.append(json.dumps({"id": str(start + i), "contents": f"{title}\n{text}"}))
        for q in wanted.get(start + i, ()):
          picks = pick_rng.choice(words, size=min(4, words), replace=False)
          out[q] = f"{title} {' '.join(vocab_words[text_ids[i][picks]])}"
      f.write("\n".join(lines) + "\n")
  return out


def _start_server(corpus: pathlib.Path, log_path: pathlib.Path) -> tuple[subprocess.Popen, int]:
  """`python -m env_servers.retriever` on the corpus; (process, port) once it prints PORT."""
  log = open(log_path, "w")
  proc = subprocess.Popen(
      [sys.executable, "-m", "env_servers.retriever", "--corpus", str(corpus), "--port", "0",
       "--max-topk", str(MAX_TOPK), "--parent-pid", str(os.getpid()), "--log-level", "WARNING"],
      cwd=harness.REPO_ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
  log.close()
  line = proc.stdout.readline()  # blocks until PORT or the server exits
  if not line.startswith("PORT "):
    proc.wait()
    tail = [l for l in log_path.read_text().splitlines() if l.strip()][-1:] or ["no output"]
    raise SystemExit(f"{PROG}: error: the retriever server exited ({proc.returncode}) "
                     f"before serving: {tail[0]}")
  return proc, int(line.split()[1])


def _peak_rss_gib(pid: int) -> float | None:
  """Peak resident memory of a live process (Linux's VmHWM). Not the child's `ru_maxrss`:
  Linux counts the parent's memory at the fork in that."""
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(l.split()[1]) / 2**20 for l in f if l.startswith("VmHWM:"))
  except (OSError, StopIteration, ValueError):
    return None


def _stop_server(proc: subprocess.Popen) -> None:
  proc.terminate()
  try:
    proc.wait(timeout=30)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  proc.stdout.close()


def _hits(results) -> list[list[tuple[int, float]]]:
  return [[(r.index, r.score) for r in hits] for hits in results]


def _gib_self() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def run(args: argparse.Namespace, workdir: pathlib.Path) -> list[str]:
  """The benchmark in `workdir`; returns the printed lines."""
  lines = []

  def say(line: str) -> None:
    lines.append(line)
    print(line, flush=True)

  corpus = workdir / "corpus.jsonl"
  t0 = time.perf_counter()
  queries = write_corpus(corpus, args.passages, args.words, args.vocab, args.batch, args.seed)
  say(f"corpus: {args.passages:,} passages x {args.words} words (vocabulary {args.vocab:,}, "
      f"seed {args.seed}), {corpus.stat().st_size / 2**20:,.1f} MiB, generated in "
      f"{time.perf_counter() - t0:.1f} s")

  t0 = time.perf_counter()
  passages = dataset.load_corpus(corpus)
  load_s = time.perf_counter() - t0
  index_dir = corpus.with_name(corpus.name + ".bm25s")
  build_s = []
  for _ in range(args.build_reps):
    shutil.rmtree(index_dir, ignore_errors=True)
    index = None
    gc.collect()
    t0 = time.perf_counter()
    index = index_lib.BM25Index.for_corpus(corpus, passages, save=True)
    build_s.append(time.perf_counter() - t0)
  del index, passages
  gc.collect()
  build = float(np.median(build_s))
  say(f"index build (tokenise + bm25s index + save): {build:.2f} s (median of "
      f"{args.build_reps}: {', '.join(f'{s:.2f}' for s in build_s)}); corpus load "
      f"{load_s:.2f} s")

  t0 = time.perf_counter()
  local = client_lib.LocalRetriever(corpus)
  say(f"start with the saved index (corpus + index load, in process): "
      f"{time.perf_counter() - t0:.2f} s")
  t0 = time.perf_counter()
  proc, port = _start_server(corpus, workdir / "server.log")
  try:
    say(f"start of the server subprocess (until PORT): {time.perf_counter() - t0:.2f} s")
    remote = client_lib.RemoteRetriever(f"127.0.0.1:{port}", timeout_s=args.timeout_s, tries=1)
    try:
      expected = _hits(local.search(queries, args.topk))
      if not all(expected):
        raise SystemExit(f"{PROG}: error: a query without hits; the corpus generator is broken")
      for name, got in (("gRPC batched", remote.search(queries, args.topk)),
                        ("gRPC one per call",
                         [h for q in queries for h in remote.search([q], args.topk)])):
        if _hits(got) != expected:
          raise SystemExit(f"{PROG}: error: {name} returned other hits than in-process")
      sides = {
          "in-process": lambda: local.search(queries, args.topk),
          "gRPC batched": lambda: remote.search(queries, args.topk),
          "gRPC one per call": lambda: [remote.search([q], args.topk) for q in queries],
      }
      med = harness.alternating_medians(sides, args.reps, warmup=1)
      server_gib = _peak_rss_gib(proc.pid)
    finally:
      remote.close()
  finally:
    _stop_server(proc)
  qps = {name: args.batch / s for name, s in med.items()}
  say(f"queries/s, {args.batch} queries of top {args.topk} per call, medians of {args.reps} "
      f"alternating repetitions:")
  for name, s in med.items():
    say(f"  {name:>17}: {qps[name]:10,.1f} queries/s ({1e3 * s / args.batch:.3f} ms per query)")
  server = "unknown" if server_gib is None else f"{server_gib:.2f} GiB"
  say(f"peak resident memory: this process {_gib_self():.2f} GiB, server {server}")
  say(f"gRPC batched / in-process: {qps['gRPC batched'] / qps['in-process']:.2f}x queries/s")
  say(f"batched gRPC / one-query-per-call gRPC: "
      f"{qps['gRPC batched'] / qps['gRPC one per call']:.2f}x queries/s")
  return lines


def main(argv: list[str] | None = None) -> list[str]:
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
  parser.add_argument("--passages", type=int, default=10_000, help="corpus size")
  parser.add_argument("--words", type=int, default=100, help="words of text per passage")
  parser.add_argument("--vocab", type=int, default=200_000, help="distinct words")
  parser.add_argument("--batch", type=int, default=64, help="queries per call")
  parser.add_argument("--topk", type=int, default=3, help="hits per query (Search-R1: 3)")
  parser.add_argument("--reps", type=int, default=7, help="timed repetitions per side")
  parser.add_argument("--build-reps", type=int, default=3, help="index builds timed")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--timeout-s", type=float, default=600.0, help="deadline of a gRPC call")
  parser.add_argument("--tmp-dir", default=None,
                      help="where the corpus and index are written (default: the system's)")
  args = parser.parse_args(argv)
  for flag in ("passages", "words", "batch", "reps", "build_reps"):
    if getattr(args, flag) < 1:
      parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
  if args.vocab < len(FUNCTION_WORDS) + 100:
    parser.error(f"--vocab must be >= {len(FUNCTION_WORDS) + 100}, got {args.vocab}")
  if not 1 <= args.topk <= MAX_TOPK:
    parser.error(f"--topk must be in 1..{MAX_TOPK} (the server's --max-topk), got {args.topk}")
  if args.timeout_s <= 0:
    parser.error(f"--timeout-s must be > 0, got {args.timeout_s}")
  if args.tmp_dir is not None and not os.path.isdir(args.tmp_dir):
    parser.error(f"--tmp-dir {args.tmp_dir} is not a directory")
  workdir = pathlib.Path(tempfile.mkdtemp(prefix="retriever_bench_", dir=args.tmp_dir))
  try:
    return run(args, workdir)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
  # SIGTERM (a timeout, a watchdog) unwinds main, so the server stops and the corpus and
  # index (1.5 GiB at a million passages) are deleted.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  main()
