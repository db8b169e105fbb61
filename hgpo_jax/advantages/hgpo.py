"""HGPO: hierarchy-of-groups step advantage over context depths k = 0..K (jit side).

docs/algorithms.md §6 (arXiv 2602.22817 §4, Eq. 7; released `recipe/hgpo/core_hgpo.py`):

  G_k(s_t) = rows of the same episode group whose last k+1 anchor observations
             equal (s_{t-k}, ..., s_t)                       (RowBatch.context_group[k])
  A_k(s_t) = (R~_t - mean_{G_k}) / (std_pop(G_k) + eps)     or  R~_t - mean_{G_k}
  A(s_t)   = sum_k w_k A_k / (sum_k w_k [+ eps])             over the surviving items

Rules of the released recipe, all kept: rows with fewer than k predecessors are
absent from level k; singleton groups are dropped; items whose advantage is exactly
0 are dropped (so equal-return groups neither contribute nor dilute, and the
exactness of group_stats matters here: float32 round-off would let them through,
see `zero_tolerance`);
weights are renormalised over the survivors; a row without survivors gets 0; the
std is the population std (ddof 0); no episode-level term unless `base_group`.

Weights (option `weights`, docs/algorithms.md §6):
  * "recipe" (default): w_k = (k+2)^alpha and eps = 1e-6 in the denominator, the
    released code that produced the published runs and numbers, so it is the
    default of a codebase that reproduces them (K=2, alpha=1: levels weigh 2:3:4);
  * "paper": w_k = (k+1)^alpha (Eq. 7, the anonymous ICLR code), no eps (1:2:3).
  * "inverse_variance" (this project, beyond the paper; the HGPO paper names adaptive
    weights as future work): w_k = n_k / s~_k^2, the precision of the level-k group
    mean, with the group's unbiased return variance shrunk toward its level-0 group's
    s~_k^2 = (SS_k + nu s_0^2) / (n_k - 1 + nu), nu = `variance_prior`, so a group of
    two with nearly equal returns cannot take all the weight; no eps, no alpha. Its
    value against the conventions above is measured by `python -m launch.experiments.studies.bias`
    (results/bias_study.md).
With `base_group` the GRPO-style episode advantage joins as one more item of
weight 1^alpha = 1 (the slot the recipe's offset reserves), subject to the same
zero filter.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from hgpo_jax.advantages import episode
from hgpo_jax.advantages import estimator
from hgpo_jax.advantages import group_stats
from hgpo_jax.advantages.batch import RowBatch

WEIGHTS = ("recipe", "paper", "inverse_variance")
"""Level weights: "recipe" (k+2)^alpha with eps, "paper" (k+1)^alpha without, or the
precision of each level's group mean ("inverse_variance", see the module docstring)."""


