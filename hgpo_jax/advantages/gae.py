"""PPO's generalised advantage estimation (GAE) with a token-level critic (docs/algorithms.md §7).

Registered as `gae` (needs a critic). Two settings:

* `multi_turn=False` (default, the verl-agent "PPO (with critic)" baseline): GAE
  runs inside each row over its response tokens; the only non-zero token reward
  is the row score S_t = R(tau) - eta*(1 - valid_t) (`RowBatch.score`) on the
  row's last valid token and the value after it is 0. With gamma = lambda = 1
  this telescopes to A_j = S_t - V_j.
* `multi_turn=True`: the turns of a trajectory form one chain. The last token of
  turn t carries the turn reward r_t = reward_t - eta*(1 - valid_t) and bootstraps
  to the value at turn t+1's first response token (0 after a terminal turn; after
  a truncated last turn the turn's own first-token value if `bootstrap_truncated`,
  else 0). Solved without a sequential loop: per-row GAE plus a row-level linear
  recurrence for the carried advantage (see `_multi_turn_gae`).

Both return value targets `A + V` (before whitening) and, with `norm_adv`,
advantages whitened over all valid tokens of the batch with the unbiased
variance: (A - mean) / sqrt(var_unbiased + 1e-8) (verl `masked_whiten`).

Rollout-dump fields read by `gae_fields_from_dump` (one JSON object per row):
  `token_values`: list[float], the critic value at each response token; its
    length is the row's response length (the response mask).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hgpo_jax.advantages import estimator
from hgpo_jax.advantages import segments
from hgpo_jax.advantages.batch import RowBatch, pad_token_lists

WHITEN_EPS = 1e-8
"""verl `masked_whiten`: rsqrt(var_unbiased + 1e-8)."""


@dataclasses.dataclass(frozen=True)
class GaeOptions:
  """Options of `gae`; defaults reproduce verl-agent's PPO scripts (docs/algorithms.md §7)."""

  gamma: float = 1.0
  """Token discount; the PPO scripts leave verl's default 1.0."""
  lam: float = 1.0
  """GAE lambda; the PPO scripts leave verl's default 1.0."""
  norm_adv: bool = True
  """Whiten advantages over all valid tokens of the batch (unbiased var + 1e-8)."""
  multi_turn: bool = False
  """Bootstrap across the turns of a trajectory instead of treating rows independently."""
  invalid_penalty: float = 0.1
  """eta: multi_turn only, subtracted from the turn reward of an invalid action
  (the per-row setting reads the already penalised `RowBatch.score`)."""
  bootstrap_truncated: bool = False
  """multi_turn only: a truncated (not done) last turn bootstraps to its own
  first-token value instead of 0."""


def whiten_tokens(x_rt: jax.Array, mask_rt: jax.Array) -> jax.Array:
  """(x - mean) / sqrt(var_unbiased + 1e-8) over `mask_rt`; 0 outside it.

  Args:
    x_rt: f32[R, T].
    mask_rt: bool[R, T].
  """
  m = mask_rt.astype(x_rt.dtype)
  n = m.sum()
  mean = (x_rt * m).sum() / jnp.maximum(n, 1.0)
  var = (jnp.square(x_rt - mean) * m).sum() / jnp.maximum(n, 1.0)
  var_unbiased = var * n / jnp.maximum(n - 1.0, 1.0)
  return (x_rt - mean) * jax.lax.rsqrt(var_unbiased + WHITEN_EPS) * m


def last_token(mask_rt: jax.Array) -> jax.Array:
  """bool[R, T]: the last True of each row of `mask_rt` (none for empty rows)."""
  num_tokens = mask_rt.shape[1]
  idx = jnp.arange(num_tokens)
  last_idx = jnp.max(jnp.where(mask_rt, idx, -1), axis=1)
  return idx[None, :] == last_idx[:, None]


def row_gae(reward_rt: jax.Array, value_rt: jax.Array, gamma: float, lam: float) -> jax.Array:
  """GAE along the token axis of each row, with V = 0 after the last token.

  delta_j = r_j + gamma * V_{j+1} - V_j, A_j = delta_j + gamma * lambda * A_{j+1}
  (arXiv 1506.02438; docs/algorithms.md §7). Padding tokens must carry r = V = 0, so they add nothing.

  Args:
    reward_rt: f32[R, T] token rewards.
    value_rt: f32[R, T] token values (0 on padding).

  Returns:
    f32[R, T] advantages.
  """
  next_value_rt = jnp.concatenate([value_rt[:, 1:], jnp.zeros_like(value_rt[:, :1])], axis=1)
  delta_rt = reward_rt + gamma * next_value_rt - value_rt
  return segments.reverse_linear_scan(jnp.full_like(delta_rt, gamma * lam), delta_rt, axis=1)


