"""Critic-based estimators on the exact testbed: a critic of controlled quality, GAE, HAE.

A critic here is a function of the (t, window) node, like a value model of the history.
Its quality is its explained variance over the rows of a batch,

  EV = 1 - mean_rows (V_hat - V)^2 / Var_rows(V),

with V the exact value V(h_t) (`sampling.oracle_rows`). Two ways to degrade the exact
critic to a target EV in [0, 1] (`critic_values`):
  * "noise": V_hat = V + sigma * eps(node), one fixed standard normal per node (a
    systematic error of the function, not fresh noise per visit), eps rescaled so that
    mean_rows eps^2 = 1 and sigma^2 = (1 - EV) Var(V): EV is met exactly;
  * "shrink": V_hat = mean(V) + s (V - mean(V)) with s = 1 - sqrt(1 - EV), a critic that
    has learnt only part of the value's spread (EV = 0: a constant).

The estimators are the project's registered ones on one-token "responses":
  * `gae` with `multi_turn=True` (PPO's GAE(gamma, lambda) over turns, Schulman et al.
    arXiv 1506.02438 Eq. 16): A_t = sum_l (gamma lambda)^l delta_{t+l},
    delta_t = r_t + gamma (1 - d_t) V_hat(t+1) - V_hat(t). With the exact critic, lambda = 0
    gives A* exactly (the testbed's transitions and rewards are deterministic, so
    delta_t = Q - V), and lambda = 1 gives the Monte-Carlo advantage G_t - V(h_t);
  * `hae` (HiPER, docs/algorithms.md §8) with segments of fixed length `seg_len` (the
    gridworld has no subgoals: a segment start every `seg_len` turns stands in for the
    planner's SWITCH) and V_low = V_high = V_term = V_hat: the action-level advantage
    A_low is GAE(gamma, lambda_turn) inside a segment, bootstrapped with V_hat at the
    next segment's start. With lambda_turn = 1 (HiPER's default) it is the n-step return
    to the segment end minus V_hat(t).
Advantages are returned before any whitening (`norm_adv=False`): the batch-gradient
cosine is scale-invariant, and whitening only shifts by the batch mean.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from hgpo_jax.advantages import grouping
from hgpo_jax.analysis import sampling

CRITIC_MODES = ("noise", "shrink")


def explained_variance(v_hat: np.ndarray, v: np.ndarray) -> float:
  """1 - mean (v_hat - v)^2 / Var(v) over the rows (1 for the exact critic)."""
  var = float(np.var(v))
  return 1.0 - float(np.mean((np.asarray(v_hat) - v) ** 2)) / var if var > 0 else float("nan")


def critic_values(v: np.ndarray, node_key: np.ndarray, ev: float, mode: str,
                  rng: np.random.Generator) -> np.ndarray:
  """f64[n]: a critic of explained variance `ev` (see the module docstring).

  Args:
    v: f64[n] exact values V(h_t) of the rows.
    node_key: int[n] the rows' node ids (rows at the same node get the same error).
    ev: target explained variance in [0, 1].
    mode: "noise" or "shrink".
    rng: draws the per-node errors ("noise").
  """
  if mode not in CRITIC_MODES:
    raise ValueError(f"critic mode {mode!r}; use one of {CRITIC_MODES}")
  if not 0.0 <= ev <= 1.0:
    raise ValueError(f"explained variance {ev} outside [0, 1]")
  v = np.asarray(v, np.float64)
  mean, var = float(np.mean(v)), float(np.var(v))
  if mode == "shrink":
    return mean + (1.0 - np.sqrt(1.0 - ev)) * (v - mean)
  uniq, inv = np.unique(node_key, return_inverse=True)
  eps = rng.standard_normal(len(uniq))[inv.reshape(-1)]
  eps /= np.sqrt(np.mean(eps ** 2))
  return v + np.sqrt((1.0 - ev) * var) * eps


def critic_batch(ro: sampling.Rollouts, rows: np.ndarray, anchor, *, gamma: float,
                 seg_len: int = 4) -> grouping.GroupedRows:
  """The rows as one RowBatch for both critic estimators, built once: one-token responses
  (`gae`), a segment start every `seg_len` turns and no consistency flags (`hae`); the
  critic's values are set per call (`with_values`)."""
  n = len(rows)
  extra = {"token_values": np.zeros((n, 1), np.float32), "response_mask": np.ones((n, 1), bool),
           "segment_start": ro.step[rows] % seg_len == 0, "values": np.zeros((n, 3), np.float32),
           "subgoal_changed": np.zeros(n, bool)}
  return sampling.build(ro, rows, anchor, num_levels=1, gamma=gamma, extra_fields=extra)


def with_values(grouped: grouping.GroupedRows, values: np.ndarray) -> grouping.GroupedRows:
  """`grouped` with critic `values` (f[n], input order) as `token_values` and all three
  `values` heads."""
  v = np.zeros(grouped.batch.capacity, np.float32)
  v[:grouped.num_rows] = np.asarray(values, np.float32)[grouped.order]
  batch = grouped.batch.replace(token_values=v[:, None], values=np.stack([v, v, v], axis=1))
  return dataclasses.replace(grouped, batch=batch)


def gae_advantages(grouped: grouping.GroupedRows, values: np.ndarray, *, gamma: float,
                   lam: float) -> np.ndarray:
  """f64[n]: registered `gae` (multi-turn, one token per turn) with critic `values`."""
  return sampling.advantages(with_values(grouped, values), "gae", gamma=gamma, lam=lam,
                             multi_turn=True, invalid_penalty=0.0, norm_adv=False,
                             bootstrap_truncated=False)


def hae_advantages(grouped: grouping.GroupedRows, values: np.ndarray, *, gamma: float,
                   lambda_turn: float = 1.0, lambda_seg: float = 0.95) -> np.ndarray:
  """f64[n]: registered `hae`'s A_low with the segments of `critic_batch`."""
  return sampling.advantages(with_values(grouped, values), "hae", gamma=gamma,
                             lambda_turn=lambda_turn, lambda_seg=lambda_seg, norm_adv=False,
                             invalid_penalty=0.0, bootstrap_truncated=False)
