"""Groups of trajectories with common random numbers, as RowBatches and advantages.

Common random numbers: the action at (batch b, task j, member i, step t) is drawn by
inverse CDF from one uniform u[b, j, i, t] fixed by the seed, so two policies (a beta
sweep) or two estimators see the same randomness and their differences are paired.
Group sizes N < N_max use the first N members of each group (nested subsets).

Many batches are scored at once: batch b's task j becomes episode group b*tasks + j
of one large RowBatch. Every estimator's statistics stay inside an episode group, so
this equals scoring the batches one by one (and compiles once per capacity).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from hgpo_jax.advantages import grouping
from hgpo_jax.advantages import registry
from hgpo_jax.analysis import testbed


@dataclasses.dataclass(frozen=True)
class Rollouts:
  """One row per executed step, sorted by (trajectory, step). All arrays are [n]."""

  batch: np.ndarray
  task: np.ndarray
  member: np.ndarray
  """Index of the trajectory inside its group (0..N_max-1)."""
  traj: np.ndarray
  """Global trajectory id."""
  step: np.ndarray
  node: np.ndarray
  """Node index inside layer `step` of the DAG."""
  ctx: np.ndarray
  """Context index (row of the tabular policy)."""
  cell: np.ndarray
  action: np.ndarray
  reward: np.ndarray
  done: np.ndarray
  noise: np.ndarray
  """A per-row digit for the "noisy" text observations (from the same seed)."""
  num_batches: int
  num_tasks: int
  group_size: int

  @property
  def num_rows(self) -> int:
    return len(self.step)

  def subset(self, group_size: int) -> np.ndarray:
    """bool[n]: rows of the first `group_size` members of every group."""
    return self.member < group_size


def sample(dag: testbed.Dag, sol: testbed.Solution, *, num_batches: int, group_size: int,
           seed: int) -> Rollouts:
  """Samples `num_batches` x tasks x `group_size` trajectories with common random numbers."""
  num_tasks = len(dag.start_nodes)
  rng = np.random.default_rng(seed)
  u = rng.random((num_batches, num_tasks, group_size, dag.horizon))
  noise_digits = rng.integers(0, 10, (num_batches, num_tasks, group_size, dag.horizon))
  b, j, i = np.meshgrid(np.arange(num_batches), np.arange(num_tasks), np.arange(group_size),
                        indexing="ij")
  b, j, i = b.reshape(-1), j.reshape(-1), i.reshape(-1)
  node = dag.start_nodes[j].copy()
  alive = np.arange(len(b))
  cols = {k: [] for k in ("traj", "step", "node", "action", "reward", "done")}
  for t in range(dag.horizon):
    if alive.size == 0:
      break
    probs = sol.probs[dag.layer_ctx[t][node]]
    cdf = np.cumsum(probs, axis=1)
    action = np.minimum((u[b[alive], j[alive], i[alive], t][:, None] > cdf[:, :-1]).sum(1),
                        testbed.NUM_ACTIONS - 1)
    cols["traj"].append(alive)
    cols["step"].append(np.full(alive.size, t))
    cols["node"].append(node)
    cols["action"].append(action)
    cols["reward"].append(dag.layer_reward[t][node, action])
    cols["done"].append(dag.layer_done[t][node, action])
    nxt = dag.layer_next[t][node, action]
    keep = nxt >= 0
    alive, node = alive[keep], nxt[keep]
  c = {k: np.concatenate(v) for k, v in cols.items()}
  order = np.lexsort((c["step"], c["traj"]))
  c = {k: v[order] for k, v in c.items()}
  traj, step, node = c["traj"], c["step"], c["node"]
  ctx = np.empty_like(node)
  cell = np.empty_like(node)
  for t in range(dag.horizon):
    at = step == t
    ctx[at] = dag.layer_ctx[t][node[at]]
    cell[at] = dag.layer_cell[t][node[at]]
  return Rollouts(batch=b[traj], task=j[traj], member=i[traj], traj=traj, step=step, node=node,
                  ctx=ctx, cell=cell, action=c["action"], reward=c["reward"], done=c["done"],
                  noise=noise_digits[b[traj], j[traj], i[traj], step],
                  num_batches=num_batches, num_tasks=num_tasks, group_size=group_size)


def oracle_rows(dag: testbed.Dag, sol: testbed.Solution, ro: Rollouts):
  """(A*, V, Q) per row: exact advantage, context value and action value."""
  a_star = np.empty(ro.num_rows)
  v = np.empty(ro.num_rows)
  for t in range(dag.horizon):
    at = np.flatnonzero(ro.step == t)
    if at.size == 0:
      continue
    q = sol.q[t][ro.node[at], ro.action[at]]
    v[at] = sol.v[t][ro.node[at]]
    a_star[at] = q - v[at]
  return a_star, v


def capacity_for(n: int) -> int:
  """Row capacity: the next power of two >= 4096 (few distinct shapes, so few compilations)."""
  return max(4096, 1 << max(n - 1, 1).bit_length())


def build(ro: Rollouts, rows: np.ndarray, anchor: Any, *, num_levels: int, gamma: float,
          extra_fields: dict | None = None, **grouping_options) -> grouping.GroupedRows:
  """RowBatch of the selected rows (bool[n] or indices) through the project's host grouping.

  `anchor` is the per-row anchor observation (ints or strings, aligned with all rows);
  `extra_fields` are RowBatch critic fields aligned with the selected rows (`critics`);
  `grouping_options` go to `grouping.build_row_batch` (e.g. `horizon`/`time_bucket`
  for time-aware keys, `similarity_thresh` for GiGPO's similarity grouping).
  """
  sel = np.flatnonzero(rows) if np.asarray(rows).dtype == bool else np.asarray(rows)
  anchor = np.asarray(anchor)[sel]
  cols = dict(group=ro.batch[sel] * ro.num_tasks + ro.task[sel], traj=ro.traj[sel],
              step=ro.step[sel], anchor_obs=anchor if anchor.dtype != object else list(anchor),
              reward=ro.reward[sel], valid=np.ones(sel.size, bool), done=ro.done[sel])
  return grouping.build_row_batch(cols, num_levels=num_levels, gamma=gamma, invalid_penalty=0.0,
                                  capacity=capacity_for(sel.size), extra_fields=extra_fields,
                                  **grouping_options)


def advantages(grouped: grouping.GroupedRows, name: str, **options) -> np.ndarray:
  """Registered estimator `name` with `options` on a grouped batch, f64[n] in input order."""
  est = registry.get(name)
  out = est(grouped.batch, est.options(**options))
  return grouped.to_input_order(np.asarray(out.advantage)).astype(np.float64)