def _multi_turn_gae(batch: RowBatch, valid_rt: jax.Array, value_rt: jax.Array,
                    options: GaeOptions) -> jax.Array:
  """Token GAE over whole trajectories (turns chained), f32[R, T].

  Within turn t, with W_t the bootstrap value after its last token and C_t the
  advantage at turn t+1's first token, GAE is linear in (W_t, C_t):
    A_j = L_j + (gamma*lambda)^(l-j) * gamma * (W_t + lambda * C_t),
  where L is the in-row GAE with W = C = 0 and l the last token. Evaluating this at
  the first token gives a first-order recurrence over turns, solved in position
  order by `reverse_linear_scan`.
  """
  gamma, lam = options.gamma, options.lam
  num_tokens = valid_rt.shape[1]
  turn_reward_r = batch.reward - options.invalid_penalty * (1.0 - batch.action_valid.astype(jnp.float32))
  local_rt = row_gae(jnp.where(last_token(valid_rt), turn_reward_r[:, None], 0.0), value_rt, gamma, lam)
  idx = jnp.arange(num_tokens)
  first_idx_r = jnp.argmax(valid_rt, axis=1)
  last_idx_r = jnp.max(jnp.where(valid_rt, idx, -1), axis=1)
  has_tokens_r = last_idx_r >= 0
  decay_rt = jnp.where(valid_rt, (gamma * lam) ** (last_idx_r[:, None] - idx[None, :]).astype(jnp.float32), 0.0)
  take = lambda x_rt: jnp.take_along_axis(x_rt, first_idx_r[:, None], axis=1)[:, 0]
  first_value_r = jnp.where(has_tokens_r, take(value_rt), 0.0)
  first_local_r = jnp.where(has_tokens_r, take(local_rt), 0.0)
  first_decay_r = jnp.where(has_tokens_r, take(decay_rt), 0.0)

  lay = segments.segment_layout(batch.traj, batch.step, batch.mask)
  alive_p = 1.0 - lay.to_positions(batch.done).astype(jnp.float32)
  cont_p = lay.cont.astype(jnp.float32)
  first_value_p = lay.to_positions(first_value_r)
  truncated_boot_p = first_value_p if options.bootstrap_truncated else jnp.zeros_like(first_value_p)
  boot_p = alive_p * jnp.where(lay.cont, lay.shift_next(first_value_p), truncated_boot_p)
  decay_p = lay.to_positions(first_decay_r)
  # x_t = A at turn t's first token = L_f + D_f*gamma*(W_t + lam * x_{t+1}).
  carry_p = segments.reverse_linear_scan(
      decay_p * gamma * lam * alive_p * cont_p,
      lay.to_positions(first_local_r) + decay_p * gamma * boot_p)
  next_adv_p = alive_p * cont_p * lay.shift_next(carry_p)
  tail_r = lay.to_rows(gamma * (boot_p + lam * next_adv_p))
  return (local_rt + decay_rt * tail_r[:, None]) * valid_rt


def _require_token_fields(batch: RowBatch, name: str) -> None:
  missing = [f for f in ("token_values", "response_mask") if getattr(batch, f) is None]
  if missing:
    raise ValueError(
        f"estimator {name!r} needs RowBatch.{' and RowBatch.'.join(missing)} (critic token values); "
        "fill them from the critic or the dump's `token_values`")


@estimator.define("gae", GaeOptions, needs_critic=True)
def gae(batch: RowBatch, options: GaeOptions) -> estimator.EstimatorOutput:
  """PPO-GAE advantages and value targets (docs/algorithms.md §7).

  Reads `token_values` f32[R, T], `response_mask` bool[R, T], `score` (per-row
  setting) or `reward`/`action_valid`/`done`/`traj`/`step` (multi_turn).

  Returns:
    `token_advantage` f32[R, T] (whitened if `norm_adv`), `loss_mask` = valid
    response tokens, `advantage` f32[R] = the token advantage at each row's first
    response token, `value_targets` = {"token": f32[R, T] A + V (unwhitened)}.
  """
  _require_token_fields(batch, "gae")
  valid_rt = batch.response_mask & batch.mask[:, None]
  value_rt = jnp.where(valid_rt, batch.token_values, 0.0)
  if options.multi_turn:
    adv_rt = _multi_turn_gae(batch, valid_rt, value_rt, options)
  else:
    reward_rt = jnp.where(last_token(valid_rt), batch.score[:, None], 0.0)
    adv_rt = row_gae(reward_rt, value_rt, options.gamma, options.lam) * valid_rt
  returns_rt = (adv_rt + value_rt) * valid_rt
  if options.norm_adv:
    adv_rt = whiten_tokens(adv_rt, valid_rt)
  first_idx_r = jnp.argmax(valid_rt, axis=1)
  adv_r = jnp.take_along_axis(adv_rt, first_idx_r[:, None], axis=1)[:, 0] * valid_rt.any(axis=1)
  return estimator.EstimatorOutput(
      advantage=adv_r, token_advantage=adv_rt, loss_mask=valid_rt,
      value_targets={"token": returns_rt})


def gae_fields_from_dump(rows: Sequence[dict[str, Any]], num_tokens: Optional[int] = None
                         ) -> dict[str, np.ndarray]:
  """RowBatch critic fields from dump rows, aligned with `rows` (not padded).

  Args:
    rows: dump rows, each with `token_values` (list[float]).
    num_tokens: T; default = the longest response.

  Returns:
    {"token_values": f32[n, T], "response_mask": bool[n, T]}.
  """
  for i, row in enumerate(rows):
    if "token_values" not in row:
      raise ValueError(f"dump row {i} has no `token_values`; estimator 'gae' needs critic values per token")
  token_values, response_mask = pad_token_lists(
      [row["token_values"] for row in rows], num_tokens, np.float32, "response tokens")
  return {"token_values": token_values, "response_mask": response_mask}
