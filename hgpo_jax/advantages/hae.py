"""HiPER's hierarchical advantage estimation (HAE), docs/algorithms.md §8, registered as `hae`.

One LLM emits `<switch>KEEP|SWITCH</switch><subgoal>…</subgoal><action>…</action>`
every turn; switches split each trajectory into subgoal segments
sigma_m = [s_m, e_m] (`segments.py`). A three-head critic gives per turn V_low
(executor), V_high (planner, used at segment starts) and V_term (switch).

Turn reward (HiPER-agent `hiper_hae/core_hae.py`, per-turn reward manager):
  r_t = r_t^env - eta*(1 - valid_t) + keep terms, where a KEEP turn (any turn that
  does not start a segment; turn 0 always starts one) gets `keep_penalty`
  ("fixed") or `keep_penalty / T_traj` ("normalised"), plus
  `keep_consistency_penalty` if its subgoal differs from the previous turn's
  (`RowBatch.subgoal_changed`, set by the host only when both subgoals exist).

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
  + gamma^(e_m-t+1) (1-done_{e_m}) B_m and A_term(t) = ret_term(t) - V_term(t).
  (The truncated-segment bootstrap B_m is shared with the high level: this
  repository's reading, docs/algorithms.md §8; the formula names only V_high(s_{m+1}).)
Value targets: ret_low = A_low + V_low, ret_high = A_high + V_high (segment starts),
ret_term. With `norm_adv` each level is whitened over the turns that carry its
tokens: (A - mean) / (std_population + 1e-8).

Token routing (`token_tags`, codes TAG_*): A_high on subgoal tokens of
segment-start turns, A_term on switch tokens of every turn, A_low on action
tokens of every turn; a row without action tokens gives A_low to every other
response token (the published fallback "whole response"). The loss mask is the
union of these spans. Without `token_tags` only the per-row levels are produced.

Rollout-dump fields read by `hae_fields_from_dump` (beside group/traj/step/...):
  `switch`: str or null, the parsed `<switch>` content of the turn;
  `subgoal`: str or null, the parsed `<subgoal>` content (consistency penalty);
  `values`: {"low": float, "high": float, "term": float}, the critic heads;
  `token_tags`: optional list[int] of TAG_* codes, one per response token.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from hgpo_jax.advantages import registry
from hgpo_jax.advantages import segments
from hgpo_jax.advantages.batch import RowBatch, pad_token_lists

# int8 span tags of response tokens (RowBatch.token_tags); the tag markup itself
# (`<switch>`, `</switch>`, ...) belongs to its span.
TAG_OTHER = 0
TAG_SWITCH = 1
TAG_SUBGOAL = 2
TAG_ACTION = 3

# Critic heads along the last axis of RowBatch.values (f32[R, 3]).
HEAD_LOW = 0
HEAD_HIGH = 1
HEAD_TERM = 2
HEADS = ("low", "high", "term")

WHITEN_EPS = 1e-8
"""HiPER `norm_adv`: (A - mean) / (std_population + 1e-8)."""

KEEP_PENALTY_MODES = ("normalised", "fixed")

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

  def __post_init__(self):
    if self.keep_penalty_mode not in KEEP_PENALTY_MODES:
      raise ValueError(f"hae keep_penalty_mode={self.keep_penalty_mode!r}; use one of {KEEP_PENALTY_MODES}")


@flax.struct.dataclass
class HaeLevels:
  """Per-turn HAE quantities in row order, before whitening (0 on padding)."""

  turn_reward: jax.Array
  """f32[R]: r_t with penalties."""
  segment_start: jax.Array
  """bool[R]: the turn starts a segment (where A_high / ret_high are defined)."""
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
  if options.keep_penalty_mode == "normalised":
    turns_r = jax.ops.segment_sum(f32(batch.mask), batch.traj, num_segments=num_rows)[batch.traj]
  else:
    turns_r = jnp.ones_like(batch.reward)
  changed_r = f32(batch.subgoal_changed) if batch.subgoal_changed is not None else jnp.zeros_like(batch.reward)
  # One gather into position order for all per-turn inputs (keeps the program small).
  cols_p = lay.to_positions(jnp.stack(
      [batch.reward, f32(batch.action_valid), f32(batch.done), turns_r, changed_r], axis=1))
  mask_f = f32(lay.mask)
  reward_env, valid, done, turns, changed = (cols_p[:, i] for i in range(5))
  values_p = lay.to_positions(batch.values) * mask_f[:, None]
  v_low, v_high, v_term = values_p[:, HEAD_LOW], values_p[:, HEAD_HIGH], values_p[:, HEAD_TERM]
  alive = 1.0 - done
  start_f, end_f, cont = f32(lay.is_start), f32(lay.is_end), lay.cont

  # Turn rewards (per-turn reward manager of HiPER-agent); a KEEP turn is one that starts no segment.
  keep = mask_f * (1.0 - start_f)
  keep_each = options.keep_penalty / jnp.maximum(turns, 1.0)  # "fixed": turns == 1
  reward = (reward_env - options.invalid_penalty * (1.0 - valid) + keep * keep_each
            + options.keep_consistency_penalty * keep * changed) * mask_f

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
  `segment_start` bool[R], `values` f32[R, 3] and, with a consistency penalty,
  `subgoal_changed` bool[R].
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
  """Which response tokens receive which level (bool[R, T] each)."""

  switch: jax.Array
  subgoal: jax.Array
  """Subgoal tokens of segment-start turns only."""
  action: jax.Array
  """Action tokens, or every non-switch/non-subgoal token of a row without them."""


def token_spans(token_tags: jax.Array, valid_rt: jax.Array, segment_start: jax.Array) -> TokenSpans:
  """Routes tagged response tokens to the HAE levels (docs/algorithms.md §8, token routing).

  Args:
    token_tags: int8[R, T] TAG_* codes.
    valid_rt: bool[R, T] valid response tokens of real rows.
    segment_start: bool[R].
  """
  switch = valid_rt & (token_tags == TAG_SWITCH)
  subgoal = valid_rt & (token_tags == TAG_SUBGOAL) & segment_start[:, None]
  tagged_action = valid_rt & (token_tags == TAG_ACTION)
  has_action = tagged_action.any(axis=1, keepdims=True)
  action = jnp.where(has_action, tagged_action, valid_rt & ~switch & ~subgoal)
  return TokenSpans(switch=switch, subgoal=subgoal, action=action)


@registry.register("hae", HaeOptions, needs_critic=True)
def hae(batch: RowBatch, options: HaeOptions) -> registry.EstimatorOutput:
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
    spans = token_spans(batch.token_tags, valid_rt, lv.segment_start)
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
  return registry.EstimatorOutput(
      advantage=a_low * mask, token_advantage=token_adv, loss_mask=loss_mask,
      value_targets={"low": lv.ret_low, "high": lv.ret_high, "term": lv.ret_term,
                     "high_mask": lv.segment_start})


def hae_fields_from_dump(rows: Sequence[dict[str, Any]], num_tokens: Optional[int] = None
                         ) -> dict[str, np.ndarray]:
  """RowBatch HiPER fields from dump rows, aligned with `rows` (not padded).

  Args:
    rows: dump rows with `traj`, `step`, `switch`, `values` and optionally
      `subgoal`, `token_tags` (see the module docstring).
    num_tokens: T for `token_tags`; default = the longest tag list.

  Returns:
    {"segment_start": bool[n], "values": f32[n, 3], "subgoal_changed": bool[n]}
    plus {"token_tags": int8[n, T], "response_mask": bool[n, T]} when every row has
    `token_tags`.
  """
  for i, row in enumerate(rows):
    if "values" not in row or any(h not in row["values"] for h in HEADS):
      raise ValueError(f"dump row {i} lacks `values` with heads {HEADS}; estimator 'hae' needs the critic")
  step = [int(r["step"]) for r in rows]
  switch = [r.get("switch") for r in rows]
  start = segments.segment_start_flags(step, switch)
  values = np.array([[float(r["values"][h]) for h in HEADS] for r in rows], np.float32).reshape(-1, 3)
  subgoal_of = {(r["traj"], int(r["step"])): r.get("subgoal") for r in rows}
  changed = np.zeros(len(rows), bool)
  for i, r in enumerate(rows):
    prev = subgoal_of.get((r["traj"], step[i] - 1))
    cur = r.get("subgoal")
    changed[i] = (not start[i] and prev is not None and cur is not None
                  and prev.strip() != cur.strip())
  fields = {"segment_start": start, "values": values, "subgoal_changed": changed}
  if rows and all("token_tags" in r for r in rows):
    tags, resp = pad_token_lists([r["token_tags"] for r in rows], num_tokens, np.int8,
                                 "token tags")
    fields["token_tags"], fields["response_mask"] = tags, resp
  return fields
