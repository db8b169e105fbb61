"""The trainer across processes: exchanging host data between `jax.distributed` processes.

Every process plays its own groups on its own devices and env servers; these helpers
then give every process all rows, so advantages, batch and metrics are computed the same
way everywhere (docs/scaling.md "Several processes"). With one process each is the
identity.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from hgpo_jax.rollout import rollout as rollout_lib


def allgather(x: np.ndarray) -> np.ndarray:
  """Stacks `x` from every process along axis 0 (identity with one process)."""
  if jax.process_count() == 1:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(np.asarray(x), tiled=True))


def allgather_objects(obj: Any) -> list[Any]:
  """`obj` of every process, in process order (pickled through `allgather`)."""
  if jax.process_count() == 1:
    return [obj]
  data = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
  sizes = allgather(np.array([data.size], np.int64))
  padded = np.zeros((1, int(sizes.max())), np.uint8)
  padded[0, :data.size] = data
  return [pickle.loads(row[:n].tobytes()) for row, n in zip(allgather(padded), sizes)]


def barrier(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def gather_rollout(ro: rollout_lib.Rollout, groups_per_process: int,
                   group_size: int) -> rollout_lib.Rollout:
  """The rollout of all processes, as one process playing all groups would return it.

  Process p played global groups [p * Gp, (p + 1) * Gp) (`tasks.TaskSampler.groups`) in
  slots numbered from 0; its rows are renumbered to the global group and slot and
  concatenated in process order, which keeps the (group, traj, step) order of one
  process. Timings are the slowest process's (the others wait for it); the decode work
  is summed.
  """
  if jax.process_count() == 1:
    return ro
  parts = allgather_objects(ro)
  rows = []
  for p, part in enumerate(parts):
    g0, t0 = p * groups_per_process, p * groups_per_process * group_size
    rows += [dataclasses.replace(r, group=r.group + g0, traj=r.traj + t0) for r in part.rows]
  return rollout_lib.Rollout(
      rows=rows, won=np.concatenate([x.won for x in parts]),
      returns=np.concatenate([x.returns for x in parts]),
      lengths=np.concatenate([x.lengths for x in parts]),
      task_types=[t for x in parts for t in x.task_types],
      timings={k: max(x.timings[k] for x in parts) for k in ro.timings},
      decode_work=tuple(int(sum(x.decode_work[i] for x in parts)) for i in range(2)))
