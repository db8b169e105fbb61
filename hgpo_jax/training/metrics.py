"""Per-iteration metrics: JSON lines, TensorBoard scalars and a one-line console summary.

Keys are written in sorted order (after `step`) so two runs with the same seed produce
byte-identical JSONL files that `diff` can compare.
"""

from __future__ import annotations

import json
import math
import os
from typing import Mapping, Optional, Sequence

import numpy as np

JSONL_NAME = "metrics.jsonl"
# Per-task outcomes of every evaluation, a line per task (`evaluation.write_task_results`)
TASK_RESULTS_JSONL_NAME = "eval_tasks.jsonl"
TENSORBOARD_DIR = "tensorboard"


def to_scalars(metrics: Mapping) -> dict[str, float]:
  """Flattens nested mappings to `a/b` keys and converts arrays of size 1 to floats."""
  out = {}
  for key, value in metrics.items():
    if isinstance(value, Mapping):
      for sub, v in to_scalars(value).items():
        out[f"{key}/{sub}"] = v
      continue
    arr = np.asarray(value)
    if arr.size != 1:
      raise ValueError(f"metric {key!r} has shape {arr.shape}; log scalars only (reduce it first).")
    out[key] = arr.item()
  return dict(sorted(out.items()))


def format_summary(step: int, metrics: Mapping, keys: Optional[Sequence[str]] = None) -> str:
  """One console line: `step 12 | kl 0.0031 | loss -0.0123 | ...` (sorted keys unless given)."""
  scalars = to_scalars(metrics)
  keys = list(keys) if keys is not None else list(scalars)
  parts = [f"step {step}"]
  for k in keys:
    if k in scalars:
      parts.append(f"{k} {_fmt(scalars[k])}")
  return " | ".join(parts)


def _fmt(v) -> str:
  if isinstance(v, (bool, np.bool_)) or (isinstance(v, int)):
    return str(int(v))
  if not math.isfinite(v):
    return str(v)
  return f"{v:.4g}"


class MetricsWriter:
  """Appends one JSON line per `write` to `<workdir>/metrics.jsonl` and TensorBoard scalars.

  Args:
    workdir: run directory (created if missing).
    tensorboard: also write `<workdir>/tensorboard/` event files (tensorboardX).
  """

  def __init__(self, workdir: str, *, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.jsonl_path = os.path.join(workdir, JSONL_NAME)
    self._file = open(self.jsonl_path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      import tensorboardX  # optional, slow import
      self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))

  def write(self, step: int, metrics: Mapping) -> dict[str, float]:
    """Writes one iteration's metrics; returns the flattened scalars."""
    scalars = to_scalars(metrics)
    record = {"step": int(step), **scalars}
    self._file.write(json.dumps(record, allow_nan=True) + "\n")
    self._file.flush()
    if self._tb is not None:
      for k, v in scalars.items():
        self._tb.add_scalar(k, v, int(step))
      self._tb.flush()
    return scalars

  def close(self) -> None:
    self._file.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def read_jsonl(path: str) -> list[dict]:
  """All records of a metrics JSONL file, in order."""
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


class NullWriter:
  """The metrics writer of processes other than 0: formats, writes nothing."""

  def write(self, step: int, metrics) -> dict[str, float]:
    del step
    return to_scalars(metrics)

  def close(self) -> None:
    pass


def truncate_jsonl(path: str, last_step: int) -> None:
  """Drops metric lines past the restored step (written after the last checkpoint)."""
  if not os.path.exists(path):
    return
  with open(path, encoding="utf-8") as f:
    lines = [l for l in f if l.strip() and json.loads(l)["step"] <= last_step]
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(lines)


def write_task_results(workdir: str, step: int, split: str, per_task: list[dict]) -> None:
  """Appends one evaluation's per-task outcomes to `<workdir>/eval_tasks.jsonl`
  (`TASK_RESULTS_JSONL_NAME`): a line per task (`step`, `split`, `index` in the eval set,
  `task_id`, `won`, `return`, `length`), so two evaluations of the same tasks compare game by game (the paired
  intervals of `launch.experiments.report`). A step evaluated again (a resumed run)
  appends again; `read_task_results` keeps the last line of each (step, split, index)."""
  path = os.path.join(workdir, TASK_RESULTS_JSONL_NAME)
  with open(path, "a", encoding="utf-8") as f:
    for r in per_task:
      f.write(json.dumps({"step": int(step), "split": split, **r}) + "\n")


def read_task_results(workdir: str) -> dict[tuple[int, str], list[dict]]:
  """`write_task_results`' records by (step, split), each list in eval-set order (the last
  record of a task counts); {} when the run has none."""
  path = os.path.join(workdir, TASK_RESULTS_JSONL_NAME)
  if not os.path.isfile(path):
    return {}
  latest: dict[tuple[int, str, int], dict] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      if line.strip():
        r = json.loads(line)
        latest[(r["step"], r["split"], r["index"])] = r
  out: dict[tuple[int, str], list[dict]] = {}
  for (step, split, _), r in sorted(latest.items()):
    out.setdefault((step, split), []).append(r)
  return out
