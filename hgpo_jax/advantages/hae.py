"""HiPER's hierarchical advantage estimation (HAE), docs/algorithms.md §8, registered as `hae`.

One LLM emits `<switch>KEEP|SWITCH</switch><subgoal>…</subgoal><action>…</action>`
every turn; switches split each trajectory into subgoal segments
sigma_m = [s_m, e_m] (`segments.py`): turn 0 always starts one, a later turn starts one
iff its parsed switch is not KEEP. A three-head critic gives per turn V_low (executor),
V_high (planner, used at segment starts) and V_term (switch).

The defaults reproduce the released code, JonP07/HiPER-agent@9d3c118
`hiper_hae/hier_mask.py` (masks, switch flags) then `hiper_hae/core_hae.py`
`compute_hae_advantage`, called in that order by `verl/trainer/ppo/ray_trainer.py`
(lines 1387-1400); docs/algorithms.md §8 lists every convention with file and line.

Turn reward (core_hae.py lines 187-243):
  r_t = r_t^env - eta*(1 - valid_t) + keep terms. A KEEP turn is one whose parsed
  switch is KEEP (missing and empty count as KEEP), turn 0 included
  (`first_turn_keep="penalised"`, the released rule: the switch flags come from the
  text and only the segmentation forces turn 0 to be a boundary); with
  `first_turn_keep="exempt"` turn 0 is never a KEEP turn. A KEEP turn gets
  `keep_penalty` ("fixed") or `keep_penalty / T_traj` ("normalised"; trajectories
  of one turn get none, as released), plus `keep_consistency_penalty` if
  `RowBatch.subgoal_changed` (set by the host, `hae_fields_from_dump`: the token ids
  of the subgoal span, tags included, differ from the previous turn's, both present).
  `RowBatch.segment_start` therefore holds the parsed switch flag of every turn,
  turn 0 included (False for a KEEP at turn 0); the segmentation forces turn 0.

Low level (GAE restricted to a segment, bootstrapped at the boundary):
  delta_t = r_t + gamma*(1-d_t)*V_next - V_low(t)
  V_next  = V_low(t+1) inside the segment; V_high(s_{m+1}) at a segment end with a
            next segment; at a truncated last turn V_low(t) if `bootstrap_truncated`
            else 0
  A_low(t) = delta_t + gamma*lambda_turn*(1-d_t)*A_low(t+1), reset at segment ends.
High level (SMDP GAE over segment starts), d_m = e_m - s_m + 1:
  G_m = sum_{t=s_m}^{e_m} gamma^(t-s_m) r_t
  delta_m = G_m + gamma^d_m (1-done_{e_m}) B_m - V_high(s_m)
  A_high(s_m) = delta_m + gamma^d_m * lambda_seg * (1-done_{e_m}) * A_high(s_{m+1})
  B_m = V_high(s_{m+1}); for a truncated last segment V_high(s_m) if
  `bootstrap_truncated` else 0.
Termination level: ret_term(t) = sum_{u=t}^{e_m} gamma^(u-t) r_u
  + gamma^(e_m-t+1) (1-done_{e_m}) B_m and A_term(t) = ret_term(t) - V_term(t)
  (core_hae.py lines 424-459: the same bootstrap B_m as the high level).
Value targets: ret_low = A_low + V_low, ret_high = A_high + V_high (segment starts),
ret_term. With `norm_adv` each level is whitened over the turns that carry its tokens:
(A - mean) / (std_population + 1e-8).

Token routing (`token_spans`; codes TAG_*, a token may belong to several blocks):
A_term on switch tokens of every turn, A_high on subgoal tokens of segment-start
turns, A_low on action tokens of every turn; a token in several masks gets the sum
(core_hae.py line 549). A row without a closed `<action>` block: with
`missing_action="whole_response"` (released, hier_mask.py lines 162-164) every
response token is in the action mask, so its switch and subgoal tokens get A_low on
top of their own level; with `missing_action="rest"` only the tokens outside the
switch and (segment-start) subgoal masks get A_low. The loss mask is the union of
the three masks. Without `token_tags` only the per-row levels are produced.

Rollout-dump fields read by `hae_fields_from_dump` (beside group/traj/step/...):
  `switch`: str or null, the parsed `<switch>` content of the turn;
  `subgoal`: str or null, the parsed `<subgoal>` content (text comparison);
  `values`: {"low": float, "high": float, "term": float}, the critic heads;
  `token_tags`: optional list[int] of TAG_* codes, one per response token;
  `response_ids`: optional list[int], the response token ids (token-id comparison).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hgpo_jax.advantages import estimator
from hgpo_jax.advantages import segments
from hgpo_jax.advantages.batch import RowBatch, pad_token_lists
# The token tags, the read-out positions and the critic heads are the model's (the critic
# reads its values there); re-exported for the estimator's callers.
from hgpo_jax.models.value_heads import (HEAD_HIGH, HEAD_LOW, HEAD_TERM, HEADS,  # noqa: F401
                                         TAG_ACTION, TAG_ALL_BLOCKS, TAG_OTHER, TAG_SUBGOAL,
                                         TAG_SUBGOAL_ACTION, TAG_SWITCH, TAG_SWITCH_ACTION,
                                         TAG_SWITCH_SUBGOAL, tag_code, tag_in, value_readout)


WHITEN_EPS = 1e-8
"""HiPER `norm_adv`: (A - mean) / (std_population + 1e-8)."""

KEEP_PENALTY_MODES = ("normalised", "fixed")
FIRST_TURN_KEEP_MODES = ("penalised", "exempt")
MISSING_ACTION_MODES = ("whole_response", "rest")

PUBLISHED_SETTINGS = {
    "alfworld": dict(keep_penalty=-0.3, keep_penalty_mode="normalised",
                     keep_consistency_penalty=-0.3, bootstrap_truncated=True),
    "webshop": dict(keep_penalty=-3.5, keep_penalty_mode="normalised",
                    keep_consistency_penalty=-0.3, bootstrap_truncated=False),
}
"""Per-environment values of HiPER's scripts (docs/algorithms.md §8); pass as HaeOptions(**...).
The ALFWorld script does not set the mode, so it is the yaml default (normalised). Sokoban
has no HiPER script; like ALFWorld it ends on success within a step budget, so it takes
ALFWorld's values (a choice of this project, not a published setting)."""
PUBLISHED_SETTINGS["sokoban"] = PUBLISHED_SETTINGS["alfworld"]


