"""The loss options beyond verl-agent's defaults equal readable transcriptions of verl.

Each reference below transcribes a released verl function in torch (CPU, float64):
  * `kl_penalty`: verl/trainer/ppo/core_algos.py `kl_penalty` (k1 "kl", "abs", k2 "mse",
    k3 "low_var_kl"; "full" raises NotImplementedError there).
  * `gspo`: core_algos.py `compute_policy_loss_gspo` with `agg_loss` (the aggregation mode
    a parameter, as in verl main; the release beside verl-agent fixes seq-mean-token-mean).
  * `vanilla`: core_algos.py `compute_policy_loss` (dual clip), its token losses times
    `rollout_is_weights` as verl main's `compute_policy_loss_vanilla` does.
  * `is_weights`, `rs_mask`: verl/trainer/ppo/rollout_corr_helper.py
    `compute_rollout_correction_weights` and `compute_rollout_rejection_mask`.
  * `lr_lambda`: verl/utils/torch_functional.py `get_constant_schedule_with_warmup` and
    `get_cosine_schedule_with_warmup` (num_cycles 0.5), through torch's LambdaLR.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hgpo_jax.training import losses
from hgpo_jax.training import train_step


# ------------------------------------------------------------------ verl transcriptions
def _masked_mean(x, mask, axis=None):
  return (x * mask).sum() / mask.sum() if axis is None else (x * mask).sum(axis) / mask.sum(axis)


def agg_loss(loss_mat, loss_mask, mode, norm):
  if mode == "token-mean":
    return _masked_mean(loss_mat, loss_mask)
  if mode == "seq-mean-token-sum":
    return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1))
  if mode == "seq-mean-token-mean":
    return torch.mean(torch.sum(loss_mat * loss_mask, dim=-1) / torch.sum(loss_mask, dim=-1))
  if mode == "seq-mean-token-sum-norm":
    return torch.sum(loss_mat * loss_mask) / norm
  raise AssertionError(mode)


def kl_penalty(logprob, ref_logprob, name):
  if name in ("kl", "k1"):
    return logprob - ref_logprob
  if name == "abs":
    return (logprob - ref_logprob).abs()
  if name in ("mse", "k2"):
    return 0.5 * (logprob - ref_logprob).square()
  if name in ("low_var_kl", "k3"):
    kl = ref_logprob - logprob
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
  raise NotImplementedError(name)


def gspo(old_log_prob, log_prob, advantages, mask, low, high, mode, norm):
  negative_approx_kl = log_prob - old_log_prob
  seq_lengths = torch.sum(mask, dim=-1).clamp(min=1)
  negative_approx_kl_seq = torch.sum(negative_approx_kl * mask, dim=-1) / seq_lengths
  log_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
  ratio = torch.exp(torch.clamp(log_ratio, max=10.0))
  pg_losses1 = -advantages * ratio
  pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
  pg_losses = torch.maximum(pg_losses1, pg_losses2)
  clipfrac = _masked_mean(torch.gt(pg_losses2, pg_losses1).double(), mask)
  return agg_loss(pg_losses, mask, mode, norm), clipfrac


def vanilla(old_log_prob, log_prob, advantages, mask, low, high, c, mode, norm, weights=None):
  ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
  pg_losses1 = -advantages * ratio
  pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
  clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
  pg_losses3 = -advantages * c
  clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
  pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
  if weights is not None:
    pg_losses = pg_losses * weights
  return agg_loss(pg_losses, mask, mode, norm)


def is_weights(old_log_prob, rollout_log_prob, mask, level, threshold):
  log_ratio = old_log_prob - rollout_log_prob
  if level == "token":
    w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
  else:
    log_ratio_sum = torch.sum(log_ratio * mask, dim=-1).unsqueeze(-1)
    w = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
  return (w * mask).clamp(max=threshold)


def rs_mask(old_log_prob, rollout_log_prob, mask, level, threshold):
  log_ratio = old_log_prob - rollout_log_prob
  if level == "token":
    w = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
  else:
    log_ratio_sum = torch.sum(log_ratio * mask, dim=-1).unsqueeze(-1)
    w = torch.exp(torch.clamp(log_ratio_sum, min=-20.0, max=20.0)).expand_as(log_ratio)
  return ((w >= 1.0 / threshold) & (w <= threshold)).double()


class AdaptiveKLController:
  """verl core_algos.AdaptiveKLController."""

  def __init__(self, init_kl_coef, target_kl, horizon):
    self.value = init_kl_coef
    self.target = target_kl
    self.horizon = horizon

  def update(self, current_kl, n_steps):
    proportional_error = np.clip(current_kl / self.target - 1, -0.2, 0.2)
    self.value *= 1 + proportional_error * n_steps / self.horizon


def apply_kl_penalty(token_level_scores, old_log_probs, ref_log_prob, response_mask, beta, name):
  """verl `apply_kl_penalty` (the ray trainer's): token rewards and the batch KL."""
  kld = kl_penalty(old_log_probs, ref_log_prob, name) * response_mask
  token_level_rewards = token_level_scores - beta * kld
  current_kl = torch.mean(_masked_mean(kld, response_mask, axis=-1), dim=0).item()
  return token_level_rewards, current_kl


def lr_lambda(style, warmup, total, min_lr_ratio):
  def constant(step):
    return min(1, float(step) / float(max(1, warmup)))

  def cosine(step):
    if step < warmup:
      return min_lr_ratio + (1.0 - min_lr_ratio) * (float(step) / float(max(1, warmup)))
    progress = float(step - warmup) / float(max(1, total - warmup))
    x = math.cos(math.pi * 0.5 * 2.0 * progress)
    return max(min_lr_ratio, x * (1 - min_lr_ratio) * 0.5 + (1 + min_lr_ratio) * 0.5)
  return constant if style == "constant" else cosine


# ------------------------------------------------------------------ inputs
def _inputs(seed=0, shape=(4, 7), scale=0.3):
  rng = np.random.default_rng(seed)
  logp = -rng.random(shape) * 3
  old = logp + rng.normal(size=shape) * scale
  ref = logp + rng.normal(size=shape) * scale
  rollout = old + rng.normal(size=shape) * scale
  adv = rng.normal(size=shape)
  mask = rng.random(shape) < 0.7
  mask[:, 0] = True  # every row scores a token (verl's agg_loss counts every row)
  return logp, old, ref, rollout, adv, mask


def _t(x):
  return torch.tensor(np.asarray(x, np.float64))


def _j(x):
  return jnp.asarray(np.asarray(x, np.float32))


# ------------------------------------------------------------------ tests
@pytest.mark.parametrize("name", ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"])
def test_kl_estimators_equal_verl_kl_penalty(name):
  logp, _, ref, _, _, _ = _inputs(1, scale=2.0)
  got = losses.kl_penalty(_j(logp), _j(ref), name)
  np.testing.assert_allclose(got, kl_penalty(_t(logp), _t(ref), name).numpy(), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3"])
def test_kl_loss_term_is_the_aggregated_estimator(mode, name):
  logp, old, ref, _, adv, mask = _inputs(2)
  config = losses.LossConfig(kl_estimator=name, loss_agg=mode, entropy_coeff=0.0, kl_coef=0.5)
  _, metrics = losses.actor_loss(_j(logp), _j(np.zeros_like(logp)), _j(old), _j(ref), _j(adv),
                                 jnp.asarray(mask), config)
  want = agg_loss(kl_penalty(_t(logp), _t(ref), name), _t(mask), mode, logp.shape[1])
  np.testing.assert_allclose(metrics["kl"], want.item(), rtol=2e-5, atol=1e-6)
  want_pg = vanilla(_t(old), _t(logp), _t(adv), _t(mask), 0.2, 0.2, 3.0, mode, logp.shape[1])
  np.testing.assert_allclose(metrics["loss"], want_pg.item() + 0.5 * want.item(), rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_gspo_loss_and_gradient_equal_verl(mode):
  logp, old, _, _, adv, mask = _inputs(3, scale=0.002)
  low, high = 3e-4, 4e-4
  config = losses.LossConfig(policy_loss="gspo", clip_ratio_low=low, clip_ratio_high=high,
                             loss_agg=mode, entropy_coeff=0.0, use_kl_loss=False)

  def ours(lp):
    return losses.actor_loss(lp, jnp.zeros_like(lp), _j(old), _j(old), _j(adv),
                             jnp.asarray(mask), config)
  (loss, metrics), grad = jax.value_and_grad(ours, has_aux=True)(_j(logp))
  lp_t = _t(logp).requires_grad_(True)
  want, clipfrac = gspo(_t(old), lp_t, _t(adv), _t(mask), low, high, mode, logp.shape[1])
  want.backward()
  np.testing.assert_allclose(loss, want.item(), rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(grad, lp_t.grad.numpy(), rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(metrics["pg_clipfrac"], clipfrac.item(), rtol=1e-6)
  assert 0.0 < float(metrics["pg_clipfrac"]) < 1.0  # the inputs clip some rows, not all
  assert float(metrics["pg_clipfrac_lower"]) == 0.0


def test_gspo_ratio_is_one_per_row_and_differs_from_ppo():
  logp, old, _, _, adv, mask = _inputs(4, scale=0.1)
  kwargs = dict(clip_ratio_low=0.9, clip_ratio_high=10.0, entropy_coeff=0.0,
                use_kl_loss=False)
  gspo_loss, _ = losses.actor_loss(_j(logp), _j(logp * 0), _j(old), _j(old), _j(adv),
                                   jnp.asarray(mask), losses.LossConfig(policy_loss="gspo", **kwargs))
  ppo_loss, _ = losses.actor_loss(_j(logp), _j(logp * 0), _j(old), _j(old), _j(adv),
                                  jnp.asarray(mask), losses.LossConfig(**kwargs))
  # unclipped: GSPO's token-mean loss is -mean(A * s_row), s_row = exp(mean log ratio)
  s_b = np.exp(((logp - old) * mask).sum(-1) / mask.sum(-1))
  want = -(adv * s_b[:, None] * mask).sum() / mask.sum()
  np.testing.assert_allclose(gspo_loss, want, rtol=1e-5)
  assert abs(float(gspo_loss) - float(ppo_loss)) > 1e-3


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_importance_weights_equal_verl(level, mode):
  logp, old, ref, rollout, adv, mask = _inputs(5, scale=0.3)
  threshold = 1.2
  config = losses.LossConfig(rollout_is=level, rollout_is_threshold=threshold, loss_agg=mode,
                             entropy_coeff=0.0, use_kl_loss=False)
  weight, kept = losses.rollout_correction(_j(old), _j(rollout), jnp.asarray(mask), config)
  want_w = is_weights(_t(old), _t(rollout), _t(mask), level, threshold).numpy()
  np.testing.assert_allclose(np.where(mask, weight, 0.0), want_w, rtol=1e-5, atol=1e-6)
  assert bool(jnp.all(kept))
  assert 0.0 < np.mean(want_w[mask] == threshold) < 1.0  # some weights truncated, not all
  loss, metrics = losses.actor_loss(_j(logp), _j(logp * 0), _j(old), _j(ref), _j(adv),
                                    jnp.asarray(mask), config, _j(rollout))
  want = vanilla(_t(old), _t(logp), _t(adv), _t(mask), 0.2, 0.2, 3.0, mode, logp.shape[1],
                 weights=_t(want_w))
  np.testing.assert_allclose(loss, want.item(), rtol=2e-5, atol=1e-6)
  np.testing.assert_allclose(metrics["rollout_is_weight"], want_w[mask].mean(), rtol=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_rejection_equals_verl_mask(level):
  _, old, _, rollout, _, mask = _inputs(6, scale=0.3)
  config = losses.LossConfig(rollout_rs=level, rollout_rs_threshold=1.3)
  weight, kept = losses.rollout_correction(_j(old), _j(rollout), jnp.asarray(mask), config)
  want = rs_mask(_t(old), _t(rollout), _t(mask), level, 1.3).numpy().astype(bool)
  np.testing.assert_array_equal(np.asarray(kept)[mask], want[mask])
  assert 0 < want[mask].sum() < mask.sum()  # some rejected, some kept
  np.testing.assert_array_equal(np.asarray(weight)[mask], want[mask].astype(np.float32))


def test_weighted_loss_with_the_new_options_equals_token_mean():
  logp, old, ref, rollout, adv, mask = _inputs(7)
  config = losses.LossConfig(policy_loss="gspo", rollout_is="sequence", kl_estimator="k2",
                             rollout_rs="token", rollout_rs_threshold=1.5)
  args = (_j(logp), _j(-logp), _j(old), _j(ref), _j(adv))
  plain, m_plain = losses.actor_loss(*args, jnp.asarray(mask), config, _j(rollout))
  weights = _j(mask / mask.sum())
  weighted, m_weighted = losses.weighted_actor_loss(*args, weights, config, _j(rollout))
  np.testing.assert_allclose(weighted, plain, rtol=1e-5)
  for key in m_plain:
    np.testing.assert_allclose(m_weighted[key], m_plain[key], rtol=1e-5, atol=1e-7, err_msg=key)


@pytest.mark.parametrize("style,warmup,ratio,min_lr", [
    ("constant", 3, 0.0, 0.0), ("cosine", 2, 0.0, 0.1), ("cosine", -1, 0.25, 0.0),
    ("cosine", 0, 0.0, 0.3)])
def test_learning_rate_schedules_equal_verl_lambda_lr(style, warmup, ratio, min_lr):
  total = 12
  config = train_step.UpdateConfig(lr=1e-3, lr_schedule=style, warmup_steps=warmup,
                                   warmup_ratio=ratio, min_lr_ratio=min_lr, total_iterations=total)
  w = warmup if warmup >= 0 else int(ratio * total)
  opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(style, w, total, min_lr))
  want = []
  for _ in range(total):
    want.append(opt.param_groups[0]["lr"])
    opt.step()
    sched.step()
  got = [train_step.iteration_learning_rate(config, i) for i in range(total)]
  np.testing.assert_allclose(got, want, rtol=1e-12)
  assert len(set(np.round(got, 12))) > 2  # the rate moves


def test_scheduled_optimizer_takes_the_iteration_rate():
  config = train_step.UpdateConfig(lr=0.1, lr_schedule="cosine", total_iterations=4,
                                   weight_decay=0.0)
  assert config.scheduled and not train_step.UpdateConfig().scheduled
  tx = train_step.make_optimizer(config)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  clip_state, adamw_state = state
  lr = train_step.iteration_learning_rate(config, 2)  # 0.05 on a half cosine of 4
  np.testing.assert_allclose(lr, 0.05, rtol=1e-12)
  hp = dict(adamw_state.hyperparams, learning_rate=jnp.asarray(lr, jnp.float32))
  state = (clip_state, adamw_state._replace(hyperparams=hp))
  updates, _ = tx.update({"w": jnp.full(3, 0.5)}, state, params)
  # Adam's first step is lr * sign(g) (bias-corrected m / sqrt(v) = 1)
  np.testing.assert_allclose(updates["w"], -lr * np.ones(3), rtol=1e-5)


@pytest.mark.parametrize("kwargs,match", [
    (dict(policy_loss="grpo"), "policy_loss='grpo'"),
    (dict(kl_estimator="k4"), "kl_estimator='k4'"),
    (dict(kl_estimator="full"), "kl_estimator='full'"),
    (dict(rollout_is="seq"), "rollout_is='seq'"),
    (dict(rollout_rs="geo"), "rollout_rs='geo'"),
    (dict(rollout_is_threshold=-1.0), "rollout_is_threshold=-1.0"),
    (dict(rollout_rs_threshold=0.5), "rollout_rs_threshold=0.5"),
])
def test_bad_loss_options_name_the_flag(kwargs, match):
  with pytest.raises(ValueError, match=match):
    losses.LossConfig(**kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr_schedule="linear"), "lr_schedule='linear'"),
    (dict(warmup_ratio=-0.1), "warmup_ratio=-0.1"),
    (dict(min_lr_ratio=1.5, total_iterations=3), "min_lr_ratio=1.5"),
    (dict(warmup_steps=2, warmup_ratio=0.1, total_iterations=3), "warmup_steps=2"),
    (dict(lr_schedule="cosine"), "total_iterations"),
])
def test_bad_schedules_name_the_flag(kwargs, match):
  with pytest.raises(ValueError, match=match):
    train_step.UpdateConfig(**kwargs)


@pytest.mark.parametrize("name", ["k1", "abs", "k2", "k3"])
def test_kl_in_the_reward_equals_verl_apply_kl_penalty(name):
  _, old, ref, _, _, mask = _inputs(8, scale=0.4)
  scores = np.zeros_like(old)
  scores[:, -1] = 1.0  # an outcome reward on the last token
  rewards, want_kl = apply_kl_penalty(_t(scores), _t(old), _t(ref), _t(mask), 0.05, name)
  penalty_b, got_kl = losses.kl_reward_penalty(old, ref, mask, name)
  # a step row's reward is the sum of its token rewards
  np.testing.assert_allclose(scores.sum(-1) - 0.05 * penalty_b, rewards.sum(-1).numpy(), rtol=1e-5)
  np.testing.assert_allclose(got_kl, want_kl, rtol=1e-5)


@pytest.mark.parametrize("kl", [0.0, 0.09, 0.5])
def test_kl_controllers_equal_verl(kl):
  ours, theirs = losses.KLController(0.01, "adaptive", 0.1, 1000), AdaptiveKLController(0.01, 0.1, 1000)
  for n in (64, 128, 32):
    ours.update(kl, n)
    theirs.update(kl, n)
    assert ours.value == pytest.approx(theirs.value, rel=1e-12)
  assert ours.value != 0.01
  fixed = losses.KLController(0.01)
  fixed.update(kl, 64)
  assert fixed.value == 0.01
