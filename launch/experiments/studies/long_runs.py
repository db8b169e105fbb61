"""Long runs of the critic methods: curves, critic fit and HiPER's segment statistics.

  python -m launch.experiments.studies.long_runs --root RUNS --env alfworld_mini --methods hiper ppo \\
      --out results/hiper_long [--reading NOTES.md]

Reads the runs of `launch.experiments.sweep` under `RUNS/mini/<env>/<method>/seed_<n>/` (finished or
not: a run still going shows the iterations it has) and writes `<out>.csv` (one line per
method, seed and iteration), `<out>.png` (train success with a ± std band over seeds; the
critic's explained variance, per level for HiPER; HiPER's SWITCH and subgoal-change rates)
and `<out>.md` (success at every tenth iteration, the last ten iterations' means, the
held-out evaluation at the end, and, when the runs dumped their rollouts with
`--config.rollout.dump=true`, HiPER's advantage by position within a subgoal segment).
`--reading` appends a hand-written reading of the curves under "Reading".
"""

from __future__ import annotations

import argparse
import collections
import csv
import glob
import io
import os
import platform
import sys
from typing import Sequence

import numpy as np

from hgpo_jax.training import run_records
from launch.experiments import report

COLUMNS = ("rollout/success", "rollout/invalid_rate", "rollout/episode_length",
           "critic/explained_variance", "critic/explained_variance_low",
           "critic/explained_variance_high", "critic/explained_variance_term",
           "rollout/switch_rate", "rollout/subgoal_change_rate", "advantage/std",
           "time/iteration_s")
LAST = 10  # iterations averaged in the "last" columns
LABELS = {"hiper": "HiPER", "ppo": "PPO (critic)"}


def run_dirs(root: str, env: str, method: str) -> list[tuple[int, str]]:
  """(seed, run directory) of every run of `method` on `env` under the sweep root."""
  return [(seed, path) for _, _, seed, path in run_records.find_runs(os.path.join(root, "mini"),
                                                                  env, method)]


def final_eval(run_dir: str, heldout: str = "valid_unseen") -> float | None:
  lines = run_records.read_metrics(run_dir)
  key = f"eval/{heldout}/success"
  found = [float(l[key]) for l in lines if key in l]
  return found[-1] if found else None


def segment_positions(rows: Sequence[dict]) -> dict[tuple[int, int], int]:
  """(traj, step) -> position within its subgoal segment: 0 at turn 0 and at every turn
  whose parsed switch is not KEEP (the estimator's boundaries), else previous + 1."""
  pos = {}
  for r in sorted(rows, key=lambda r: (r["traj"], r["step"])):
    prev = pos.get((r["traj"], r["step"] - 1))
    start = r["step"] == 0 or prev is None or r.get("switch") != "KEEP"
    pos[(r["traj"], r["step"])] = 0 if start else prev + 1
  return pos


def advantage_by_segment_position(dump_files: Sequence[str], max_position: int = 3
                                  ) -> dict[int, tuple[int, float, float]]:
  """Position (the last bucket is "max_position or later") -> (rows, mean advantage, mean
  |advantage|) of the row advantages in the dumps."""
  acc: dict[int, list[float]] = collections.defaultdict(list)
  for path in dump_files:
    rows = run_records.read_jsonl(path)
    pos = segment_positions(rows)
    for r in rows:
      acc[min(pos[(r["traj"], r["step"])], max_position)].append(float(r["advantage"]))
  return {p: (len(v), float(np.mean(v)), float(np.mean(np.abs(v)))) for p, v in sorted(acc.items())}