@dataclasses.dataclass(frozen=True)
class HaeOptions:
  """Options of `hae`; defaults are HiPER's published settings (docs/algorithms.md §8)."""

  gamma: float = 1.0
  """Turn discount (yaml default, not overridden by the scripts)."""
  lambda_turn: float = 1.0
  """Low-level GAE lambda inside a segment (yaml default)."""
  lambda_seg: float = 0.95
  """High-level (SMDP) GAE lambda across segments (scripts)."""
  bootstrap_truncated: bool = True
  """A truncated trajectory bootstraps its last segment (low: V_low(t), high/term:
  V_high(s_m)) instead of using 0. Scripts: True on ALFWorld, False on WebShop."""
  norm_adv: bool = True
  """Whiten each level over the turns that carry its tokens (scripts: True)."""
  invalid_penalty: float = 0.1
  """eta: subtracted from the turn reward of an invalid action."""
  keep_penalty: float = 0.0
  """Added per KEEP turn (see `keep_penalty_mode`); scripts -0.3 ALFWorld, -3.5 WebShop."""
  keep_penalty_mode: str = "normalised"
  """"normalised": keep_penalty / T_traj per KEEP turn; "fixed": keep_penalty."""
  keep_consistency_penalty: float = 0.0
  """Added on a KEEP turn whose subgoal changed (needs RowBatch.subgoal_changed); scripts -0.3."""
  first_turn_keep: str = "penalised"
  """"penalised" (released): a KEEP at turn 0 is a KEEP turn for the keep penalty (turn 0
  still starts the first segment); "exempt": turn 0 is never a KEEP turn."""
  missing_action: str = "whole_response"
  """Token mask of A_low in a row without a closed <action> block: "whole_response"
  (released: every response token, summed with the other levels) or "rest" (the tokens
  outside the switch and segment-start subgoal masks)."""

  def __post_init__(self):
    for name, allowed in (("keep_penalty_mode", KEEP_PENALTY_MODES),
                          ("first_turn_keep", FIRST_TURN_KEEP_MODES),
                          ("missing_action", MISSING_ACTION_MODES)):
      if getattr(self, name) not in allowed:
        raise ValueError(f"hae {name}={getattr(self, name)!r}; use one of {allowed}")


