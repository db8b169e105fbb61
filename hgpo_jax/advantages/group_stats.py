"""Masked segment statistics shared by the group-based estimators (jit side).

Every group-based estimator normalises a value inside groups given by dense int32
ids (RowBatch conventions: ids in [0, R), so `num_segments = R` is static). This
module owns that one computation.

Exactness (docs/algorithms.md §2.3, example §11.7): the reference trainers
compute `x - mean(x)` in float32, and for a group of identical non-zero values the
mean is often 1-2 ulp off, which divided by a ~1e-7 std gives a spurious advantage
up to ~0.65. Here the statistics are taken on values shifted by the group minimum
(a member of the group). Identical members then shift to exactly 0.0, their mean is
exactly 0.0 and their deviation is exactly 0.0, so equal-value groups give an exact
zero advantage under every normalisation. The shift also improves the accuracy of
the float32 mean for all other groups.

The same reasoning applies to a single member that sits exactly at its group mean
(e.g. returns {a, b, c} with 2b = a + c): its advantage is 0 in exact arithmetic
but float32 round-off leaves ~1e-7 of the group's range, which HGPO's `a != 0`
filter would keep as an item of full weight (a jump of the result, not a small
error). Deviations within `zero_tolerance` (relative to the group's range
max - min) are therefore snapped to exactly 0. The default 1e-5 is ~100 float32
ulps, far below any deviation that matters (it moves a standardised advantage by
at most 1.5e-5) and far above the mean's round-off for groups of a few hundred.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


ZERO_TOLERANCE = 1e-5
"""|x - mean| <= ZERO_TOLERANCE * (max - min) of the group counts as an exact 0 (see above)."""


class GroupDeviation(NamedTuple):
  """Per-row view of the statistics of each row's group (all shaped like the input)."""

  deviation: jax.Array
  """f32[...]: x - mean(group), exactly 0 for non-members and equal-value groups."""
  count: jax.Array
  """f32[...]: number of members in the row's group (0 for non-members)."""
  sum_sq: jax.Array
  """f32[...]: sum of squared deviations over the row's group (0 for non-members)."""


def group_deviation(x: jax.Array, ids: jax.Array, member: jax.Array,
                    zero_tolerance: float = ZERO_TOLERANCE) -> GroupDeviation:
  """Centres `x` inside the groups `ids` over the rows where `member` is True.

  Args:
    x: f32[..., R] values (leading axes, e.g. levels, are independent problems).
    ids: int32[..., R] dense group ids in [0, R); ignored where `member` is False
      (so -1 and padding ids are allowed there).
    member: bool[..., R] rows that take part in the statistics.
    zero_tolerance: deviations within this fraction of the group's range become 0.

  Returns:
    GroupDeviation with per-row deviation, group size and group sum of squares.
  """
  num_segments = x.shape[-1]
  seg = jnp.where(member, ids, 0)

  def per_problem(x_r, seg_r, member_r):
    # Shift by the group minimum so that equal members become exact zeros.
    ref_g = jax.ops.segment_min(
        jnp.where(member_r, x_r, jnp.inf), seg_r, num_segments=num_segments)
    shifted_r = jnp.where(member_r, x_r - ref_g[seg_r], 0.0)
    count_g = jax.ops.segment_sum(member_r.astype(x_r.dtype), seg_r, num_segments=num_segments)
    sum_g = jax.ops.segment_sum(shifted_r, seg_r, num_segments=num_segments)
    mean_g = sum_g / jnp.maximum(count_g, 1.0)
    range_g = jax.ops.segment_max(shifted_r, seg_r, num_segments=num_segments)
    dev_r = shifted_r - mean_g[seg_r]
    dev_r = jnp.where(member_r & (jnp.abs(dev_r) > zero_tolerance * range_g[seg_r]), dev_r, 0.0)
    sum_sq_g = jax.ops.segment_sum(dev_r * dev_r, seg_r, num_segments=num_segments)
    count_r = jnp.where(member_r, count_g[seg_r], 0.0)
    sum_sq_r = jnp.where(member_r, sum_sq_g[seg_r], 0.0)
    return GroupDeviation(dev_r, count_r, sum_sq_r)

  flat = lambda a: a.reshape((-1, num_segments))
  out = jax.vmap(per_problem)(flat(x), flat(seg), flat(member))
  return GroupDeviation(*(a.reshape(x.shape) for a in out))


def group_std(stats: GroupDeviation, ddof: int) -> jax.Array:
  """Per-row std of the row's group: sqrt(sum_sq / (n - ddof)); 0 where n <= ddof.

  ddof=1 is torch.std (GRPO, GiGPO), ddof=0 is np.std (HGPO recipe).
  """
  denom = stats.count - ddof
  return jnp.where(denom > 0, jnp.sqrt(stats.sum_sq / jnp.maximum(denom, 1.0)), 0.0)


def normalize_in_groups(x: jax.Array, ids: jax.Array, member: jax.Array, *,
                        use_std: bool, ddof: int, epsilon: float,
                        zero_tolerance: float = ZERO_TOLERANCE) -> jax.Array:
  """`(x - mean) / (std + eps)` (use_std) or `x - mean` inside groups; 0 off `member`.

  verl-agent's `mean_std_norm` / `mean_norm` (docs/algorithms.md §2). Singleton
  groups give exactly 0 (deviation 0, std 0), which is the GiGPO/HGPO step rule.
  """
  stats = group_deviation(x, ids, member, zero_tolerance)
  if not use_std:
    return stats.deviation
  return stats.deviation / (group_std(stats, ddof) + epsilon)