def _series(runs: Sequence[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """(iterations, mean, std over seeds) of `key` over the iterations every seed has."""
  n = min((len(r) for r in runs), default=0)
  if n == 0 or any(key not in l for r in runs for l in r[:n]):
    return None
  ys = np.array([[float(l[key]) for l in r[:n]] for r in runs])
  std = ys.std(axis=0, ddof=1) if len(ys) > 1 else np.zeros(n)
  return np.arange(1, n + 1), ys.mean(axis=0), std


def _ms(values: Sequence[float], pct: bool = False) -> str:
  if not values:
    return "—"
  scale = 100.0 if pct else 1.0
  v = np.asarray(values, float) * scale
  std = f" ± {v.std(ddof=1):.{1 if pct else 2}f}" if len(v) > 1 else ""
  return f"{v.mean():.{1 if pct else 2}f}{std}"


def csv_text(data: dict[str, list[tuple[int, list[dict]]]]) -> str:
  buf = io.StringIO()
  w = csv.writer(buf, lineterminator="\n")
  w.writerow(("method", "seed", "iteration") + COLUMNS)
  for method, runs in data.items():
    for seed, lines in runs:
      for it, l in enumerate(lines, 1):
        w.writerow((method, seed, it) + tuple("" if c not in l else repr(float(l[c])) for c in COLUMNS))
  return buf.getvalue()


def plot(data: dict[str, list[tuple[int, list[dict]]]], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 3, figsize=(15, 3.9))
  for method, runs in data.items():
    lines = [l for _, l in runs]
    label = f"{LABELS.get(method, method)} (n={len(lines)})"
    s = _series(lines, "rollout/success")
    if s is not None:
      line, = axes[0].plot(s[0], s[1], label=label)
      axes[0].fill_between(s[0], np.clip(s[1] - s[2], 0, 1), np.clip(s[1] + s[2], 0, 1),
                           color=line.get_color(), alpha=0.2, linewidth=0)
    levels = [k for k in ("low", "high", "term") if _series(lines, f"critic/explained_variance_{k}")]
    for key, name in ([(f"critic/explained_variance_{k}", f"{LABELS.get(method, method)} {k}")
                       for k in levels] or [("critic/explained_variance", LABELS.get(method, method))]):
      s = _series(lines, key)
      if s is not None:
        axes[1].plot(s[0], np.clip(s[1], -1, 1), label=name)
    for key, name in (("rollout/switch_rate", "SWITCH rate"),
                      ("rollout/subgoal_change_rate", "subgoal-change rate")):
      s = _series(lines, key)
      if s is not None:
        axes[2].plot(s[0], s[1], label=f"{LABELS.get(method, method)} {name}")
  titles = ("train success (mean ± std over seeds)", "critic explained variance (clipped at -1)",
            "HiPER: turns after the first")
  for ax, title in zip(axes, titles):
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("iteration")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7)
  axes[0].set_ylim(-0.02, 1.02)
  axes[2].set_ylim(-0.02, 1.02)
  fig.tight_layout()
  fig.savefig(path, dpi=110, metadata={"Software": None})
  plt.close(fig)


def markdown(data: dict[str, list[tuple[int, list[dict]]]], data_dirs: dict[str, list[str]],
             env: str, command: str, root: str, reading: str | None,
             revision: str = "unknown") -> str:
  out = [f"# Long runs of the critic methods on {env}", "",
         "Tiny policy, constrained decoding, the mini suite's settings with "
         "`train.num_iterations=60` (2 CPU cores). Mean ± std over the seeds shown; a run "
         "still going contributes the iterations it has (see Iterations).", ""]
  marks = (10, 20, 30, 40, 50, 60)
  out.append("| Method | Seeds | Iterations | " + " | ".join(f"success it. {m} (%)" for m in marks)
             + f" | success, last {LAST} it. (%) | held-out success at end (%) |")
  out.append("|---" * (len(marks) + 5) + "|")
  for method, runs in data.items():
    row = [LABELS.get(method, method), ", ".join(str(s) for s, _ in runs),
           "/".join(str(len(l)) for _, l in runs)]
    for m in marks:
      row.append(_ms([float(l[m - 1]["rollout/success"]) for _, l in runs if len(l) >= m], pct=True))
    row.append(_ms([float(np.mean([x["rollout/success"] for x in l[-LAST:]])) for _, l in runs if l],
                   pct=True))
    row.append(_ms([v for v in (final_eval(d) for d in data_dirs[method]) if v is not None], pct=True))
    out.append("| " + " | ".join(row) + " |")
  out += ["", "## Critic fit and HiPER's segments", "",
          f"Means over the first {LAST} and the last {LAST} iterations (over seeds).", "",
          "| Method | quantity | first 10 it. | last 10 it. |", "|---|---|---|---|"]
  for method, runs in data.items():
    for key in COLUMNS[3:10]:
      if all(key in x for _, l in runs for x in l) and runs and runs[0][1]:
        first = [float(np.mean([x[key] for x in l[:LAST]])) for _, l in runs if l]
        last = [float(np.mean([x[key] for x in l[-LAST:]])) for _, l in runs if l]
        out.append(f"| {LABELS.get(method, method)} | `{key}` | {_ms(first)} | {_ms(last)} |")
  per_run = [sorted(glob.glob(os.path.join(d, "rollouts", "iter_*.jsonl")))
             for d in data_dirs.get("hiper", [])]
  if any(per_run):
    # each run's first and second half of its iterations, pooled over the runs
    halves = (("first half", [f for fs in per_run for f in fs[:len(fs) // 2]]),
              ("second half", [f for fs in per_run for f in fs[len(fs) // 2:]]))
    out += ["", "## HiPER: row advantage by position within a subgoal segment", "",
            "From the rollout dumps (`rollout.dump=true`): position 0 is a segment's first turn "
            "(turn 0 or a SWITCH), 3 means 3 or later. The row advantage is the dump's "
            "`advantage` (the estimator's per-row advantage).", "",
            "| iterations of each run | position | rows | mean advantage | mean abs advantage |",
            "|---|---|---|---|---|"]
    for name, files in halves:
      for p, (count, mean, mean_abs) in advantage_by_segment_position(files).items():
        out.append(f"| {name} ({len(files)} dumps) | {p} | {count} | {mean:+.3f} | {mean_abs:.3f} |")
  out += ["", "## How this was made", "", f"command: `{command}`",
          f"runs: `{root}`, each `<method>/seed_<n>` started by `python -m launch.experiments.sweep suite --suite mini "
          f"--envs {env} --methods <method> --seeds <n> --override train.num_iterations=60` "
          "(HiPER also `rollout.dump=true`)",
          f"trainer revisions of the runs: {_revisions(data_dirs)}",
          f"git (report): {revision}",
          f"machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs"]
  if reading:
    out += ["", "## Reading", "", reading.strip()]
  return "\n".join(out) + "\n"


def _revisions(dirs: dict[str, list[str]]) -> str:
  found = collections.Counter()
  for runs in dirs.values():
    for d in runs:
      rev = "not recorded"
      path = os.path.join(d, "log.txt")
      if os.path.exists(path):
        with open(path) as f:
          for line in f:
            if line.startswith(report.REVISION_PREFIX):
              rev = line[len(report.REVISION_PREFIX):].strip()
      found[rev] += 1
  return ", ".join(f"{r} ({n} runs)" for r, n in sorted(found.items()))



def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.experiments.studies.long_runs",
                              description=__doc__.split("\n")[0])
  p.add_argument("--root", required=True, help="the sweep root of the runs")
  p.add_argument("--env", default="alfworld_mini")
  p.add_argument("--methods", nargs="+", default=["hiper", "ppo"])
  p.add_argument("--out", default="results/hiper_long", help="output stem (.md, .csv, .png)")
  p.add_argument("--reading", help="a Markdown file appended under 'Reading'")
  args = p.parse_args(argv)
  revision = report.git_revision()  # before this command rewrites its own outputs
  data, data_dirs = {}, {}
  for method in args.methods:
    runs = run_dirs(args.root, args.env, method)
    if not runs:
      print(f"error: no runs of {method} on {args.env} under {args.root}", file=sys.stderr)
      return 2
    data[method] = [(seed, run_records.training_lines(d)) for seed, d in runs]
    data_dirs[method] = [d for _, d in runs]
  reading = open(args.reading).read() if args.reading else None
  shown = report.display_root(args.root)
  command = "python -m launch.experiments.studies.long_runs " + " ".join(
      (shown if a == args.root else a) for a in (argv if argv is not None else sys.argv[1:]))
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out + ".csv", "w") as f:
    f.write(csv_text(data))
  plot(data, args.out + ".png")
  with open(args.out + ".md", "w") as f:
    f.write(markdown(data, data_dirs, args.env, command, shown, reading, revision))
  print(f"wrote {args.out}.md, .csv, .png")
  return 0


if __name__ == "__main__":
  sys.exit(main())
