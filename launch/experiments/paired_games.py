"""Two policies compared game by game over several evaluations of each.

  python -m launch.experiments.paired_games --a RUN [RUN ...] --b RUN [RUN ...] \
      [--split valid_unseen]

Each RUN is a run directory with per-task evaluation outcomes (`eval_tasks.jsonl`: a
training run's, or `launch.evaluate`'s, e.g. of one checkpoint with
`--config.eval.repeats=R` or several `--config.seed` evaluation streams); its last
evaluation of `--split` counts, with all its repeats. A game's score on a side is the mean
of its outcomes over that side's evaluations (the sides' runs must evaluate the same
games, paired by task id); the difference of the sides' means gets the paired bootstrap
interval over games (`report.paired_bootstrap`: 95 %, 10,000 resamples).
At temperature 0.4 one evaluation per game leaves an interval of about +-10 points on 48
games; averaging several evaluation keys per game narrows it.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def last_outcomes(run_dir: str, split: str) -> list[dict[str, bool]]:
  """{task id: won} of each repeat of `run_dir`'s last evaluation of `split` (one dict
  without `eval.repeats`); ValueError if it has none."""
  from hgpo_jax.training import run_records
  results = run_records.read_task_results(run_dir)
  steps = [step for step, s in results if s == split]
  if not steps:
    raise ValueError(f"{run_dir} holds no per-task evaluation of split {split!r}")
  repeats: dict[int, dict[str, bool]] = {}
  for r in results[(max(steps), split)]:
    repeats.setdefault(r.get("repeat", 0), {})[r["task_id"]] = bool(r["won"])
  return [repeats[k] for k in sorted(repeats)]


def compare(a: list[str], b: list[str], split: str) -> dict:
  """Per-run wins, the sides' mean success, and the paired difference b - a over games."""
  from launch.experiments import report
  sides, games = {}, None
  for name, dirs in (("a", a), ("b", b)):
    sides[name] = []
    for d in dirs:
      for outcomes in last_outcomes(d, split):
        games = sorted(outcomes) if games is None else games
        if sorted(outcomes) != games:
          raise ValueError(f"{d} evaluated other games than {a[0]}")
        sides[name].append(outcomes)
  mean = {name: np.array([np.mean([r[g] for r in runs]) for g in games])
          for name, runs in sides.items()}
  diff = mean["b"] - mean["a"]
  lo, hi = report.paired_bootstrap(diff)
  return {"games": len(games), "wins": {n: [sum(r.values()) for r in runs]
                                         for n, runs in sides.items()},
          "success": {n: float(m.mean()) for n, m in mean.items()}, "diff": float(diff.mean()),
          "interval": (lo, hi), "b_ahead": int((diff > 0).sum()),
          "b_behind": int((diff < 0).sum())}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m launch.experiments.paired_games",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--a", nargs="+", required=True, help="the first policy's run directories")
  ap.add_argument("--b", nargs="+", required=True, help="the second policy's run directories")
  ap.add_argument("--split", default="valid_unseen")
  args = ap.parse_args(argv)
  try:
    out = compare(args.a, args.b, args.split)
  except (OSError, ValueError) as e:
    print(f"paired_games: {e}", file=sys.stderr)
    return 2
  for name in ("a", "b"):
    print(f"{name}: wins per evaluation {out['wins'][name]} of {out['games']} games, success "
          f"{100 * out['success'][name]:.1f} %")
  lo, hi = out["interval"]
  print(f"b - a: {100 * out['diff']:+.1f} points, 95 % paired bootstrap over games "
        f"[{100 * lo:+.1f}, {100 * hi:+.1f}]; b ahead on {out['b_ahead']} games, behind on "
        f"{out['b_behind']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