@flax.struct.dataclass
class HaeLevels:
  """Per-turn HAE quantities in row order, before whitening (0 on padding)."""

  turn_reward: jax.Array
  """f32[R]: r_t with penalties."""
  segment_start: jax.Array
  """bool[R]: the turn starts a segment, turn 0 included (where A_high / ret_high are defined)."""
  a_low: jax.Array
  """f32[R]: A_low(t)."""
  a_high: jax.Array
  """f32[R]: A_high(s_m) on segment starts, 0 elsewhere."""
  a_term: jax.Array
  """f32[R]: A_term(t)."""
  ret_low: jax.Array
  """f32[R]: A_low + V_low."""
  ret_high: jax.Array
  """f32[R]: A_high + V_high on segment starts, 0 elsewhere."""
  ret_term: jax.Array
  """f32[R]: ret_term(t)."""


def _check_batch(batch: RowBatch, options: HaeOptions) -> None:
  if batch.segment_start is None:
    raise ValueError("estimator 'hae' needs RowBatch.segment_start (from the parsed <switch> tags); "
                     "build it with segments.segment_start_flags")
  if batch.values is None or batch.values.ndim != 2 or batch.values.shape[1] != len(HEADS):
    shape = None if batch.values is None else tuple(batch.values.shape)
    raise ValueError(f"estimator 'hae' needs RowBatch.values f32[R, 3] (heads {HEADS}); got {shape}")
  if options.keep_consistency_penalty != 0.0 and batch.subgoal_changed is None:
    raise ValueError("hae keep_consistency_penalty is set but RowBatch.subgoal_changed is missing; "
                     "fill it from the parsed subgoals or set the penalty to 0 "
                     "(--config.algo.options.keep_consistency_penalty=0)")


