"""Episode-level (trajectory outcome) estimators: GRPO and RLOO (jit side).

Both compare a trajectory's outcome with the other members of its episode group
(the N rollouts of one task) and broadcast one scalar to every step row of the
trajectory (docs/algorithms.md §3-4). The episode term of GiGPO and HGPO's
optional `base_group` term reuse `episode_advantage` from here.

Two statistics conventions (option `stats`):
  * "rows" (verl-agent default, `compute_mean_std_cross_steps=True`, what every
    published script ran): the value is the row score S_t = R(tau) - eta(1 - v_t),
    and group statistics run over every step row, so long trajectories weigh more.
  * "trajectories" (the papers' Eq. 3): one value per trajectory, the penalty-free
    episode return R(tau), statistics over the N trajectories.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hgpo_jax.advantages import estimator
from hgpo_jax.advantages import group_stats
from hgpo_jax.advantages.batch import RowBatch

NORMS = ("mean_std", "mean")
"""`mean_std`: (x - mean) / (std + eps) (`mean_std_norm`); `mean`: x - mean (`mean_norm`)."""
STATS = ("rows", "trajectories")
"""Population of the episode-group statistics: every step row, or one value per trajectory."""


def check_choice(option: str, value, choices) -> None:
  """Raises a one-line ValueError when an option is not one of its choices."""
  if value not in choices:
    raise ValueError(f"option {option}={value!r} is not one of {list(choices)}")


def episode_advantage(batch: RowBatch, *, stats: str, use_std: bool, ddof: int, epsilon: float,
                      zero_tolerance: float = group_stats.ZERO_TOLERANCE) -> jax.Array:
  """Group-normalised episode outcome per row, f32[R] (docs/algorithms.md §3, GiGPO Eq. 3).

  Singleton population (one row, or one trajectory under "trajectories"): mean 0 and
  std 1 as in verl-agent, i.e. the raw value divided by (1 + eps) under `use_std`.
  Equal values in a group give exactly 0 (see group_stats).
  """
  x_r, member_r = _episode_values(batch, stats)
  dev = group_stats.group_deviation(x_r, batch.group, member_r, zero_tolerance)
  if use_std:
    adv_r = dev.deviation / (group_stats.group_std(dev, ddof) + epsilon)
    single_r = x_r / (1.0 + epsilon)
  else:
    adv_r = dev.deviation
    single_r = x_r
  adv_r = jnp.where(member_r, jnp.where(dev.count == 1, single_r, adv_r), 0.0)
  return _to_rows(adv_r, batch, stats)


def _episode_values(batch: RowBatch, stats: str) -> tuple[jax.Array, jax.Array]:
  """The value being compared and the rows that form the statistics population."""
  if stats == "rows":
    return batch.score, batch.mask
  return batch.episode_return, batch.mask & batch.traj_first


def _to_rows(adv_r: jax.Array, batch: RowBatch, stats: str) -> jax.Array:
  """Under "trajectories" only first rows hold the value: copy it to every row of the trajectory."""
  if stats == "trajectories":
    per_traj = jax.ops.segment_sum(adv_r, batch.traj, num_segments=batch.capacity)
    adv_r = per_traj[batch.traj]
  return jnp.where(batch.mask, adv_r, 0.0)


@dataclasses.dataclass(frozen=True)
class GRPOOptions:
  """GRPO options; defaults are verl-agent's (the published runs)."""

  stats: str = "rows"
  """"rows" (verl-agent) or "trajectories" (paper): see the module docstring."""
  norm: str = "mean_std"
  """"mean_std" (`norm_adv_by_std_in_grpo=True`, scripts) or "mean" (Dr.GRPO style)."""
  ddof: int = 1
  """Std estimator: 1 = unbiased (torch.std, verl-agent)."""
  epsilon: float = 1e-6
  """Added to the std before dividing."""

  def __post_init__(self):
    check_choice("stats", self.stats, STATS)
    check_choice("norm", self.norm, NORMS)


@estimator.define("grpo", GRPOOptions)
def grpo(batch: RowBatch, options: GRPOOptions) -> estimator.EstimatorOutput:
  """GRPO: A = (S - mean_G S) / (std_G S + eps), broadcast to all rows (docs/algorithms.md §3)."""
  adv_r = episode_advantage(batch, stats=options.stats, use_std=options.norm == "mean_std",
                            ddof=options.ddof, epsilon=options.epsilon)
  return estimator.EstimatorOutput(advantage=adv_r)


@dataclasses.dataclass(frozen=True)
class RLOOOptions:
  """RLOO options; defaults are verl-agent's (the published runs)."""

  stats: str = "rows"
  """"rows" (verl-agent: leave-one-row-out) or "trajectories" (paper: leave-one-trajectory-out)."""

  def __post_init__(self):
    check_choice("stats", self.stats, STATS)


@estimator.define("rloo", RLOOOptions)
def rloo(batch: RowBatch, options: RLOOOptions) -> estimator.EstimatorOutput:
  """RLOO: A = (x - mean_G x) * n / (n - 1) = x - mean of the others (docs/algorithms.md §4).

  n counts the statistics population (rows or trajectories); n = 1 gives the raw value.
  """
  x_r, member_r = _episode_values(batch, options.stats)
  dev = group_stats.group_deviation(x_r, batch.group, member_r)
  n_r = dev.count
  adv_r = jnp.where(n_r > 1, dev.deviation * n_r / jnp.maximum(n_r - 1.0, 1.0), x_r)
  adv_r = jnp.where(member_r, adv_r, 0.0)
  return estimator.EstimatorOutput(advantage=_to_rows(adv_r, batch, options.stats))
