"""Run records: the one reader of what a run directory holds and the one finder of runs.

A run directory (a trainer's or `launch.evaluate`'s `--workdir`) holds
`metrics.jsonl` (a line per iteration and per evaluation, `metrics.MetricsWriter`) and
`eval_tasks.jsonl` (a line per evaluated task, `metrics.write_task_results`). Every tool
that reads them (the results tables, the sweeps, the figures, the studies, the
benchmarks that run the trainer) reads them here, and finds run directories here:

  <base>/<env>/<method>/seed_<n>   a suite's runs (`launch.experiments.suites.run_dir`)
  <root>/<variant>/seed_<n>        a grid sweep's runs (`launch.experiments.sweep`)

A line of `metrics.jsonl` is a training iteration when it has `rollout/*` keys, an
evaluation when it has `eval/*` keys; the final evaluation (`eval.at_end`, or the single
line of `launch.evaluate`) has `eval/*` keys and no `rollout/*` keys.
"""

from __future__ import annotations

import glob
import json
import os
import re

from hgpo_jax.training import metrics as metrics_lib

METRICS = metrics_lib.JSONL_NAME
TASK_RESULTS = metrics_lib.TASK_RESULTS_JSONL_NAME
_SEED_DIR = re.compile(r"seed_(\d+)")


def read_jsonl(path: str) -> list[dict]:
  """Every record of a JSON-lines file, in order (blank lines skipped).

  Raises:
    OSError: the file cannot be read; ValueError: a line is not JSON (e.g. cut by a kill).
  """
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def metrics_path(run_dir: str) -> str:
  """The run's `metrics.jsonl`."""
  return os.path.join(run_dir, METRICS)


def read_metrics(run_dir: str) -> list[dict]:
  """Every line of the run's `metrics.jsonl`, in the order written."""
  return read_jsonl(metrics_path(run_dir))


def is_training_line(line: dict) -> bool:
  """A training iteration's line (it carries rollout metrics)."""
  return any(k.startswith("rollout/") for k in line)


def is_final_eval(line: dict) -> bool:
  """The line of a final evaluation: eval metrics without rollout metrics."""
  return any(k.startswith("eval/") for k in line) and not is_training_line(line)


def training_lines(run_dir: str) -> list[dict]:
  """The run's training iterations, one line per step (the last written counts), by step."""
  by_step = {int(l["step"]): l for l in read_metrics(run_dir) if is_training_line(l)}
  return [by_step[s] for s in sorted(by_step)]


def is_finished(run_dir: str) -> bool:
  """True when the run's `metrics.jsonl` holds its final evaluation; a missing or cut file
  is not finished."""
  if not os.path.isfile(metrics_path(run_dir)):
    return False
  try:
    return any(is_final_eval(l) for l in read_metrics(run_dir))
  except (OSError, ValueError):
    return False


def find_runs(base: str, env: str = "*", method: str = "*") -> list[tuple[str, str, int, str]]:
  """(env, method, seed, run directory) of each run with a `metrics.jsonl` under a suite's
  directory `base` (`<base>/<env>/<method>/seed_<n>`), sorted; `env` and `method` narrow
  the walk (glob patterns)."""
  out = []
  for path in glob.glob(os.path.join(glob.escape(base), env, method, "seed_*")):
    match = _SEED_DIR.fullmatch(os.path.basename(path))
    if match and os.path.isfile(metrics_path(path)):
      method_dir = os.path.dirname(path)
      out.append((os.path.basename(os.path.dirname(method_dir)), os.path.basename(method_dir),
                  int(match.group(1)), path))
  return sorted(out)


def find_grid_runs(root: str) -> list[tuple[str, int, str]]:
  """(variant, seed, run directory) of each run with a `metrics.jsonl` under a grid sweep's
  directory `root` (`<root>/<variant>/seed_<n>`), sorted."""
  out = []
  for path in glob.glob(os.path.join(glob.escape(root), "*", "seed_*")):
    match = _SEED_DIR.fullmatch(os.path.basename(path))
    if match and os.path.isfile(metrics_path(path)):
      out.append((os.path.basename(os.path.dirname(path)), int(match.group(1)), path))
  return sorted(out)


def read_task_results(run_dir: str) -> dict[tuple[int, str], list[dict]]:
  """The run's per-task evaluation outcomes (`eval_tasks.jsonl`) by (step, split), each
  list in eval-set order (with `eval.repeats`: each task's repeats in turn); a task
  evaluated twice at one step and repeat (a resumed run) counts its last line. {} when the
  run has none."""
  path = os.path.join(run_dir, TASK_RESULTS)
  if not os.path.isfile(path):
    return {}
  latest: dict[tuple[int, str, int, int], dict] = {}
  for r in read_jsonl(path):
    latest[(r["step"], r["split"], r["index"], r.get("repeat", 0))] = r
  out: dict[tuple[int, str], list[dict]] = {}
  for (step, split, _, _), r in sorted(latest.items()):
    out.setdefault((step, split), []).append(r)
  return out
