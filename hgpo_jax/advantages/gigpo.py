"""GiGPO: episode-level plus anchor-state step-level advantage (jit side).

docs/algorithms.md §5 (arXiv 2505.10978, Eq. 3-8; verl-agent `gigpo/core_gigpo.py`):

  A(a_t) = A^E(tau) + omega * A^S(a_t)                                   (Eq. 8)

A^E is the GRPO episode term (`episode.episode_advantage`, statistics over rows by
default as in verl-agent). A^S normalises the penalised discounted return R~_t
inside the anchor-state group (same episode group, identical anchor observation,
`RowBatch.anchor_group`, Eq. 6-7); revisits by one trajectory count as several
members. Singleton anchor groups give A^S = 0. The same `norm` applies to both terms.
"""

from __future__ import annotations

import dataclasses

from hgpo_jax.advantages import episode
from hgpo_jax.advantages import estimator
from hgpo_jax.advantages import group_stats
from hgpo_jax.advantages import similarity
from hgpo_jax.advantages.batch import RowBatch


@dataclasses.dataclass(frozen=True)
class GiGPOOptions:
  """GiGPO options; defaults are the published ALFWorld run (WebShop used norm="mean")."""

  norm: str = "mean_std"
  """"mean_std" (`mean_std_norm`, ALFWorld script) or "mean" (`mean_norm`, WebShop, "w/o std")."""
  stats: str = "rows"
  """Episode-term population: "rows" (verl-agent) or "trajectories" (paper Eq. 3)."""
  omega: float = 1.0
  """Weight of the step term (`step_advantage_w`)."""
  ddof: int = 1
  """Std estimator of both terms: 1 = unbiased (torch.std)."""
  epsilon: float = 1e-6
  """Added to the std before dividing."""
  enable_similarity: bool = False
  """Host grouping: cluster near-identical anchor observations (`enable_similarity` of the
  released code); read by `grouping.grouping_options`, not by the kernel."""
  similarity_thresh: float = 0.95
  """difflib ratio a row needs with a cluster's representative to join it (released default)."""

  def __post_init__(self):
    episode.check_choice("norm", self.norm, episode.NORMS)
    episode.check_choice("stats", self.stats, episode.STATS)
    if self.enable_similarity:
      similarity.check_threshold(self.similarity_thresh)


def step_advantage(batch: RowBatch, options: GiGPOOptions):
  """A^S per row, f32[R]: R~_t normalised inside its anchor-state group (Eq. 7)."""
  return group_stats.normalize_in_groups(
      batch.returns, batch.anchor_group, batch.mask, use_std=options.norm == "mean_std",
      ddof=options.ddof, epsilon=options.epsilon)


@estimator.define("gigpo", GiGPOOptions)
def gigpo(batch: RowBatch, options: GiGPOOptions) -> estimator.EstimatorOutput:
  """GiGPO advantage per row, f32[R] (Eq. 8)."""
  use_std = options.norm == "mean_std"
  episode_r = episode.episode_advantage(batch, stats=options.stats, use_std=use_std,
                                        ddof=options.ddof, epsilon=options.epsilon)
  return estimator.EstimatorOutput(
      advantage=episode_r + options.omega * step_advantage(batch, options))
