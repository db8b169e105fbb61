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

Host-side reading (`read_params`): one subtree of a step's `state` (the policy's or the
critic's params) as numpy without any device, or onto shardings the caller gives, without
the optimizer state; `launch.export` and `launch.evaluate --checkpoint` read checkpoints so.

Resume precedence (`resume`): a readable checkpoint in the run's own checkpoint
directory > an explicit resume path (another run's checkpoint directory) > initial
weights > scratch.
"""

from __future__ import annotations

import dataclasses
import functools
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


# ------------------------------------------------------------------------ host-side reading
# Export and evaluation read one subtree of a saved step (the policy's or the critic's
# params) without the run's mesh or its optimizer state: a checkpoint written by a pod is
# read on a workstation's CPU as numpy, or straight onto the shardings the reader asks for.
POLICY = ("params",)
"""The path of the policy's parameters inside the `state` item (`TrainState.to_checkpoint`)."""
CRITIC = ("critic", "params")
"""The path of the value model's parameters (`Run.checkpoint`: the critic's TrainState)."""


@dataclasses.dataclass(frozen=True)
class HostParams:
  """What `read_params` returns."""

  directory: str
  """The checkpoint directory read (the step folders' parent)."""
  step: int
  """The step read."""
  params: dict
  """The subtree asked for: numpy arrays, or jax Arrays laid out as the target asked."""
  config: dict
  """Config of the run that wrote the step (JSON)."""


def saved_steps(directory: str) -> list[int]:
  """The finished steps in a checkpoint directory, ascending, from the file system alone
  (Orbax writes a step under a temporary name and renames it when it is complete), so a
  tool can name the checkpoint before JAX starts its backends."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory)
                if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def resolve_step(path: str, step: Optional[int] = None) -> tuple[str, int]:
  """(checkpoint directory, step) of `path`: a training workdir (its `checkpoints/`) or a
  checkpoint directory itself; `step` default the latest on disk.

  Raises:
    CheckpointError: no step folders there, or no step `step`.
  """
  for directory in (os.path.join(path, "checkpoints"), path):
    steps = saved_steps(directory)
    if steps:
      break
  else:
    if not os.path.isdir(path):
      raise CheckpointError(f"{path} is not a directory; pass the workdir of a training run.")
    raise CheckpointError(f"{path} holds no checkpoint (no step folders in {path}/checkpoints "
                          f"or {path}); pass the workdir of a run that saved one.")
  directory = os.path.abspath(directory)
  if step is None:
    return directory, steps[-1]
  if step not in steps:
    raise CheckpointError(f"step {step} is not in {directory} (steps on disk: {steps}); pass one of them.")
  return directory, int(step)


def read_params(path: str, step: Optional[int] = None, *, subtree: tuple[str, ...] = POLICY,
                target: Any = None) -> HostParams:
  """One subtree of a saved step's `state`, without the run's mesh or its other arrays.

  Args:
    path: a training workdir or a checkpoint directory (`resolve_step`).
    step: the step to read; default the latest on disk.
    subtree: keys into the state item: `POLICY` or `CRITIC`.
    target: optional pytree of `jax.ShapeDtypeStruct`s with shardings (e.g. a loaded
      model's params): the arrays are checked against its shapes and restored onto its
      shardings in its dtypes (each process reads its own shards). Default: numpy arrays
      in host memory, in the dtypes they were saved in (no JAX device is used).

  Raises:
    CheckpointError (one line): no checkpoint, no such step, the subtree is absent (a run
      without a critic), shapes other than the target's (another architecture), or files
      that cannot be read (a corrupt or partly deleted step). No fallback to another step:
      the caller names the one it wants.
  """
  from etils import epath
  import numpy as np

  directory, step = resolve_step(path, step)
  where = f"checkpoint step {step} in {directory}"
  step_path = epath.Path(directory) / str(step)
  handler = ocp.PyTreeCheckpointHandler()
  try:
    tree = handler.metadata(step_path / "state").tree
    for key in subtree:
      if not isinstance(tree, Mapping) or key not in tree:
        why = " (the run trained no critic)" if subtree == CRITIC else ""
        raise CheckpointError(f"{where} holds no {'/'.join(subtree)}{why}.")
      tree = tree[key]
    if target is None:
      restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    else:
      _check_shapes(where, tree, target)
      restore_args = jax.tree.map(
          lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding, dtype=t.dtype,
                                         global_shape=t.shape), target)
    nest = lambda leaf: functools.reduce(lambda inner, key: {key: inner}, reversed(subtree), leaf)
    restored = handler.restore(step_path / "state", args=ocp.args.PyTreeRestore(
        item=nest(tree), restore_args=nest(restore_args), partial_restore=True))
    for key in subtree:
      restored = restored[key]
    config = ocp.JsonCheckpointHandler().restore(step_path / "config") or {}
  except CheckpointError:
    raise
  except Exception as e:  # a corrupt step: whatever Orbax / TensorStore raise
    first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
    older = [s for s in saved_steps(directory) if s < step]
    hint = f"pass an older --step ({older})" if older else "no older step to read"
    raise CheckpointError(f"{where} is unreadable ({type(e).__name__}: {first}); {hint}.") from None
  finally:
    handler.close()
  return HostParams(directory=directory, step=step, params=restored, config=dict(config))


def _check_shapes(where: str, saved: Any, target: Any) -> None:
  """CheckpointError naming the first parameter whose name or shape differs."""
  flat = lambda tree: {jax.tree_util.keystr(p, simple=True, separator="/"): tuple(x.shape)
                       for p, x in jax.tree_util.tree_leaves_with_path(tree)}
  have, want = flat(saved), flat(target)
  for name in sorted(set(have) | set(want)):
    if have.get(name) != want.get(name):
      raise CheckpointError(
          f"{where} holds another architecture than the config's model: {name} is "
          f"{have.get(name, 'absent')} there, {want.get(name, 'absent')} in the model; "
          "evaluate it with the config (model) it was trained with.")
