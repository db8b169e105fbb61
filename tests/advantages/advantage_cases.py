"""Shared data for the advantage tests: the golden batch of docs/algorithms.md §11.1 and random rollouts.

Imported by the test modules of this directory (`import advantage_cases`).

The golden batch is docs/algorithms.md §11.1 (gamma 0.95, eta 0.1, eps 1e-6).
Random rollouts mimic the estimators' hard cases: few distinct states per group
(revisits, loops), shared successful prefixes (equal returns), invalid steps,
trajectories of 1-50 steps, string and int ids, rows in shuffled order.
"""

from __future__ import annotations

import numpy as np

from hgpo_jax.advantages import build_row_batch
from hgpo_jax.advantages import registry

# uid, traj, anchor observations, env rewards, action-valid flags (docs/algorithms.md §11.1).
GOLDEN_TRAJS = [
    ("g1", "t1", ["A", "B", "C"], [0, 0, 10], [1, 1, 1]),
    ("g1", "t2", ["A", "D", "B", "C"], [0, 0, 0, 10], [1, 1, 1, 1]),
    ("g1", "t3", ["A", "B", "B"], [0, 0, 0], [1, 1, 1]),
    ("g2", "t4", ["P", "Q", "P", "R"], [0, 0, 0, 10], [1, 0, 1, 1]),
    ("g2", "t5", ["P", "R"], [0, 10], [1, 1]),
    ("g2", "t6", ["P", "Q", "Q"], [0, 0, 0], [1, 1, 1]),
]


def golden_rows() -> list[dict]:
  """The 19 rows of docs/algorithms.md §11.1 in batch order (row index = table row)."""
  return [dict(group=g, traj=t, step=s, anchor_obs=obs[s], reward=float(rew[s]), valid=bool(val[s]))
          for g, t, obs, rew, val in GOLDEN_TRAJS for s in range(len(obs))]


def random_rows(rng: np.random.Generator, *, max_groups: int = 3, max_trajs: int = 5,
                max_len: int = 50, max_rows: int | None = None) -> list[dict]:
  """A random rollout as shuffled row dicts (see the module docstring)."""
  rows = []
  for g in range(rng.integers(1, max_groups + 1)):
    group = f"task-{g}" if rng.random() < 0.5 else 100 + g
    num_states = int(rng.integers(1, 7))
    goal = int(rng.integers(0, num_states))
    for t in range(rng.integers(1, max_trajs + 1)):
      traj = f"{group}/{t}" if rng.random() < 0.5 else 1000 * (g + 1) + t
      # Short trajectories are common (fast success), long ones are loops.
      length = int(min(max_len, rng.geometric(0.08)))
      state = 0
      for s in range(length):
        last = s == length - 1
        success = last and state == goal and rng.random() < 0.8
        reward = 10.0 if success else float(rng.choice([0.0, 0.0, 0.0, 0.0, 0.5]))
        rows.append(dict(group=group, traj=traj, step=s, anchor_obs=f"room {state}",
                         reward=reward, valid=bool(rng.random() > 0.1)))
        # Mostly deterministic transitions so trajectories share prefixes.
        state = (state + 1) % num_states if rng.random() < 0.7 else int(rng.integers(0, num_states))
      if max_rows is not None and len(rows) >= max_rows:
        break
  if max_rows is not None:
    rows = _truncate(rows, max_rows)
  rng.shuffle(rows)
  return rows


def _truncate(rows: list[dict], max_rows: int) -> list[dict]:
  """Drops whole trailing trajectories until at most max_rows remain."""
  while len(rows) > max_rows:
    last = rows[-1]["traj"]
    rows = [r for r in rows if r["traj"] != last]
  return rows


def kernel_advantages(rows, name: str, options, *, num_levels: int = 1,
                      capacity: int | None = None, gamma: float = 0.95,
                      invalid_penalty: float = 0.1) -> np.ndarray:
  """Registered jit estimator on host-grouped rows, f64[n] in input order."""
  grouped = build_row_batch(rows, num_levels=num_levels, capacity=capacity, gamma=gamma,
                            invalid_penalty=invalid_penalty)
  out = registry.get(name)(grouped.batch, options)
  return grouped.to_input_order(np.asarray(out.advantage)).astype(np.float64)
