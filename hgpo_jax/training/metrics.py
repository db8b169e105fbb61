"""Per-iteration metrics: JSON lines, TensorBoard scalars, Weights & Biases and a one-line
console summary.

Keys are written in sorted order (after `step`) so two runs with the same seed produce
byte-identical JSONL files that `diff` can compare. Where the scalars go is a registry of
writers (`WRITERS`, `config.metrics.writers`); `metrics.jsonl` is always written: it is
the run's record, which resuming, reports and figures read.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from hgpo_jax import registry

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


WANDB_MODES = ("online", "offline", "disabled")
"""wandb's own run modes (`wandb.init(mode=...)`): offline keeps the run under the run
directory until `wandb sync` uploads it."""


@dataclasses.dataclass(frozen=True)
class WriterSettings:
  """What the writers read besides the run directory (`config.metrics`)."""

  wandb_project: str = ""
  """The W&B project of the `wandb` writer; "": wandb's default (`WANDB_PROJECT` or
  "uncategorized")."""
  wandb_mode: str = "offline"
  """One of WANDB_MODES."""
  run_config: Optional[Mapping[str, Any]] = dataclasses.field(default=None, compare=False)
  """The run's whole config as a plain dict: the W&B run's `config`."""

  def __post_init__(self):
    if self.wandb_mode not in WANDB_MODES:
      raise ValueError(f"wandb_mode={self.wandb_mode!r}: use one of {WANDB_MODES}")


class JsonlWriter:
  """One JSON line per `write` appended to `<workdir>/metrics.jsonl`: the run record."""

  package = ""

  def __init__(self, workdir: str, settings: WriterSettings):
    del settings
    self.path = os.path.join(workdir, JSONL_NAME)
    self._file = open(self.path, "a", encoding="utf-8")

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    self._file.write(json.dumps({"step": step, **scalars}, allow_nan=True) + "\n")
    self._file.flush()

  def close(self) -> None:
    self._file.close()


class TensorboardWriter:
  """`<workdir>/tensorboard/` event files (tensorboardX), a scalar per key."""

  package = "tensorboardX"

  def __init__(self, workdir: str, settings: WriterSettings):
    del settings
    import tensorboardX  # slow import: only when asked for
    self._tb = tensorboardX.SummaryWriter(os.path.join(workdir, TENSORBOARD_DIR))

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    for k, v in scalars.items():
      self._tb.add_scalar(k, v, step)
    self._tb.flush()

  def close(self) -> None:
    self._tb.close()


class WandbWriter:
  """A Weights & Biases run (verl's `trainer.logger=['wandb']`) named after the run
  directory, with the run's config, under `<workdir>/wandb/` (or `WANDB_DIR`); a
  `wandb.log` per write at `step`. A resumed run starts a new W&B run, whose steps go on
  from the checkpoint's."""

  package = "wandb"

  def __init__(self, workdir: str, settings: WriterSettings):
    try:
      import wandb  # optional dependency, imported only when asked for
    except ImportError:
      raise ImportError(missing_package("wandb")) from None
    self._run = wandb.init(
        project=settings.wandb_project or None, mode=settings.wandb_mode,
        dir=None if os.environ.get("WANDB_DIR") else workdir,
        name=os.path.basename(os.path.abspath(workdir)),
        config=dict(settings.run_config or {}))

  def write(self, step: int, scalars: Mapping[str, float]) -> None:
    self._run.log(dict(scalars), step=step)

  def close(self) -> None:
    self._run.finish()


WRITERS = registry.Registry("metric writer")
"""Names of `config.metrics.writers` -> a writer class: `cls(workdir, settings:
WriterSettings)` with `write(step, scalars)` and `close()`, and `package`, the module it
needs ("" for none; `missing_package`). "jsonl" is always on (`MetricsWriter`)."""
WRITERS.register("jsonl", JsonlWriter)
WRITERS.register("tensorboard", TensorboardWriter)
WRITERS.register("wandb", WandbWriter)


def missing_package(name: str) -> str | None:
  """The one-line error of writer `name` when the package it needs is not installed,
  else None (KeyError for an unknown writer)."""
  package = WRITERS.get(name).package
  if not package or importlib.util.find_spec(package) is not None:
    return None
  return (f"metric writer {name!r} needs the {package} package, which is not installed: "
          f"pip install {package} (or leave {name!r} out of config.metrics.writers)")


class MetricsWriter:
  """Writes each iteration's scalars with every writer of `writers` (`WRITERS`), always
  `<workdir>/metrics.jsonl` first.

  Args:
    workdir: run directory (created if missing).
    writers: names of WRITERS besides "jsonl" (which is written anyway).
    settings: what the writers read (the wandb project and mode, the run's config).
  """

  def __init__(self, workdir: str, writers: Sequence[str] = ("tensorboard",),
               settings: WriterSettings = WriterSettings()):
    os.makedirs(workdir, exist_ok=True)
    self.jsonl_path = os.path.join(workdir, JSONL_NAME)
    names = ["jsonl"] + [n for n in dict.fromkeys(writers) if n != "jsonl"]
    classes = [WRITERS.get(n) for n in names]  # KeyError before any file is opened
    self._writers = []
    try:
      for cls in classes:
        self._writers.append(cls(workdir, settings))
    except BaseException:
      self.close()
      raise

  def write(self, step: int, metrics: Mapping) -> dict[str, float]:
    """Writes one iteration's metrics; returns the flattened scalars."""
    scalars = to_scalars(metrics)
    for writer in self._writers:
      writer.write(int(step), scalars)
    return scalars

  def close(self) -> None:
    for writer in self._writers:
      writer.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


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
  appends again; `run_records.read_task_results` keeps the last line of each (step, split,
  index)."""
  path = os.path.join(workdir, TASK_RESULTS_JSONL_NAME)
  with open(path, "a", encoding="utf-8") as f:
    for r in per_task:
      f.write(json.dumps({"step": int(step), "split": split, **r}) + "\n")
