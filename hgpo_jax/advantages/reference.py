"""Readable reference estimators: plain Python loops over row dicts, float64.

This restates the published algorithms the way their code runs them (verl-agent
`core_gigpo` for GRPO / RLOO / GiGPO, the HGPO recipe's `core_hgpo` as written out
in docs/algorithms.md §6): dictionaries of groups, one numpy mean/std per
group. It is the baseline of the equivalence tests (tests/advantages) and of the
benchmark (launch/benchmarks/advantages.py); it is not used in training.

Two deliberate departures from the published float32 code, shared with the jit
kernels (hgpo_jax.advantages.group_stats): a group whose values are all equal has
advantage exactly 0 (docs/algorithms.md §2.3, §11.7), written here as an explicit
`max == min` rule; and a deviation from the group mean within ZERO_TOLERANCE of
the group's range is exactly 0, so HGPO's zero filter sees exact-arithmetic zeros.

Every function takes rows in any order (dicts with group, traj, step, anchor_obs,
reward, valid) and the estimator's options dataclass, and returns the advantages
as a list of floats in input order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import numpy as np

from hgpo_jax.advantages.group_stats import ZERO_TOLERANCE


def prepare(rows: Sequence[dict], gamma: float, invalid_penalty: float) -> list[dict]:
  """Per input row: returns R~_t, score S_t, episode return R(tau), time position (docs/algorithms.md §1).

  Returns a list aligned with `rows` of dicts with keys group, traj, pos, obs,
  ret (discounted, penalised), score, episode_return.
  """
  by_traj = defaultdict(list)
  for i, row in enumerate(rows):
    by_traj[row["traj"]].append(i)
  out: list[Any] = [None] * len(rows)
  for members in by_traj.values():
    members.sort(key=lambda i: rows[i]["step"])
    episode_return = sum(float(rows[i]["reward"]) for i in members)
    future = 0.0
    for pos in reversed(range(len(members))):
      row = rows[members[pos]]
      future = float(row["reward"]) + gamma * future
      penalty = 0.0 if row["valid"] else invalid_penalty
      out[members[pos]] = dict(
          group=row["group"], traj=row["traj"], pos=pos, obs=row["anchor_obs"],
          ret=future - penalty, score=episode_return - penalty,
          episode_return=episode_return)
  return out


def centered(values: Sequence[float], population: Sequence[float], zero_tolerance: float
             ) -> np.ndarray:
  """values - mean(population), with the two exact-zero rules of the module docstring."""
  x = np.asarray(values, dtype=np.float64)
  pop = np.asarray(population, dtype=np.float64)
  spread = pop.max() - pop.min()
  if spread == 0:
    return np.zeros_like(x)
  dev = x - pop.mean()
  dev[np.abs(dev) <= zero_tolerance * spread] = 0.0
  return dev


def normalize(values: Sequence[float], use_std: bool, ddof: int, epsilon: float,
              zero_tolerance: float = ZERO_TOLERANCE) -> np.ndarray:
  """mean_std_norm / mean_norm of one group."""
  dev = centered(values, values, zero_tolerance)
  if not use_std or not dev.any():  # singletons have no std (ddof=1)
    return dev
  return dev / (np.asarray(values, dtype=np.float64).std(ddof=ddof) + epsilon)


def _groups(prep: list[dict]) -> dict[Any, list[int]]:
  groups = defaultdict(list)
  for i, p in enumerate(prep):
    groups[p["group"]].append(i)
  return groups


def _trajectories(prep: list[dict], members: list[int]) -> dict[Any, list[int]]:
  """Rows of each trajectory in time order."""
  trajs = defaultdict(list)
  for i in members:
    trajs[prep[i]["traj"]].append(i)
  for rows_of_traj in trajs.values():
    rows_of_traj.sort(key=lambda i: prep[i]["pos"])
  return trajs


def episode(prep: list[dict], stats: str, use_std: bool, ddof: int, epsilon: float,
            zero_tolerance: float = ZERO_TOLERANCE) -> list[float]:
  """GRPO / GiGPO episode term (docs/algorithms.md §3): one scalar per row."""
  out = [0.0] * len(prep)
  for members in _groups(prep).values():
    if stats == "rows":
      values = {i: prep[i]["score"] for i in members}
      pop = list(values.values())
    else:
      values = {i: prep[i]["episode_return"] for i in members}
      pop = [prep[r[0]]["episode_return"] for r in _trajectories(prep, members).values()]
    if len(pop) == 1:  # verl-agent: mean 0, std 1
      for i in members:
        out[i] = values[i] / (1.0 + epsilon) if use_std else values[i]
      continue
    dev = centered([values[i] for i in members], pop, zero_tolerance)
    std = np.std(pop, ddof=ddof)
    for i, d in zip(members, dev):
      out[i] = float(d / (std + epsilon) if use_std else d)
  return out


def grpo(rows, options, gamma: float = 0.95, invalid_penalty: float = 0.1) -> list[float]:
  prep = prepare(rows, gamma, invalid_penalty)
  return episode(prep, options.stats, options.norm == "mean_std", options.ddof, options.epsilon)


def rloo(rows, options, gamma: float = 0.95, invalid_penalty: float = 0.1) -> list[float]:
  """RLOO (docs/algorithms.md §4): x minus the mean of the other members of the population."""
  prep = prepare(rows, gamma, invalid_penalty)
  out = [0.0] * len(prep)
  for members in _groups(prep).values():
    if options.stats == "rows":
      key, pop = "score", [prep[i]["score"] for i in members]
    else:
      key = "episode_return"
      pop = [prep[r[0]]["episode_return"] for r in _trajectories(prep, members).values()]
    n = len(pop)
    total = sum(pop)
    for i in members:
      x = prep[i][key]
      out[i] = x if n == 1 else x - (total - x) / (n - 1)
  return out


def gigpo(rows, options, gamma: float = 0.95, invalid_penalty: float = 0.1) -> list[float]:
  """GiGPO (docs/algorithms.md §5): episode term + omega * anchor-state step term."""
  prep = prepare(rows, gamma, invalid_penalty)
  use_std = options.norm == "mean_std"
  out = episode(prep, options.stats, use_std, options.ddof, options.epsilon)
  anchor_groups = defaultdict(list)
  for i, p in enumerate(prep):
    anchor_groups[(p["group"], p["obs"])].append(i)
  for members in anchor_groups.values():
    adv = normalize([prep[i]["ret"] for i in members], use_std, options.ddof, options.epsilon)
    for i, a in zip(members, adv):
      out[i] += options.omega * float(a)
  return out


def hgpo(rows, options, gamma: float = 0.95, invalid_penalty: float = 0.1) -> list[float]:
  """HGPO as the released recipe runs it (docs/algorithms.md §6), with the paper's weights as an option."""
  prep = prepare(rows, gamma, invalid_penalty)
  use_std = options.norm == "mean_std"
  items = defaultdict(list)  # row -> [(n_obs, advantage)]
  level_stats = {}  # (row, n_obs) -> (group size, sum of squared deviations)
  for members in _groups(prep).values():
    clusters = defaultdict(list)
    for traj_rows in _trajectories(prep, members).values():
      for pos, i in enumerate(traj_rows):
        for n_obs in range(1, min(options.k + 1, pos + 1) + 1):
          key = (n_obs, tuple(prep[j]["obs"] for j in traj_rows[pos - n_obs + 1:pos + 1]))
          clusters[key].append(i)
    for (n_obs, _), cluster in clusters.items():
      if len(cluster) < 2:
        continue
      rets = [prep[i]["ret"] for i in cluster]
      adv = normalize(rets, use_std, options.ddof, options.epsilon, options.zero_tolerance)
      ss = float(np.sum(centered(rets, rets, options.zero_tolerance) ** 2))
      for i, a in zip(cluster, adv):
        items[i].append((n_obs, float(a)))
        level_stats[i, n_obs] = (len(cluster), ss)
  if options.base_group:
    base = episode(prep, options.stats, use_std, options.base_ddof, options.epsilon,
                   options.zero_tolerance)
    for i in range(len(prep)):
      items[i].insert(0, (0, base[i]))
  out = [0.0] * len(prep)
  for i in range(len(prep)):
    survivors = [(n_obs, a) for n_obs, a in items[i] if a != 0]
    if not survivors:
      continue
    num = den = 0.0
    for n_obs, a in survivors:
      if n_obs == 0:
        w = 1.0
      elif options.weights == "inverse_variance":
        # Precision of the level's group mean, variance shrunk toward the level-0 group's.
        n, ss = level_stats[i, n_obs]
        n0, ss0 = level_stats[i, 1]
        nu = options.variance_prior
        w = n / ((ss + nu * ss0 / (n0 - 1)) / (n - 1 + nu))
      elif options.weights == "recipe":
        w = (n_obs + 1) ** options.alpha
      else:
        w = n_obs ** options.alpha
      num += w * a
      den += w
    out[i] = num / (den + (options.epsilon if options.weights == "recipe" else 0.0))
  return out


ESTIMATORS = {"grpo": grpo, "rloo": rloo, "gigpo": gigpo, "hgpo": hgpo}
"""The estimators this reference restates (a subset of the registry: no critic ones)."""
