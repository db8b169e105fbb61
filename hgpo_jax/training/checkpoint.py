"""Orbax checkpoints of the training state, the task cursor, the config and a metrics snapshot.

One checkpoint step holds four items:
  * `state`: the array pytree (params, optimizer state, step, RNG key), saved with
    `StandardSave` and restored onto any mesh through an abstract target whose
    `ShapeDtypeStruct`s carry the *target* `NamedSharding`s;
  * `cursor`: JSON, where the task stream stands (so a resumed run draws the same tasks);
  * `config`: JSON, the run's config (for the record and for resume checks);
  * `metrics`: JSON, the last iteration's metrics.

Retention: the last `max_to_keep` steps plus every step divisible by `keep_period`,
which are never deleted (a long run always keeps milestones). Saves are asynchronous by default: `save` returns once the arrays are
copied off the devices and the files are written in the background; `wait` blocks.

Trap avoided (current JAX + Orbax): shardings built under `jax.set_mesh` by
`eval_shape` sit on an AbstractMesh and Orbax cannot restore onto them. The
abstract targets here are rebuilt with `NamedSharding(mesh, spec)` on the concrete mesh
(`abstract_state`).

Resume precedence (`resume`): a readable checkpoint in the run's own checkpoint
directory > an explicit resume path (another run's checkpoint directory) > initial
weights > scratch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Mapping, Optional

import jax
import orbax.checkpoint as ocp

_ITEMS = ("state", "cursor", "config", "metrics")
_LOG = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
  """No readable checkpoint where one was expected."""


@dataclasses.dataclass(frozen=True)
class Restored:
  """What a restore returns."""

  step: int
  """The checkpoint step that was read."""
  state: Any
  """The array pytree, laid out as the abstract target asked."""
  cursor: dict
  """Task-stream cursor (JSON)."""
  config: dict
  """Config of the run that wrote the checkpoint (JSON)."""
  metrics: dict
  """Metrics snapshot saved with the step (JSON)."""


def abstract_state(state_shapes: Any, shardings: Any) -> Any:
  """ShapeDtypeStructs with concrete target shardings: the restore target for `state`.

  Args:
    state_shapes: pytree of arrays or ShapeDtypeStructs (e.g. `jax.eval_shape(init)`).
    shardings: matching pytree of `jax.sharding.Sharding` on a concrete mesh.
  """
  def one(x, s):
    if isinstance(getattr(s, "mesh", None), jax.sharding.AbstractMesh):
      raise ValueError("restore target sharding sits on an AbstractMesh; build it as NamedSharding(mesh, spec) on the concrete mesh.")
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  return jax.tree.map(one, state_shapes, shardings)


class Checkpointer:
  """A CheckpointManager over one directory, with fallback restore.

  Args:
    directory: where the step folders live (created if missing).
    max_to_keep: the number of most recent steps kept.
    keep_period: steps divisible by this are kept forever; None: none.
    async_save: write files in a background thread.
    read_only: never write or delete (reading another run's checkpoints).
  """

  def __init__(self, directory: str, *, max_to_keep: int = 3, keep_period: Optional[int] = None,
               async_save: bool = True, read_only: bool = False):
    if max_to_keep < 1:
      raise ValueError(f"max_to_keep={max_to_keep} must be >= 1.")
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, keep_period=keep_period,
        enable_async_checkpointing=async_save, create=not read_only, read_only=read_only)
    self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=_ITEMS)

  def save(self, step: int, state: Any, *, cursor: Mapping, config: Mapping,
           metrics: Optional[Mapping] = None, force: bool = True) -> bool:
    """Saves one step (asynchronously if configured); True if a save was started."""
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        cursor=ocp.args.JsonSave(dict(cursor)),
        config=ocp.args.JsonSave(dict(config)),
        metrics=ocp.args.JsonSave(_jsonable(metrics or {})))
    return self._mngr.save(int(step), args=args, force=force)

  def wait(self) -> None:
    """Blocks until every pending asynchronous save is on disk."""
    self._mngr.wait_until_finished()

  def all_steps(self) -> list[int]:
    """Steps present on disk, ascending."""
    return sorted(self._mngr.all_steps(read=True))

  def latest_step(self) -> Optional[int]:
    steps = self.all_steps()
    return steps[-1] if steps else None

  def restore_step(self, step: int, target: Any) -> Restored:
    """Restores one given step; raises whatever Orbax raises if it is unreadable."""
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(target),
        cursor=ocp.args.JsonRestore(), config=ocp.args.JsonRestore(),
        metrics=ocp.args.JsonRestore())
    r = self._mngr.restore(int(step), args=args)
    return Restored(step=int(step), state=r.state, cursor=dict(r.cursor or {}),
                    config=dict(r.config or {}), metrics=dict(r.metrics or {}))

  def restore(self, target: Any, step: Optional[int] = None) -> Restored:
    """Restores `step` (default: the latest readable one), falling back to older steps.

    Args:
      target: abstract state (see `abstract_state`) that fixes dtypes and shardings.
      step: a specific step; then no fallback.

    Raises:
      CheckpointError: no step on disk could be read.
    """
    self.wait()
    if step is not None:
      return self.restore_step(step, target)
    steps = self.all_steps()
    if not steps:
      raise CheckpointError(f"no checkpoint in {self.directory}; start without resume or point at a checkpoint directory.")
    for s in reversed(steps):
      try:
        return self.restore_step(s, target)
      except Exception as e:  # any unreadable step falls back
        _LOG.warning("checkpoint step %d in %s is unreadable (%s: %s); trying the previous step.",
                        s, self.directory, type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
    raise CheckpointError(f"none of the checkpoint steps {steps} in {self.directory} is readable; delete the directory or resume from another path (--config.checkpoint.resume_from=DIR).")

  def close(self) -> None:
    self._mngr.wait_until_finished()
    self._mngr.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _jsonable(tree: Mapping) -> dict:
  """Converts numpy / JAX scalars to Python numbers so JsonSave accepts them."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, Mapping):
      out[k] = _jsonable(v)
    elif hasattr(v, "item") and getattr(v, "size", 2) == 1:
      out[k] = v.item()
    else:
      out[k] = v
  return out


def has_checkpoint(directory: Optional[str]) -> bool:
  """True if `directory` holds at least one finished Orbax step folder."""
  if not directory or not os.path.isdir(directory):
    return False
  return bool(ocp.path.step.checkpoint_steps(directory))


@dataclasses.dataclass(frozen=True)
class Resume:
  """Outcome of `resume`: which source was used and, for checkpoints, what was read."""

  source: str
  """'workdir', 'resume_path' or 'scratch'."""
  path: Optional[str] = None
  """The checkpoint directory used (None for scratch)."""
  restored: Optional[Restored] = None
  """The restored checkpoint for 'workdir' / 'resume_path'; None for scratch (the caller
  keeps its freshly initialised state; other initial weights are `config.model.path`)."""


RESUME_SOURCES = ("workdir", "resume_path", "scratch")


def resume(checkpoint_dir: str, target: Any, *, resume_path: Optional[str] = None) -> Resume:
  """Picks the resume source by precedence and restores checkpoints.

  Order: the run's own `checkpoint_dir` (an interrupted run continues) > `resume_path`
  (another run's checkpoint directory: full state) > scratch.

  Args:
    checkpoint_dir: this run's checkpoint directory (may not exist yet).
    target: abstract state with target shardings (see `abstract_state`).
    resume_path: optional checkpoint directory of another run.

  Raises:
    CheckpointError: `resume_path` was given but holds no readable checkpoint.
  """
  if has_checkpoint(checkpoint_dir):
    with Checkpointer(checkpoint_dir, async_save=False) as ckpt:
      return Resume("workdir", ckpt.directory, ckpt.restore(target))
  if resume_path:
    if not has_checkpoint(resume_path):
      raise CheckpointError(f"resume path {resume_path} holds no checkpoint; fix the path or drop it (--config.checkpoint.resume_from=DIR).")
    with Checkpointer(resume_path, async_save=False, read_only=True) as ckpt:
      return Resume("resume_path", ckpt.directory, ckpt.restore(target))
  return Resume("scratch")


def set_aside_steps_after(ckpt_dir: str, restored_step: int) -> None:
  """Moves checkpoint steps newer than the one restored (they were unreadable) out of the
  way, so the resumed run can write those steps again; nothing is deleted."""
  aside = os.path.join(os.path.dirname(ckpt_dir), "checkpoints_unreadable")
  for name in os.listdir(ckpt_dir):
    if name.isdigit() and int(name) > restored_step:
      os.makedirs(aside, exist_ok=True)
      target = os.path.join(aside, f"{name}-{int(time.time())}")
      os.rename(os.path.join(ckpt_dir, name), target)
      _LOG.warning("checkpoint step %s was unreadable; moved to %s", name, target)