@dataclasses.dataclass(frozen=True)
class HGPOOptions:
  """HGPO options; defaults are the released recipe's ALFWorld runs (WebShop: norm="mean")."""

  k: int = 2
  """Deepest context level K (`history_length`); the batch must hold at least K+1 levels."""
  alpha: float = 1.0
  """Weight exponent (`length_weight_alpha`); 0 gives uniform weights."""
  weights: str = "recipe"
  """"recipe" ((k+2)^alpha, eps in the denominator), "paper" ((k+1)^alpha, Eq. 7) or
  "inverse_variance" (n_k / shrunk variance, see the module docstring)."""
  norm: str = "mean_std"
  """"mean_std" (`mean_std_norm`, ALFWorld) or "mean" (`mean_norm`, WebShop)."""
  base_group: bool = False
  """Add the episode advantage as an extra item of weight 1 (paper Table 5; off in all runs)."""
  stats: str = "rows"
  """Population of the `base_group` episode term: "rows" (recipe) or "trajectories"."""
  ddof: int = 0
  """Std estimator of the level groups: 0 = population std (np.std, recipe)."""
  base_ddof: int = 1
  """Std estimator of the `base_group` episode term: 1 = unbiased (the GRPO routine)."""
  epsilon: float = 1e-6
  """Added to the std before dividing (and to the weight sum under "recipe")."""
  zero_tolerance: float = group_stats.ZERO_TOLERANCE
  """A deviation within this fraction of its group's range is an exact 0, so the zero
  filter drops what is 0 in exact arithmetic, not float32 round-off (group_stats)."""

  variance_prior: float = 2.0
  """"inverse_variance" only: pseudo-count nu of the level-0 variance in each level's estimate."""

  def __post_init__(self):
    if self.weights == "inverse_variance" and self.base_group:
      raise ValueError("weights='inverse_variance' has no weight for the base_group episode "
                       "item; use weights='recipe' or 'paper' with base_group=True")
    if self.variance_prior <= 0:
      raise ValueError(f"option variance_prior={self.variance_prior!r} must be > 0")
    if not isinstance(self.k, int) or self.k < 0:
      raise ValueError(f"option k={self.k!r} must be a non-negative integer")
    episode.check_choice("weights", self.weights, WEIGHTS)
    episode.check_choice("norm", self.norm, episode.NORMS)
    episode.check_choice("stats", self.stats, episode.STATS)


@estimator.define("hgpo", HGPOOptions)
def hgpo(batch: RowBatch, options: HGPOOptions) -> estimator.EstimatorOutput:
  """HGPO advantage per row, f32[R] (Eq. 7 with the recipe's survivor rules)."""
  num_levels = options.k + 1
  if num_levels > batch.num_levels:
    raise ValueError(
        f"HGPO k={options.k} needs {num_levels} context levels but the batch has "
        f"{batch.num_levels}; build the batch with num_levels >= {num_levels}")
  use_std = options.norm == "mean_std"
  ctx_kr = batch.context_group[:num_levels]
  member_kr = batch.mask[None, :] & (ctx_kr >= 0)
  returns_kr = jnp.broadcast_to(batch.returns, ctx_kr.shape)
  dev = group_stats.group_deviation(returns_kr, ctx_kr, member_kr, options.zero_tolerance)
  adv_kr = dev.deviation
  if use_std:
    adv_kr = adv_kr / (group_stats.group_std(dev, options.ddof) + options.epsilon)
  keep_kr = member_kr & (dev.count >= 2) & (adv_kr != 0.0)

  if options.weights == "inverse_variance":
    nu = options.variance_prior
    var0_r = dev.sum_sq[0] / jnp.maximum(dev.count[0] - 1.0, 1.0)
    var_kr = (dev.sum_sq + nu * var0_r[None, :]) / (dev.count - 1.0 + nu)
    w_kr = jnp.where(keep_kr & (var_kr > 0), dev.count / jnp.where(var_kr > 0, var_kr, 1.0), 0.0)
  else:
    offset = 2.0 if options.weights == "recipe" else 1.0
    w_k = (jnp.arange(num_levels, dtype=jnp.float32) + offset) ** options.alpha
    w_kr = jnp.where(keep_kr, w_k[:, None], 0.0)
  num_r = jnp.sum(w_kr * adv_kr, axis=0)
  den_r = jnp.sum(w_kr, axis=0)
  if options.base_group:
    base_r = episode.episode_advantage(batch, stats=options.stats, use_std=use_std,
                                       ddof=options.base_ddof, epsilon=options.epsilon,
                                       zero_tolerance=options.zero_tolerance)
    base_w_r = jnp.where(batch.mask & (base_r != 0.0), 1.0, 0.0)
    num_r = num_r + base_w_r * base_r
    den_r = den_r + base_w_r
  den_eps = options.epsilon if options.weights == "recipe" else 0.0
  adv_r = jnp.where(den_r > 0, num_r / jnp.where(den_r > 0, den_r + den_eps, 1.0), 0.0)
  return estimator.EstimatorOutput(advantage=jnp.where(batch.mask, adv_r, 0.0))
