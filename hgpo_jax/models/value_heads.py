"""The critic's value heads and where a HiPER turn's values are read: the heads' names
and order, the span tags of response tokens, and `value_readout` (the model side owns
them; `hgpo_jax.advantages.hae` and the trainer import them from here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# int8 span tags of response tokens (RowBatch.token_tags); the tag markup itself
# (`<switch>`, `</switch>`, ...) belongs to its span. A token that overlaps several
# blocks (e.g. "><" in "</subgoal><action>") is in each of them (hier_mask.py computes
# each block's token range on its own, lines 54-80): codes 4-7 name such sets. Codes
# 0-3 keep their meaning, so dumps written before the multi-block codes read the same.
TAG_OTHER = 0
TAG_SWITCH = 1
TAG_SUBGOAL = 2
TAG_ACTION = 3
TAG_SWITCH_SUBGOAL = 4
TAG_SUBGOAL_ACTION = 5
TAG_SWITCH_ACTION = 6
TAG_ALL_BLOCKS = 7

_TAG_BLOCKS = np.array([  # membership (switch, subgoal, action) of each code
    [0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 1]], bool)
_BLOCK_COLUMN = {TAG_SWITCH: 0, TAG_SUBGOAL: 1, TAG_ACTION: 2}


def tag_code(switch: bool, subgoal: bool, action: bool) -> int:
  """The TAG_* code of a token in the given blocks."""
  hits = np.flatnonzero((_TAG_BLOCKS == (switch, subgoal, action)).all(axis=1))
  return int(hits[0])


def tag_in(tags, block: int):
  """bool array: which tokens belong to `block` (TAG_SWITCH, TAG_SUBGOAL or TAG_ACTION).

  Works on numpy and jax arrays of TAG_* codes; codes outside 0..7 belong to no block.
  """
  xp = jnp if isinstance(tags, jax.Array) else np
  tags = xp.asarray(tags)
  ok = (tags >= 0) & (tags < len(_TAG_BLOCKS))
  table = xp.asarray(_TAG_BLOCKS[:, _BLOCK_COLUMN[block]])
  return ok & table[xp.where(ok, tags, 0).astype(xp.int32)]


def value_readout(tags) -> tuple[int, int, int]:
  """(low, high, term) response-token indices where a turn's three values are read.

  Released `compute_value_mask` (core_hae.py lines 556-642): high = term = 0; low = the
  first token after the subgoal block (`</subgoal>` included), else after the switch
  block, else 0; "after" means after the block's last token, so a token that straddles
  the block's end counts as the block's (multi-block codes), and a block that runs to
  the last token falls through to the next rule. The trainer reads its values here too
  (`training.value_targets`, `models.critic.hiper_readout`).
  """
  tags = np.asarray(tags)
  for block in (TAG_SUBGOAL, TAG_SWITCH):
    hits = np.flatnonzero(tag_in(tags, block))
    if hits.size and hits[-1] + 1 < tags.size:
      return int(hits[-1]) + 1, 0, 0
  return 0, 0, 0


# Critic heads along the last axis of RowBatch.values (f32[R, 3]).
HEAD_LOW = 0
HEAD_HIGH = 1
HEAD_TERM = 2
HEADS = ("low", "high", "term")
"""HiPER's three heads, in the order of the critic's outputs and of `RowBatch.values`."""

LEVELS = {1: ("token",), 3: HEADS}
"""Names of the heads by head count: PPO's one token value, HiPER's three (metrics keys
`critic/mean_value_<level>`)."""