def _levels(batch: RowBatch, options: HaeOptions) -> HaeLevels:
  """All per-turn HAE levels (docs/algorithms.md §8) with fixed shapes; see the module docstring."""
  gamma = options.gamma
  num_rows = batch.capacity
  lay = segments.segment_layout(batch.traj, batch.step, batch.mask, batch.segment_start)
  f32 = lambda x: x.astype(jnp.float32)
  turns_r = jax.ops.segment_sum(f32(batch.mask), batch.traj, num_segments=num_rows)[batch.traj]
  changed_r = f32(batch.subgoal_changed) if batch.subgoal_changed is not None else jnp.zeros_like(batch.reward)
  # One gather into position order for all per-turn inputs (keeps the program small).
  cols_p = lay.to_positions(jnp.stack(
      [batch.reward, f32(batch.action_valid), f32(batch.done), turns_r, changed_r,
       f32(batch.segment_start)], axis=1))
  mask_f = f32(lay.mask)
  reward_env, valid, done, turns, changed, switch_f = (cols_p[:, i] for i in range(6))
  values_p = lay.to_positions(batch.values) * mask_f[:, None]
  v_low, v_high, v_term = values_p[:, HEAD_LOW], values_p[:, HEAD_HIGH], values_p[:, HEAD_TERM]
  alive = 1.0 - done
  start_f, end_f, cont = f32(lay.is_start), f32(lay.is_end), lay.cont
  first_f = f32(lay.mask & ~jnp.concatenate([jnp.zeros((1,), bool), cont[:-1]]))

  # Turn rewards (core_hae.py lines 187-243). "penalised": KEEP = the parsed switch, so a
  # KEEP at turn 0 pays too (the segmentation alone forces turn 0 to be a boundary).
  keep = mask_f * (1.0 - (switch_f if options.first_turn_keep == "penalised" else start_f))
  if options.keep_penalty_mode == "normalised":  # released: none for one-turn trajectories
    keep_each = jnp.where(turns > 1.0, options.keep_penalty / jnp.maximum(turns, 1.0), 0.0)
  else:
    keep_each = jnp.full_like(turns, options.keep_penalty)
  # The host sets `changed` on KEEP turns after turn 0 only (a previous turn is needed).
  reward = (reward_env - options.invalid_penalty * (1.0 - valid) + keep * keep_each
            + options.keep_consistency_penalty * keep * (1.0 - first_f) * changed) * mask_f

  v_low_next, v_high_next = lay.shift_next(v_low), lay.shift_next(v_high)
  zero = jnp.zeros_like(v_low)

  # Low level: segment-local GAE.
  truncated_low = v_low if options.bootstrap_truncated else zero
  v_next = jnp.where(~lay.is_end, v_low_next, jnp.where(cont, v_high_next, truncated_low))
  delta = reward + gamma * alive * v_next - v_low
  a_low = segments.reverse_linear_scan(gamma * options.lambda_turn * alive * (1.0 - end_f), delta)

  # Segment bootstrap B_m, stored at the segment's end turn.
  truncated_high = v_high[lay.start] if options.bootstrap_truncated else zero
  boot_at_end = end_f * alive * jnp.where(cont, v_high_next, truncated_high)
  # ret_term(t): discounted rewards to the segment end + gamma^(e-t+1) * B_m.
  ret_term = segments.reverse_linear_scan(gamma * (1.0 - end_f), reward + gamma * boot_at_end)

  # High level: delta_m = ret_term(s_m) - V_high(s_m); the chain links s_m to
  # s_{m+1} by passing through the other turns of segment m (a = 1, b = 0).
  seg_len = f32(lay.end - lay.start + 1)
  link = (gamma ** seg_len) * options.lambda_seg * alive[lay.end] * f32(cont[lay.end])
  a_high = segments.reverse_linear_scan(
      jnp.where(lay.is_start, link, f32(cont)), start_f * (ret_term - v_high)) * start_f

  out_r = lay.to_rows(jnp.stack([
      reward, a_low * mask_f, a_high, (ret_term - v_term) * mask_f, (a_low + v_low) * mask_f,
      (a_high + v_high) * start_f, ret_term * mask_f, start_f], axis=1))
  return HaeLevels(
      turn_reward=out_r[:, 0], a_low=out_r[:, 1], a_high=out_r[:, 2], a_term=out_r[:, 3],
      ret_low=out_r[:, 4], ret_high=out_r[:, 5], ret_term=out_r[:, 6], segment_start=out_r[:, 7] > 0)


@functools.partial(jax.jit, static_argnums=(1,))
def hae_levels(batch: RowBatch, options: HaeOptions = HaeOptions()) -> HaeLevels:
  """Per-turn HAE levels and value targets before whitening (docs/algorithms.md §8).

  Reads `mask`, `traj`, `step`, `reward`, `action_valid`, `done`,
  `segment_start` bool[R] (the parsed switch flags; turn 0 is a boundary regardless),
  `values` f32[R, 3] and, with a consistency penalty, `subgoal_changed` bool[R].
  """
  _check_batch(batch, options)
  return _levels(batch, options)


