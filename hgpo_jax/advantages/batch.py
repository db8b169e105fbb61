"""The row batch: the fixed-shape, jit-side view of one rollout.

One row per executed environment step, chronological within each trajectory,
padded to a static capacity `R` with `mask` False on padding rows. Strings never
enter this structure: the host (`hgpo_jax.advantages.grouping`) hashes anchor
observations and their context windows into dense int32 ids before building it.

Id conventions (all int32, shape noted in the field name's docstring):
  * every id is dense in `[0, R)`, so `num_segments=R` is a static upper bound for
    any `jax.ops.segment_*` reduction and the kernels compile once per capacity;
  * padding rows carry id 0 and `mask=False`; kernels must weight them by `mask`;
  * `context_group[k, r] == -1` means row r is absent from level k (it has fewer
    than k predecessors in its trajectory), which kernels treat like padding.

Critic-based estimators (`gae`, `hae`) read the optional value / token fields; the
group-based estimators ignore them. Optional fields are None when absent, which
keeps the pytree structure (and so the jit cache key) stable per estimator.
"""

from __future__ import annotations

from typing import Optional

import flax.struct
import jax
import numpy as np


@flax.struct.dataclass
class RowBatch:
  """A padded batch of step rows. `R` = row capacity, `K1` = K + 1 levels, `T` = response tokens."""

  mask: jax.Array
  """bool[R]: True for real rows, False for padding."""
  group: jax.Array
  """int32[R]: episode group (task) id; the N trajectories of one task share it (`uid`)."""
  traj: jax.Array
  """int32[R]: trajectory id, unique per trajectory in the batch (`traj_uid`)."""
  step: jax.Array
  """int32[R]: 0-based step index within the trajectory."""
  reward: jax.Array
  """f32[R]: environment reward of this step."""
  done: jax.Array
  """bool[R]: the episode terminated at this step (not merely truncated)."""
  action_valid: jax.Array
  """bool[R]: the response parsed into a well-formed action (docs/algorithms.md §1 validity rules)."""
  returns: jax.Array
  """f32[R]: discounted return-to-go after the invalid-action penalty, R~_t (docs/algorithms.md §1)."""
  score: jax.Array
  """f32[R]: row score S_t = R(tau) - eta * (1 - valid_t) (docs/algorithms.md §1)."""
  episode_return: jax.Array
  """f32[R]: penalty-free undiscounted episode return R(tau) of the row's trajectory."""
  traj_first: jax.Array
  """bool[R]: the row is the first (step 0) row of its trajectory."""
  anchor_group: jax.Array
  """int32[R]: anchor-state group: same `group` and identical anchor observation (GiGPO)."""
  context_group: jax.Array
  """int32[K1, R]: level-k context group (same `group`, identical last k+1 anchor
  observations); -1 where the row has fewer than k predecessors. Level 0 equals
  `anchor_group`."""

  # ---- optional: critic-based estimators (gae, hae) --------------------------------
  segment_start: Optional[jax.Array] = None
  """bool[R]: HiPER: the turn's parsed switch is not KEEP (missing or empty count as KEEP),
  turn 0 included, so a KEEP at turn 0 is False; `hae` forces turn 0 to start a segment
  itself and reads this flag for the keep penalty (`hae_fields_from_dump`)."""
  values: Optional[jax.Array] = None
  """f32[R, H] or f32[R]: per-turn critic values (HiPER: f32[R, 3], heads
  hae.HEAD_LOW / HEAD_HIGH / HEAD_TERM)."""
  token_values: Optional[jax.Array] = None
  """f32[R, T]: per-token critic values (token-level GAE)."""
  response_mask: Optional[jax.Array] = None
  """bool[R, T]: valid response tokens of each row."""
  token_tags: Optional[jax.Array] = None
  """int8[R, T]: HiPER span tags per response token: hae.TAG_OTHER / TAG_SWITCH /
  TAG_SUBGOAL / TAG_ACTION, or a multi-block code (4-7) for a token that straddles two
  blocks (tag markup included in its span; test membership with `hae.tag_in`)."""
  subgoal_changed: Optional[jax.Array] = None
  """bool[R]: HiPER: a KEEP turn whose subgoal differs from the previous turn's (both
  present): the token ids of the subgoal spans, tags included (released), or the stripped
  parsed text (`hae_fields_from_dump`); drives `keep_consistency_penalty`."""

  @property
  def capacity(self) -> int:
    return self.mask.shape[0]

  @property
  def num_levels(self) -> int:
    """K + 1: the number of context levels the host built."""
    return self.context_group.shape[0]


def pad_token_lists(lists, num_tokens: Optional[int], dtype, what: str):
  """Per-row token lists of dump rows -> (array[n, T] zero-padded, bool mask[n, T]).

  T = `num_tokens`, or the longest list when None; a longer list is a one-line
  ValueError naming `what` (the dump field)."""
  lengths = [len(x) for x in lists]
  num_tokens = max(lengths, default=1) if num_tokens is None else num_tokens
  if lengths and max(lengths) > num_tokens:
    raise ValueError(f"a dump row has {max(lengths)} {what}, more than num_tokens={num_tokens}")
  out = np.zeros((len(lists), num_tokens), dtype)
  mask = np.zeros((len(lists), num_tokens), bool)
  for i, x in enumerate(lists):
    out[i, :lengths[i]] = x
    mask[i, :lengths[i]] = True
  return out, mask
