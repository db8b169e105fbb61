"""Token-level actor loss of verl / verl-agent: PPO-clip with dual clip, k3 KL, entropy.

Everything here is a pure function over f32 arrays with a boolean mask of the tokens
that are scored; the model, the batch layout and the micro-batching live in
`hgpo_jax.training.train_step`. Formulas follow docs/algorithms.md §9:

    rho_j = exp(logp_j - old_logp_j)
    L1 = -A_j rho_j ;  L2 = -A_j clip(rho_j, 1 - eps_low, 1 + eps_high) ;  Lc = max(L1, L2)
    L_j = min(Lc, -A_j c)  if A_j < 0  else  Lc                     (dual clip, c = 3)
    KL_j = clamp(exp(d_j) - d_j - 1, -10, 10),  d_j = clamp(ref_j - logp_j, -20, 20)   (k3)
    loss = agg(L) - entropy_coeff * agg(H) + kl_coef * agg(KL)

Aggregation modes (`agg(x, mask)`, `B` rows, `T` token positions):
  * `token-mean`: sum(x * mask) / sum(mask), the default everywhere in the papers.
  * `seq-mean-token-sum`: mean over rows of per-row token sums.
  * `seq-mean-token-mean`: mean over rows of per-row token means.
  * `seq-mean-token-sum-norm`: sum over rows and tokens / `norm_length` (Dr.GRPO;
    verl divides by the *constant* max response length, not by the row count).
The `seq-mean-*` modes average over rows that have at least one scored token. verl has
no all-masked rows (its `adjust_batch` pads by duplicating real rows), so this only
makes our zero-mask padding rows (see `train_batch`) invisible to the loss.

Options beyond verl-agent's defaults (docs/algorithms.md §9.2-§9.5), each verl's:
  * `policy_loss="gspo"`: the sequence-level ratio of GSPO (arXiv 2507.18071, Eq. 7;
    verl `compute_policy_loss_gspo`); a sequence is a row: one step's response.
  * `kl_estimator`: verl's `kl_penalty` estimators k1, abs, k2 (mse), k3 (low_var_kl).
  * `rollout_is` / `rollout_rs`: importance weights pi_old / pi_rollout of the sampler's
    own log-probs, truncated, and rejection of rows or tokens whose weight is out of
    [1/t, t] (verl `rollout_corr_helper`); they multiply the policy-gradient token losses.
A row of the loss is always one segment: the trainer refuses the sequence-level options
with packed rows.

The policy losses (`POLICY_LOSSES`), KL estimators (`KL_ESTIMATORS`) and rollout
correction levels (`ROLLOUT_CORRECTIONS`) are registries (`hgpo_jax.registry`), filled
below where their functions are defined: `LossConfig` validates its names with them and
the loss dispatches through them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from hgpo_jax import registry

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
KL_CLAMP = 10.0
"""|k3 KL| is clamped to this per token (verl `kl_penalty(..., "low_var_kl")`)."""
KL_ESTIMATORS = registry.Registry("KL estimator")
"""verl `kl_penalty` names -> `fn(logp_bt, ref_logp_bt) -> f32[B, T]` per-token KL
estimate ("kl", "mse", "low_var_kl" are verl's aliases of k1, k2, k3; verl's "full" is
not one: it needs the reference's whole distribution). Filled below `kl_penalty`."""
POLICY_LOSSES = registry.Registry("policy loss")
"""Values of `LossConfig.policy_loss` -> `fn(logp_bt, old_logp_bt, adv_bt, mask_bt,
config: LossConfig) -> (loss_bt, clipped_bt, dual_clipped_bt)` (as
`ppo_clip_token_losses` returns them): "ppo", PPO-clip with dual clip (verl "vanilla"),
and "gspo". Filled below `gspo_token_losses`; a new loss is one function registered here."""
ROLLOUT_CORRECTIONS = registry.Registry("rollout correction")
"""Levels of the rollout importance weights (`rollout_is`) and rejection (`rollout_rs`)
-> `fn(log_ratio_bt, mask_bt) -> f32[B, T]`, the log-ratio each token is weighted by
from the masked per-token ones; "none" -> None (off). Filled below `rollout_log_ratio`."""
LOG_RATIO_CLAMP = 20.0
"""Every log-ratio is clamped to +-this before exp, as verl does: the PPO ratio's
(`compute_policy_loss`), the k3 KL's (`kl_penalty`) and the rollout correction's
(`rollout_corr_helper`)."""
GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's log sequence ratio is clamped above at this (verl `compute_policy_loss_gspo`)."""


@dataclasses.dataclass(frozen=True)
class LossConfig:
  """Actor-loss options; the defaults are verl-agent's (docs/algorithms.md §9)."""

  clip_ratio_low: float = 0.2
  """eps_low: the ratio is clipped below at 1 - eps_low."""
  clip_ratio_high: float = 0.2
  """eps_high: the ratio is clipped above at 1 + eps_high."""
  clip_ratio_c: float = 3.0
  """Dual-clip constant c (> 1): for A < 0 the token loss is capped at -A * c."""
  entropy_coeff: float = 0.001
  """Weight of the entropy bonus (subtracted from the loss)."""
  use_kl_loss: bool = True
  """Add kl_coef * KL(pi || pi_ref) (k3 estimator) to the loss."""
  kl_coef: float = 0.01
  """Weight of the KL loss; 0 turns it off as `use_kl_loss=False` does (`kl_in_loss`)."""
  loss_agg: str = "token-mean"
  """How token losses are reduced to a scalar: one of LOSS_AGG_MODES."""
  norm_length: Optional[int] = None
  """Divisor of `seq-mean-token-sum-norm` (the max response length); None: the token
  axis length T of the batch, which is constant only if the bucket is."""
  policy_loss: str = "ppo"
  """A name of POLICY_LOSSES: "ppo" (token ratios, dual clip) or "gspo" (one ratio per row,
  the geometric mean of its token ratios; no dual clip)."""
  kl_estimator: str = "k3"
  """The KL loss's per-token estimator, a name or alias of KL_ESTIMATORS (verl
  `kl_loss_type`)."""
  rollout_is: str = "none"
  """One of ROLLOUT_CORRECTIONS: importance weights pi_old / pi_rollout per token, or per
  row (the product of its token ratios), truncated at `rollout_is_threshold`."""
  rollout_is_threshold: float = 2.0
  """Upper truncation of the rollout importance weights (verl `rollout_is_threshold`)."""
  rollout_rs: str = "none"
  """One of ROLLOUT_CORRECTIONS: tokens (or rows) whose weight pi_old / pi_rollout lies
  outside [1 / rollout_rs_threshold, rollout_rs_threshold] add nothing to the
  policy-gradient loss."""
  rollout_rs_threshold: float = 2.0
  """Rejection bound t > 1 of `rollout_rs`."""

  @property
  def kl_in_loss(self) -> bool:
    """Whether the loss has its KL term (and reads the reference's log-probs):
    `use_kl_loss` with a nonzero `kl_coef`. At `kl_coef=0` the term would add exact zeros
    to the loss and its gradient, so it is left out, with the `kl` metric."""
    return self.use_kl_loss and self.kl_coef != 0

  def __post_init__(self):
    if self.loss_agg not in LOSS_AGG_MODES:
      raise ValueError(f"loss_agg={self.loss_agg!r} is unknown; use one of {LOSS_AGG_MODES}.")
    if self.kl_estimator == "full":
      raise ValueError("kl_estimator='full' needs the reference's whole distribution at every "
                       "token, which the reference pass does not keep (verl's kl_penalty raises "
                       f"NotImplementedError for it too); use one of {KL_ESTIMATORS.names()}.")
    for name, names in (("policy_loss", POLICY_LOSSES), ("kl_estimator", KL_ESTIMATORS),
                        ("rollout_is", ROLLOUT_CORRECTIONS), ("rollout_rs", ROLLOUT_CORRECTIONS)):
      try:
        names.get(getattr(self, name))
      except KeyError as e:
        raise ValueError(f"{name}={getattr(self, name)!r}: {e.args[0]}") from None
    if not self.rollout_is_threshold > 0:
      raise ValueError(f"rollout_is_threshold={self.rollout_is_threshold} must be > 0.")
    if not self.rollout_rs_threshold > 1:
      raise ValueError(f"rollout_rs_threshold={self.rollout_rs_threshold} must be > 1 "
                       "(tokens are kept in [1/t, t]).")
    if self.clip_ratio_c <= 1.0:
      raise ValueError(f"clip_ratio_c={self.clip_ratio_c} must be > 1 (dual clip caps the loss at -A*c).")
    if not (0.0 <= self.clip_ratio_low < 1.0 and self.clip_ratio_high >= 0.0):
      raise ValueError(f"clip ratios (low={self.clip_ratio_low}, high={self.clip_ratio_high}) must satisfy 0 <= low < 1, high >= 0.")


def aggregate(x_bt: jax.Array, mask_bt: jax.Array, mode: str, norm_length: Optional[int] = None) -> jax.Array:
  """Reduces per-token values f32[B, T] to a scalar with a verl aggregation mode.

  Args:
    x_bt: f32[B, T] per-token values.
    mask_bt: bool[B, T] tokens that count.
    mode: one of LOSS_AGG_MODES (module docstring).
    norm_length: divisor of `seq-mean-token-sum-norm`; None means T.

  Returns:
    f32[] the aggregate; 0 when the mask is empty.
  """
  mask_bt = mask_bt.astype(bool)
  x_bt = jnp.where(mask_bt, x_bt, 0.0)
  tokens_b = jnp.sum(mask_bt, axis=-1)
  if mode == "token-mean":
    return jnp.sum(x_bt) / jnp.maximum(jnp.sum(tokens_b), 1)
  if mode == "seq-mean-token-sum-norm":
    return jnp.sum(x_bt) / float(norm_length or x_bt.shape[-1])
  rows_b = tokens_b > 0
  n_rows = jnp.maximum(jnp.sum(rows_b), 1)
  if mode == "seq-mean-token-sum":
    return jnp.sum(jnp.sum(x_bt, axis=-1)) / n_rows
  if mode == "seq-mean-token-mean":
    row_mean_b = jnp.sum(x_bt, axis=-1) / jnp.maximum(tokens_b, 1)
    return jnp.sum(jnp.where(rows_b, row_mean_b, 0.0)) / n_rows
  raise ValueError(f"loss_agg_mode={mode!r} is unknown; use one of {LOSS_AGG_MODES}.")


def ppo_clip_token_losses(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_bt: jax.Array,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-token PPO-clip loss with dual clip (docs/algorithms.md §9).

  Args:
    logp_bt: f32[B, T] log pi_theta of the taken tokens.
    old_logp_bt: f32[B, T] log pi_old of the same tokens (behaviour policy).
    adv_bt: f32[B, T] advantages.
    clip_ratio_low, clip_ratio_high: eps_low, eps_high.
    clip_ratio_c: dual-clip constant c.

  Returns:
    (loss_bt, clipped_bt, dual_clipped_bt): f32[B, T] token losses; bool[B, T] where
    the clipped surrogate was chosen (L2 > L1, verl's `pg_clipfrac`); bool[B, T] where
    the dual clip capped the loss (A < 0 and -A c < Lc, verl's `pg_clipfrac_lower`).
  """
  # Clamp the log-ratio as verl does, so exp cannot overflow on garbage tokens.
  ratio_bt = jnp.exp(jnp.clip(logp_bt - old_logp_bt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  l1_bt = -adv_bt * ratio_bt
  l2_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
  lc_bt = jnp.maximum(l1_bt, l2_bt)
  l3_bt = -adv_bt * clip_ratio_c
  negative_bt = adv_bt < 0
  loss_bt = jnp.where(negative_bt, jnp.minimum(lc_bt, l3_bt), lc_bt)
  return loss_bt, l2_bt > l1_bt, negative_bt & (l3_bt < lc_bt)


def low_var_kl(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
  """k3 estimator of KL(pi_theta || pi_ref) per token, clamped to [-10, 10].

  KL_j = exp(d_j) - d_j - 1 with d_j = clamp(ref_j - logp_j, -20, 20) (Schulman's k3; verl
  `low_var_kl`). The clamp before the exponential changes no value (|d| > 20 gives a KL
  past the outer clamp either way) but keeps the gradient finite: unclamped, a d above
  ~88.7 overflows exp in float32 and the outer clamp's zero gradient times inf is NaN. A
  slot that is not scored carries a zero-filled reference log-prob, so a peaked model's
  log-prob of -100 on a padding token would otherwise poison the whole step's gradient.

  Args:
    logp_bt: f32[B, T] log pi_theta.
    ref_logp_bt: f32[B, T] log pi_ref.

  Returns:
    f32[B, T], >= 0 up to the clamp.
  """
  log_ratio_bt = jnp.clip(ref_logp_bt - logp_bt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  kl_bt = jnp.exp(log_ratio_bt) - log_ratio_bt - 1.0
  return jnp.clip(kl_bt, -KL_CLAMP, KL_CLAMP)


def kl_penalty(logp_bt: jax.Array, ref_logp_bt: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi_theta || pi_ref) by name (verl `kl_penalty`).

    k1 = logp - ref ;  abs = |logp - ref| ;  k2 = (logp - ref)^2 / 2 ;  k3 = `low_var_kl`

  Args:
    logp_bt, ref_logp_bt: f32[B, T] log pi_theta and log pi_ref of the taken tokens.
    estimator: a name or alias of KL_ESTIMATORS (KeyError naming them otherwise).

  Returns:
    f32[B, T].
  """
  return KL_ESTIMATORS.get(estimator)(logp_bt, ref_logp_bt)


def k1_kl(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
  """k1 = logp - ref per token (verl "kl")."""
  return logp_bt - ref_logp_bt


def abs_kl(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
  """|logp - ref| per token (verl "abs")."""
  return jnp.abs(logp_bt - ref_logp_bt)


def k2_kl(logp_bt: jax.Array, ref_logp_bt: jax.Array) -> jax.Array:
  """k2 = (logp - ref)^2 / 2 per token (verl "mse")."""
  return 0.5 * jnp.square(logp_bt - ref_logp_bt)


KL_ESTIMATORS.register("k1", k1_kl, aliases=("kl",))
KL_ESTIMATORS.register("abs", abs_kl)
KL_ESTIMATORS.register("k2", k2_kl, aliases=("mse",))
KL_ESTIMATORS.register("k3", low_var_kl, aliases=("low_var_kl",))


def row_mean(x_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  """f32[B]: the mean of each row's scored entries (0 for a row without any)."""
  return jnp.sum(jnp.where(mask_bt, x_bt, 0.0), axis=-1) / jnp.maximum(jnp.sum(mask_bt, axis=-1), 1)


def gspo_token_losses(logp_bt: jax.Array, old_logp_bt: jax.Array, adv_bt: jax.Array,
                      mask_bt: jax.Array, clip_ratio_low: float, clip_ratio_high: float
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-token GSPO loss (arXiv 2507.18071 Eq. 7; verl `compute_policy_loss_gspo`).

    log s_b = mean_{t in row b} (logp - old)            (the length-normalised ratio)
    log s_bt = logp_bt - sg(logp_bt) + sg(log s_b)       (value s_b, gradient of logp_bt)
    L_bt = max(-A s_bt, -A clip(s_bt, 1 - eps_low, 1 + eps_high))

  Returns:
    (loss_bt, clipped_bt, zeros): as `ppo_clip_token_losses` (GSPO has no dual clip).
  """
  seq_b = row_mean(logp_bt - old_logp_bt, mask_bt)
  log_ratio_bt = logp_bt - jax.lax.stop_gradient(logp_bt) + jax.lax.stop_gradient(seq_b)[:, None]
  ratio_bt = jnp.exp(jnp.minimum(log_ratio_bt, GSPO_LOG_RATIO_MAX))
  l1_bt = -adv_bt * ratio_bt
  l2_bt = -adv_bt * jnp.clip(ratio_bt, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
  return jnp.maximum(l1_bt, l2_bt), l2_bt > l1_bt, jnp.zeros_like(mask_bt)


def _ppo_policy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, config: "LossConfig"):
  del mask_bt  # token ratios: every token stands alone
  return ppo_clip_token_losses(logp_bt, old_logp_bt, adv_bt, config.clip_ratio_low,
                               config.clip_ratio_high, config.clip_ratio_c)


def _gspo_policy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, config: "LossConfig"):
  return gspo_token_losses(logp_bt, old_logp_bt, adv_bt, mask_bt, config.clip_ratio_low,
                           config.clip_ratio_high)


POLICY_LOSSES.register("ppo", _ppo_policy_loss)
POLICY_LOSSES.register("gspo", _gspo_policy_loss)


def rollout_log_ratio(old_logp_bt: jax.Array, rollout_logp_bt: jax.Array, mask_bt: jax.Array,
                      level: str) -> jax.Array:
  """f32[B, T] log(pi_old / pi_rollout), clamped to +-LOG_RATIO_CLAMP, per token ("token")
  or the row's sum over its scored tokens on each of them ("sequence"); `level` a name of
  ROLLOUT_CORRECTIONS other than "none"."""
  log_ratio_bt = jnp.where(mask_bt, old_logp_bt - rollout_logp_bt, 0.0)
  log_ratio_bt = ROLLOUT_CORRECTIONS.get(level)(log_ratio_bt, mask_bt)
  return jnp.clip(log_ratio_bt, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _token_log_ratio(log_ratio_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  del mask_bt  # already zero off the scored tokens
  return log_ratio_bt


def _sequence_log_ratio(log_ratio_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
  del mask_bt  # already zero off the scored tokens
  return jnp.broadcast_to(jnp.sum(log_ratio_bt, axis=-1, keepdims=True), log_ratio_bt.shape)


ROLLOUT_CORRECTIONS.register("none", None)
ROLLOUT_CORRECTIONS.register("token", _token_log_ratio)
ROLLOUT_CORRECTIONS.register("sequence", _sequence_log_ratio)


def rollout_correction(old_logp_bt: jax.Array, rollout_logp_bt: jax.Array, mask_bt: jax.Array,
                       config: "LossConfig") -> tuple[jax.Array, jax.Array]:
  """Detached weights of the policy-gradient token losses for the sampler/learner mismatch
  (verl `rollout_corr_helper`: truncated importance sampling and rejection).

    w = min(exp(log pi_old - log pi_rollout), rollout_is_threshold)   (token or row level)
    keep = 1/t <= exp(log ratio) <= t                                  (rollout_rs, t its threshold)

  Returns:
    (weight_bt f32[B, T]: w * keep (1 where an option is "none"), kept_bt bool[B, T]).
  """
  old_logp_bt = jax.lax.stop_gradient(old_logp_bt)
  weight_bt = jnp.ones_like(old_logp_bt)
  kept_bt = jnp.ones(old_logp_bt.shape, bool)
  if config.rollout_is != "none":
    log_ratio_bt = rollout_log_ratio(old_logp_bt, rollout_logp_bt, mask_bt, config.rollout_is)
    weight_bt = jnp.minimum(jnp.exp(log_ratio_bt), config.rollout_is_threshold)
  if config.rollout_rs != "none":
    log_ratio_bt = rollout_log_ratio(old_logp_bt, rollout_logp_bt, mask_bt, config.rollout_rs)
    bound = math.log(config.rollout_rs_threshold)
    kept_bt = jnp.abs(log_ratio_bt) <= bound
    weight_bt = jnp.where(kept_bt, weight_bt, 0.0)
  return weight_bt, kept_bt


def entropy_from_logits(logits_btv: jax.Array) -> jax.Array:
  """Entropy of the full softmax per position: H = logsumexp(z) - sum(softmax(z) z).

  Args:
    logits_btv: f32[B, T, V].

  Returns:
    f32[B, T].
  """
  logits_btv = logits_btv.astype(jnp.float32)
  lse_bt = jax.nn.logsumexp(logits_btv, axis=-1)
  probs_btv = jax.nn.softmax(logits_btv, axis=-1)
  return lse_bt - jnp.sum(probs_btv * logits_btv, axis=-1)


def _combined_actor_loss(logp_bt, entropy_bt, old_logp_bt, ref_logp_bt, adv_bt, config: LossConfig,
                         agg, token_mean, mask_bt, rollout_logp_bt=None
                         ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """agg(L_pg) - entropy_coeff agg(H) + kl_coef agg(KL) and the metrics, for any reduction:
  `agg` is the loss's (the configured mode), `token_mean` the clip-fraction and approx-KL
  metrics' (verl: token means); `mask_bt` the scored tokens (GSPO's and the sequence
  weights' rows); `rollout_logp_bt` the sampler's log-probs (read with `rollout_is` or
  `rollout_rs` only)."""
  tok_loss_bt, clipped_bt, dual_bt = POLICY_LOSSES.get(config.policy_loss)(
      logp_bt, old_logp_bt, adv_bt, mask_bt, config)
  corrected = config.rollout_is != "none" or config.rollout_rs != "none"
  if corrected:
    weight_bt, kept_bt = rollout_correction(old_logp_bt, rollout_logp_bt, mask_bt, config)
    tok_loss_bt = tok_loss_bt * weight_bt
  pg_loss = agg(tok_loss_bt)
  entropy = agg(entropy_bt)
  loss = pg_loss - config.entropy_coeff * entropy
  metrics = {
      "pg_loss": pg_loss,
      "entropy": entropy,
      "pg_clipfrac": token_mean(clipped_bt.astype(jnp.float32)),
      "pg_clipfrac_lower": token_mean(dual_bt.astype(jnp.float32)),
      # verl's `ppo_kl`: mean of (old - new) log-prob over scored tokens.
      "approx_kl": token_mean(old_logp_bt - logp_bt),
  }
  if corrected:
    metrics["rollout_is_weight"] = token_mean(weight_bt)
    metrics["rollout_rs_kept"] = token_mean(kept_bt.astype(jnp.float32))
  if config.kl_in_loss:
    kl = agg(kl_penalty(logp_bt, ref_logp_bt, config.kl_estimator))
    loss = loss + config.kl_coef * kl
    metrics["kl"] = kl
  metrics["loss"] = loss
  return loss, metrics


def actor_loss(
    logp_bt: jax.Array,
    entropy_bt: jax.Array,
    old_logp_bt: jax.Array,
    ref_logp_bt: jax.Array,
    adv_bt: jax.Array,
    mask_bt: jax.Array,
    config: LossConfig,
    rollout_logp_bt: Optional[jax.Array] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """The combined actor loss: agg(L_pg) - entropy_coeff agg(H) + kl_coef agg(KL).

  Args:
    logp_bt: f32[B, T] log pi_theta of the taken tokens.
    entropy_bt: f32[B, T] entropy of pi_theta at the position that predicts the token.
    old_logp_bt: f32[B, T] behaviour log-probs.
    ref_logp_bt: f32[B, T] reference-policy log-probs (read only if config.kl_in_loss).
    adv_bt: f32[B, T] advantages.
    mask_bt: bool[B, T] scored (response) tokens.
    config: LossConfig.
    rollout_logp_bt: f32[B, T] the sampler's log-probs (needed by `rollout_is`/`rollout_rs`).

  Returns:
    (loss, metrics): f32[] loss and f32[] metrics, each aggregated as token means
    (`pg_loss`, `entropy`, `kl` use the configured mode, as the loss does; `kl` only
    with `config.kl_in_loss`;
    `pg_clipfrac`, `pg_clipfrac_lower`, `approx_kl` are token means as in verl).
  """
  mode, norm = config.loss_agg, config.norm_length
  return _combined_actor_loss(
      logp_bt, entropy_bt, old_logp_bt, ref_logp_bt, adv_bt, config,
      agg=lambda x_bt: aggregate(x_bt, mask_bt, mode, norm),
      token_mean=lambda x_bt: aggregate(x_bt, mask_bt, "token-mean"), mask_bt=mask_bt,
      rollout_logp_bt=rollout_logp_bt)


def weighted_actor_loss(
    logp_bt: jax.Array,
    entropy_bt: jax.Array,
    old_logp_bt: jax.Array,
    ref_logp_bt: jax.Array,
    adv_bt: jax.Array,
    weights_bt: jax.Array,
    config: LossConfig,
    rollout_logp_bt: Optional[jax.Array] = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`actor_loss` with every aggregate a weighted token sum `sum(w * x)`.

  With the weights of `packing.token_mean_weights` the sum over a mini-batch's packed
  micro-batches of this loss (and of each metric) equals the unpacked update's mean over
  micro-batches of `actor_loss` under `token-mean`; the caller sums, it does not average.

  Args:
    weights_bt: f32[B, T] weight of each token (0 where not scored).
    The others: as `actor_loss`.
  """
  if config.loss_agg != "token-mean":
    raise ValueError(f"weighted (packed) actor loss is defined for loss_agg='token-mean', "
                     f"got {config.loss_agg!r}")
  total = lambda x_bt: jnp.sum(jnp.where(weights_bt > 0, x_bt, 0.0) * weights_bt)
  return _combined_actor_loss(logp_bt, entropy_bt, old_logp_bt, ref_logp_bt, adv_bt, config,
                              agg=total, token_mean=total, mask_bt=weights_bt > 0,
                              rollout_logp_bt=rollout_logp_bt)


def value_loss(values_bt: jax.Array, old_values_bt: jax.Array, returns_bt: jax.Array,
               mask_bt: jax.Array, cliprange_value: float = 0.5, loss_scale: float = 1.0,
               loss_agg_mode: str = "token-mean") -> tuple[jax.Array, jax.Array]:
  """Clipped value loss of verl's critic (docs/algorithms.md §9, critic loss).

    V_clip = clip(V, V_old - c, V_old + c)
    vf_loss = loss_scale * agg(max((V - R)^2, (V_clip - R)^2))
    vf_clipfrac = token-mean of [(V_clip - R)^2 > (V - R)^2]

  The released `compute_value_loss` (verl/trainer/ppo/core_algos.py in zzj1111/alfworldauto
  and in JonP07/HiPER-agent) is `agg_loss` of the clipped squared error with no factor:
  loss_scale 1 (0.5 is the older verl's `0.5 * masked_mean(...)`).

  Args:
    values_bt: f32[...] current critic values V.
    old_values_bt: f32[...] values of the critic that produced the targets (V_old).
    returns_bt: f32[...] value targets R.
    mask_bt: bool[...] entries that count (tokens, or read-out positions).
    cliprange_value: c.
    loss_scale: multiplier of the aggregate.
    loss_agg_mode: one of LOSS_AGG_MODES (the last axis is the token axis).

  Returns:
    (vf_loss f32[], vf_clipfrac f32[]).
  """
  loss_bt, clipped_bt = _clipped_value_errors(values_bt, old_values_bt, returns_bt,
                                              cliprange_value)
  loss = loss_scale * aggregate(loss_bt, mask_bt, loss_agg_mode)
  clipfrac = aggregate(clipped_bt.astype(jnp.float32), mask_bt, "token-mean")
  return loss, clipfrac


def _clipped_value_errors(values, old_values, returns, cliprange_value: float):
  """(max((V - R)^2, (V_clip - R)^2), [(V_clip - R)^2 > (V - R)^2]) per entry."""
  clipped = jnp.clip(values, old_values - cliprange_value, old_values + cliprange_value)
  l1 = jnp.square(values - returns)
  l2 = jnp.square(clipped - returns)
  return jnp.maximum(l1, l2), l2 > l1


def multi_head_value_loss(values_blh: jax.Array, old_values_blh: jax.Array,
                          returns_blh: jax.Array, mask_blh: jax.Array,
                          cliprange_value: float = 0.5, loss_scale: float = 1.0,
                          loss_agg_mode: str = "token-mean",
                          weights_blh: Optional[jax.Array] = None) -> tuple[jax.Array, jax.Array]:
  """The value loss of a critic with H heads: the sum over heads of each head's `value_loss`.

    vf_loss = loss_scale * sum_h agg_h(max((V_h - R_h)^2, (V_h,clip - R_h)^2))

  HiPER-agent's `dp_critic.py` adds its low, high and term heads' `compute_value_loss`
  (`total_vf`, coefficients 1.0), a head without targets in the micro-batch adding 0; PPO
  has one head (`value_loss`).

  Args:
    values_blh, old_values_blh, returns_blh: f32[B, L, H] V, V_old and R per head.
    mask_blh: bool[B, L, H] scored (column, head) entries.
    weights_blh: None, or f32[B, L, H] token weights of `train_batch.unit_weights` (a loss
      unit other than the micro-batch, token-mean): the loss is `sum(w * error)`, this
      micro-batch's share.
    The others: as `value_loss`.

  Returns:
    (vf_loss f32[], vf_clipfrac f32[]): the clip fraction is the token mean over every
    scored entry (with weights: the weighted mean over heads of the heads' fractions).
  """
  loss_blh, clipped_blh = _clipped_value_errors(values_blh, old_values_blh, returns_blh,
                                                cliprange_value)
  clipped_blh = clipped_blh.astype(jnp.float32)
  if weights_blh is not None:
    total = lambda x: jnp.sum(jnp.where(weights_blh > 0, x, 0.0) * weights_blh)
    return loss_scale * total(loss_blh), total(clipped_blh) / values_blh.shape[-1]
  heads = range(values_blh.shape[-1])
  loss = sum(aggregate(loss_blh[..., h], mask_blh[..., h], loss_agg_mode) for h in heads)
  flat = lambda a: a.reshape(a.shape[0], -1)
  return loss_scale * loss, aggregate(flat(clipped_blh), flat(mask_blh), "token-mean")


MISMATCH_QUANTILES = (0.05, 0.5, 0.95)
"""Quantiles of the token ratio pi_old / pi_rollout that `mismatch_metrics` reports."""


def mismatch_metrics(learner_logp_bt, rollout_logp_bt, mask_bt, threshold: float) -> dict[str, float]:
  """How far the learner's log-probs are from the sampler's on the same tokens (host,
  numpy): verl's `compute_offpolicy_metrics` and the truncation fractions of
  `compute_is_metrics`, with r = pi_learner / pi_rollout per token:

    kl = mean(log pi_rollout - log pi_learner)        (k1 of KL(pi_rollout || pi_learner))
    k3_kl = mean(r - 1 - log r) ;  chi2_token = mean(r^2) - 1
    ratio_q<q>: the q-quantile of r ;  ratio_fraction_high / _low: tokens with r above
    `threshold` / below 1 / threshold (truncated, or rejected, at that threshold)
    seq_ratio_fraction_high: rows whose product of r is above `threshold`

  Args:
    learner_logp_bt, rollout_logp_bt: f32[B, T] log-probs of the taken tokens.
    mask_bt: bool[B, T] scored tokens.
    threshold: the rollout correction's truncation (`LossConfig.rollout_is_threshold`).

  Returns:
    {name: value} without prefix; {} when no token is scored.
  """
  mask_bt = np.asarray(mask_bt, bool)
  if not mask_bt.any():
    return {}
  log_ratio_bt = (np.asarray(learner_logp_bt, np.float64)
                  - np.asarray(rollout_logp_bt, np.float64))
  log_ratio = log_ratio_bt[mask_bt]
  ratio = np.exp(np.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  rows = mask_bt.any(axis=-1)
  seq_log_ratio = np.where(mask_bt, log_ratio_bt, 0.0).sum(axis=-1)[rows]
  out = {
      "log_ratio_mean": float(log_ratio.mean()),
      "kl": float(-log_ratio.mean()),
      "k3_kl": float(np.mean(ratio - 1.0 - log_ratio)),
      "chi2_token": float(np.mean(ratio ** 2) - 1.0),
      "ratio_fraction_high": float(np.mean(ratio > threshold)),
      "ratio_fraction_low": float(np.mean(ratio < 1.0 / threshold)),
      "seq_ratio_fraction_high": float(np.mean(seq_log_ratio > math.log(threshold))),
  }
  for q, value in zip(MISMATCH_QUANTILES, np.quantile(ratio, MISMATCH_QUANTILES)):
    out[f"ratio_q{int(round(q * 100)):02d}"] = float(value)
  return out


def kl_reward_penalty(old_logp_bt, ref_logp_bt, mask_bt, estimator: str
                      ) -> tuple[np.ndarray, float]:
  """The KL in the reward of B rows (host, numpy; verl `apply_kl_penalty`): each row's
  penalty is its tokens' sum of `kl_penalty(old, ref, estimator)` (a step row's reward is
  the sum of its tokens' rewards), and the batch KL the controller reads is the mean over
  rows of their token means (rows without a scored token count 0).

  Returns:
    (f64[B] KL summed over each row's scored tokens, the batch KL).
  """
  mask_bt = np.asarray(mask_bt, bool)
  kl_bt = np.where(mask_bt, np.asarray(kl_penalty(jnp.asarray(old_logp_bt), jnp.asarray(ref_logp_bt),
                                                  estimator), np.float64), 0.0)
  sums_b = kl_bt.sum(axis=-1)
  return sums_b, float(np.mean(sums_b / np.maximum(mask_bt.sum(axis=-1), 1)))


KL_CONTROLLERS = ("fixed", "adaptive")
"""Values of `train.kl_ctrl` (verl `algorithm.kl_ctrl.type`)."""


@dataclasses.dataclass
class KLController:
  """The coefficient beta of the KL in the reward (verl `FixedKLController`,
  `AdaptiveKLController` of Ziegler et al. arXiv 1909.08593):

    adaptive: beta <- beta * (1 + clip(KL / target_kl - 1, -0.2, 0.2) * n_steps / horizon)
  """

  value: float
  kind: str = "fixed"
  target_kl: float = 0.1
  horizon: int = 10000

  def __post_init__(self):
    if self.kind not in KL_CONTROLLERS:
      raise ValueError(f"kl_ctrl={self.kind!r} is unknown; use one of {KL_CONTROLLERS}")
    if self.kind == "adaptive" and not (self.horizon > 0 and self.target_kl > 0):
      raise ValueError(f"kl_ctrl='adaptive' needs kl_horizon > 0 and kl_target > 0, got "
                       f"{self.horizon} and {self.target_kl}")
    if self.value < 0:
      raise ValueError(f"kl_reward_coef={self.value} must be >= 0")

  def update(self, current_kl: float, n_steps: int) -> None:
    """One batch of `n_steps` rows whose mean KL was `current_kl`."""
    if self.kind == "adaptive":
      error = float(np.clip(current_kl / self.target_kl - 1.0, -0.2, 0.2))
      self.value *= 1.0 + error * n_steps / self.horizon