def whiten_rows(x_r: jax.Array, mask_r: jax.Array) -> jax.Array:
  """(x - mean) / (std_population + 1e-8) over `mask_r`; 0 outside it (HiPER norm_adv)."""
  m = mask_r.astype(x_r.dtype)
  n = jnp.maximum(m.sum(), 1.0)
  mean = (x_r * m).sum() / n
  std = jnp.sqrt((jnp.square(x_r - mean) * m).sum() / n)
  return (x_r - mean) / (std + WHITEN_EPS) * m


@flax.struct.dataclass
class TokenSpans:
  """Which response tokens receive which level (bool[R, T] each; the masks may overlap)."""

  switch: jax.Array
  subgoal: jax.Array
  """Subgoal tokens of segment-start turns only."""
  action: jax.Array
  """Action tokens; in a row without them see `HaeOptions.missing_action`."""


def token_spans(token_tags: jax.Array, valid_rt: jax.Array, segment_start: jax.Array,
                missing_action: str = "whole_response") -> TokenSpans:
  """Routes tagged response tokens to the HAE levels (docs/algorithms.md §8, token routing).

  Args:
    token_tags: int8[R, T] TAG_* codes (a token may be in several blocks).
    valid_rt: bool[R, T] valid response tokens of real rows.
    segment_start: bool[R], turn 0 included (`HaeLevels.segment_start`).
    missing_action: `HaeOptions.missing_action`.
  """
  switch = valid_rt & tag_in(token_tags, TAG_SWITCH)
  subgoal = valid_rt & tag_in(token_tags, TAG_SUBGOAL) & segment_start[:, None]
  tagged_action = valid_rt & tag_in(token_tags, TAG_ACTION)
  has_action = tagged_action.any(axis=1, keepdims=True)
  fallback = valid_rt if missing_action == "whole_response" else valid_rt & ~switch & ~subgoal
  action = jnp.where(has_action, tagged_action, fallback)
  return TokenSpans(switch=switch, subgoal=subgoal, action=action)


@estimator.define("hae", HaeOptions, needs_critic=True)
def hae(batch: RowBatch, options: HaeOptions) -> estimator.EstimatorOutput:
  """HiPER HAE advantages, token routing and value targets (docs/algorithms.md §8).

  Returns:
    `advantage` f32[R]: A_low per turn (whitened if `norm_adv`);
    `token_advantage` f32[R, T] and `loss_mask` bool[R, T] when `token_tags` and
    `response_mask` are present (else None);
    `value_targets`: {"low", "high", "term": f32[R], "high_mask": bool[R]}.
  """
  _check_batch(batch, options)
  lv = _levels(batch, options)
  mask = batch.mask
  spans = None
  if batch.token_tags is not None:
    if batch.response_mask is None:
      raise ValueError("estimator 'hae' got RowBatch.token_tags without RowBatch.response_mask")
    valid_rt = batch.response_mask & mask[:, None]
    spans = token_spans(batch.token_tags, valid_rt, lv.segment_start, options.missing_action)
    low_rows, high_rows, term_rows = (spans.action.any(1), spans.subgoal.any(1), spans.switch.any(1))
  else:
    low_rows, high_rows, term_rows = mask, mask & lv.segment_start, mask
  a_low, a_high, a_term = lv.a_low, lv.a_high, lv.a_term
  if options.norm_adv:
    a_low = whiten_rows(a_low, low_rows)
    a_high = whiten_rows(a_high, high_rows)
    a_term = whiten_rows(a_term, term_rows)
  token_adv, loss_mask = None, None
  if spans is not None:
    token_adv = (spans.switch * a_term[:, None] + spans.subgoal * a_high[:, None]
                 + spans.action * a_low[:, None])
    loss_mask = spans.switch | spans.subgoal | spans.action
  return estimator.EstimatorOutput(
      advantage=a_low * mask, token_advantage=token_adv, loss_mask=loss_mask,
      value_targets={"low": lv.ret_low, "high": lv.ret_high, "term": lv.ret_term,
                     "high_mask": lv.segment_start})


SUBGOAL_COMPARE_MODES = ("token_ids", "text")


