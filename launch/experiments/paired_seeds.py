"""Two settings compared seed by seed: train success and held-out success of finished runs.

  python -m launch.experiments.paired_seeds --a RUN [RUN ...] --b RUN [RUN ...] \
      [--split valid_unseen]

The i-th run of `--a` pairs with the i-th run of `--b` (the same seed: the same task
order and env seeds, so their difference is paired). Each RUN is a trainer workdir
(`metrics.jsonl` with its final evaluation). Per pair it prints the train success over the
last 3 iterations and the held-out success at the end (`report.summarize_run`, the
tables' columns); then each side's mean ± std and the mean paired difference b - a with
its 95 % t interval over the pairs (`report.t975`), and whether the interval decides it.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys


FIELDS = (("train_final", "train success, last 3 iterations"),
          ("eval_final", "held-out success at the end"))


def compare(a: list[str], b: list[str], split: str) -> dict:
  """Per pair (a, b) values of `FIELDS`, and per field the sides' means and the paired
  difference's mean and 95 % t interval (None with fewer than 2 pairs)."""
  from hgpo_jax.training import run_records
  from launch.experiments import report
  if len(a) != len(b):
    raise ValueError(f"--a has {len(a)} runs and --b {len(b)}: runs pair by position")
  results = {}
  for name, dirs in (("a", a), ("b", b)):
    results[name] = []
    for d in dirs:
      if not run_records.is_finished(d):
        raise ValueError(f"{d} is not a finished run (no final evaluation in metrics.jsonl)")
      results[name].append(report.summarize_run(run_records.read_metrics(d), 0, split))
  out = {"pairs": [], "fields": {}}
  for ra, rb in zip(results["a"], results["b"]):
    out["pairs"].append({f: (getattr(ra, f), getattr(rb, f)) for f, _ in FIELDS})
  for f, _ in FIELDS:
    va = [p[f][0] for p in out["pairs"]]
    vb = [p[f][1] for p in out["pairs"]]
    if None in va or None in vb:
      raise ValueError(f"a run has no {f.replace('_', ' ')} on split {split!r}")
    diffs = [y - x for x, y in zip(va, vb)]
    n = len(diffs)
    half = (report.t975(n - 1) * statistics.stdev(diffs) / math.sqrt(n)) if n > 1 else None
    mean = statistics.fmean(diffs)
    out["fields"][f] = {"a": report.mean_std(va), "b": report.mean_std(vb), "diff": mean,
                        "interval": None if half is None else (mean - half, mean + half)}
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m launch.experiments.paired_seeds",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--a", nargs="+", required=True, help="the first setting's runs, by seed")
  ap.add_argument("--b", nargs="+", required=True, help="the second setting's runs, same seeds")
  ap.add_argument("--split", default="valid_unseen")
  args = ap.parse_args(argv)
  try:
    out = compare(args.a, args.b, args.split)
  except (OSError, ValueError, KeyError) as e:
    print(f"paired_seeds: {e}", file=sys.stderr)
    return 2
  for i, p in enumerate(out["pairs"]):
    print(f"pair {i + 1}: " + "; ".join(
        f"{label} a {100 * p[f][0]:.1f} %, b {100 * p[f][1]:.1f} %" for f, label in FIELDS))
  for f, label in FIELDS:
    r = out["fields"][f]
    line = (f"{label}: a {100 * r['a'][0]:.1f} ± {100 * r['a'][1]:.1f} %, b "
            f"{100 * r['b'][0]:.1f} ± {100 * r['b'][1]:.1f} %; b - a {100 * r['diff']:+.1f} "
            "points")
    if r["interval"] is not None:
      lo, hi = r["interval"]
      verdict = "within seed noise" if lo <= 0 <= hi else "decided"
      line += f", 95 % t interval over {len(out['pairs'])} seeds [{100 * lo:+.1f}, {100 * hi:+.1f}] ({verdict})"
    print(line)
  return 0


if __name__ == "__main__":
  sys.exit(main())