def _subgoal_key(row: dict[str, Any], compare: str):
  """What `subgoal_changed` compares: the token ids of the subgoal span, tags and
  straddling tokens included (core_hae.py lines 226-243), or the stripped parsed text."""
  if compare == "text":
    return row.get("subgoal")
  ids = np.asarray(row["response_ids"], np.int64)
  tags = np.asarray(row["token_tags"])[:len(ids)]
  key = tuple(int(x) for x in ids[:len(tags)][tag_in(tags, TAG_SUBGOAL)])
  return key or None  # an empty span counts as missing (keep_consistency_requires_both)


def hae_fields_from_dump(rows: Sequence[dict[str, Any]], num_tokens: Optional[int] = None,
                         subgoal_compare: Optional[str] = None) -> dict[str, np.ndarray]:
  """RowBatch HiPER fields from dump rows, aligned with `rows` (not padded).

  Args:
    rows: dump rows with `traj`, `step`, `switch`, `values` and optionally
      `subgoal`, `token_tags`, `response_ids` (see the module docstring).
    num_tokens: T for `token_tags`; default = the longest tag list.
    subgoal_compare: how `subgoal_changed` compares a KEEP turn's subgoal with the
      previous turn's (both present, as released): "token_ids" (released: the ids of the
      subgoal span, tags included; needs `response_ids` and `token_tags` on every row),
      "text" (the stripped parsed `subgoal` strings), or None: "token_ids" when every row
      has both fields, else "text".

  Returns:
    {"segment_start": bool[n] (the parsed switch is not KEEP; turn 0 included, so a KEEP
    at turn 0 is False: `hae` forces turn 0 to be a boundary itself),
    "values": f32[n, 3], "subgoal_changed": bool[n]} plus {"token_tags": int8[n, T],
    "response_mask": bool[n, T]} when every row has `token_tags`.
  """
  for i, row in enumerate(rows):
    if "values" not in row or any(h not in row["values"] for h in HEADS):
      raise ValueError(f"dump row {i} lacks `values` with heads {HEADS}; estimator 'hae' needs the critic")
  has_ids = bool(rows) and all("response_ids" in r and "token_tags" in r for r in rows)
  compare = subgoal_compare or ("token_ids" if has_ids else "text")
  if compare not in SUBGOAL_COMPARE_MODES:
    raise ValueError(f"hae subgoal_compare={compare!r}; use one of {SUBGOAL_COMPARE_MODES}")
  if compare == "token_ids" and not has_ids:
    raise ValueError("subgoal_compare='token_ids' needs `response_ids` and `token_tags` on every "
                     "dump row; use subgoal_compare='text' for dumps without them")
  start = np.array([not segments.switch_is_keep(r.get("switch")) for r in rows], bool)
  values = np.array([[float(r["values"][h]) for h in HEADS] for r in rows], np.float32).reshape(-1, 3)
  # Previous turn = the previous row of the trajectory in step order (core_hae.py line 236).
  by_traj: dict[Any, list[int]] = {}
  for i, r in enumerate(rows):
    by_traj.setdefault(r["traj"], []).append(i)
  changed = np.zeros(len(rows), bool)
  for idxs in by_traj.values():
    idxs.sort(key=lambda i: int(rows[i]["step"]))
    for prev, cur in zip(idxs, idxs[1:]):
      if start[cur]:
        continue
      a, b = _subgoal_key(rows[prev], compare), _subgoal_key(rows[cur], compare)
      if a is None or b is None:
        continue
      changed[cur] = a != b if compare == "token_ids" else a.strip() != b.strip()
  fields = {"segment_start": start, "values": values, "subgoal_changed": changed}
  if rows and all("token_tags" in r for r in rows):
    tags, resp = pad_token_lists([r["token_tags"] for r in rows], num_tokens, np.int8,
                                 "token tags")
    fields["token_tags"], fields["response_mask"] = tags, resp
  return fields
