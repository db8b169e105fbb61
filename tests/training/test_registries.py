"""The trainer's registries (`hgpo_jax.registry`): policy losses, KL estimators and rollout
corrections (`losses`), learning-rate schedules (`train_step`).

Each registered entry computes what the code dispatched to before the registries, bit for
bit; each config error lists the registry's names; a toy policy loss registered by a
fixture is all a new loss needs (config validation, the loss, its gradient).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hgpo_jax.training import experiment
from hgpo_jax.training import losses
from hgpo_jax.training import train_step


def _inputs(seed=0, shape=(3, 6)):
  rng = np.random.default_rng(seed)
  f = lambda scale=1.0: jnp.asarray(rng.normal(size=shape).astype(np.float32) * scale)
  logp = -jnp.abs(f(2.0))
  mask = jnp.asarray(rng.random(shape) < 0.7).at[:, 0].set(True)
  return dict(logp=logp, old=logp + f(0.3), ref=logp + f(0.3), rollout=logp + f(0.3),
              adv=f(), entropy=jnp.abs(f()), mask=mask)


def _loss(config, x, logp=None):
  return losses.actor_loss(x["logp"] if logp is None else logp, x["entropy"], x["old"],
                           x["ref"], x["adv"], x["mask"], config, rollout_logp_bt=x["rollout"])


# ------------------------------------------------------------------ names
def test_the_registered_names():
  assert losses.POLICY_LOSSES.names() == ["gspo", "ppo"]
  assert losses.KL_ESTIMATORS.names() == ["abs", "k1", "k2", "k3"]
  assert [losses.KL_ESTIMATORS.canonical(a) for a in ("kl", "mse", "low_var_kl")] == [
      "k1", "k2", "k3"]
  assert losses.ROLLOUT_CORRECTIONS.names() == ["none", "sequence", "token"]
  assert train_step.LR_SCHEDULES.names() == ["constant", "cosine"]


@pytest.mark.parametrize("registry,bad", [
    (losses.POLICY_LOSSES, "dpo"), (losses.KL_ESTIMATORS, "full"),
    (losses.ROLLOUT_CORRECTIONS, "seq"), (train_step.LR_SCHEDULES, "linear")])
def test_an_unknown_name_lists_the_registered_ones(registry, bad):
  with pytest.raises(KeyError) as info:
    registry.get(bad)
  message = info.value.args[0]
  assert message.startswith(f"unknown {registry.kind} {bad!r}; registered: {registry.names()}")
  assert "\n" not in message


@pytest.mark.parametrize("field,bad,registry", [
    ("policy_loss", "grpo", losses.POLICY_LOSSES),
    ("kl_estimator", "k4", losses.KL_ESTIMATORS),
    ("rollout_is", "seq", losses.ROLLOUT_CORRECTIONS),
    ("rollout_rs", "geo", losses.ROLLOUT_CORRECTIONS)])
def test_loss_config_errors_list_the_registry(field, bad, registry):
  with pytest.raises(ValueError) as info:
    losses.LossConfig(**{field: bad})
  assert str(info.value).startswith(f"{field}={bad!r}: unknown {registry.kind} {bad!r}; "
                                    f"registered: {registry.names()}")


def test_the_schedule_error_lists_the_registry():
  with pytest.raises(ValueError) as info:
    train_step.UpdateConfig(lr_schedule="linear")
  assert str(info.value) == ("lr_schedule='linear': unknown learning rate schedule 'linear'; "
                             "registered: ['constant', 'cosine']")


def _config(algo="grpo", **overrides):
  from configs import sokoban
  c = sokoban.get_config(f"algo={algo},smoke")
  with c.unlocked():
    c.update_from_flattened_dict(overrides)
  return c


@pytest.mark.parametrize("key,bad,registry", [
    ("train.policy_loss", "dpo", losses.POLICY_LOSSES),
    ("train.kl_estimator", "k5", losses.KL_ESTIMATORS),
    ("train.rollout_is", "row", losses.ROLLOUT_CORRECTIONS),
    ("train.lr_schedule", "step", train_step.LR_SCHEDULES),
    ("critic.lr_schedule", "step", train_step.LR_SCHEDULES)])
def test_config_errors_list_the_registry_in_one_line(key, bad, registry):
  from hgpo_jax import train
  algo = "ppo" if key.startswith("critic.") else "grpo"  # a critic's own schedule
  with pytest.raises(train.ConfigError) as info:
    experiment.from_config(_config(algo, **{key: bad}))
  message = str(info.value)
  assert message.startswith(f"config.{key.split('.')[0]}: {key.split('.')[1]}={bad!r}: ")
  assert f"registered: {registry.names()}" in message and "\n" not in message


def test_the_kl_reward_estimator_error_lists_the_registry():
  from hgpo_jax import train
  with pytest.raises(train.ConfigError) as info:
    experiment.from_config(_config(**{"train.kl_in_reward": True,
                                      "train.kl_reward_estimator": "full"}))
  assert str(info.value) == (
      "config.train.kl_reward_estimator='full': unknown KL estimator 'full'; registered: "
      "['abs', 'k1', 'k2', 'k3'] (aliases: kl = k1, low_var_kl = k3, mse = k2)")


# ------------------------------------------------------------------ entries
def test_the_kl_estimators_are_the_formulas_with_k3_clamped():
  x = _inputs(1)
  logp, ref = x["logp"], x["ref"]
  d = logp - ref
  np.testing.assert_array_equal(losses.kl_penalty(logp, ref, "kl"), d)
  np.testing.assert_array_equal(losses.kl_penalty(logp, ref, "abs"), jnp.abs(d))
  np.testing.assert_array_equal(losses.kl_penalty(logp, ref, "mse"), 0.5 * jnp.square(d))
  assert losses.KL_ESTIMATORS.get("low_var_kl") is losses.low_var_kl
  # k3's two clamps: the log-ratio to +-20 before exp (a finite gradient at d = 200), the KL
  # to 10 after
  k3 = lambda lp: losses.kl_penalty(lp, jnp.array([0.0, -40.0, -1.2]), "k3")
  logp = jnp.array([-200.0, 0.0, -1.0])
  kl = k3(logp)
  assert kl[0] == kl[1] == losses.KL_CLAMP
  np.testing.assert_allclose(kl[2], np.exp(-0.2) + 0.2 - 1.0, rtol=1e-5)
  grad = jax.grad(lambda lp: k3(lp).sum())(logp)
  assert np.isfinite(grad).all() and grad[0] == grad[1] == 0.0


def test_kl_penalty_of_an_unknown_estimator_names_the_registry():
  with pytest.raises(KeyError, match=r"unknown KL estimator 'full'; registered: \['abs'"):
    losses.kl_penalty(jnp.zeros(2), jnp.zeros(2), "full")


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_the_registered_policy_losses_are_the_token_loss_functions(mode):
  """pg_loss and the clip fractions of `actor_loss` through the registry equal the token-loss
  functions aggregated by hand, bit for bit."""
  x = _inputs(2)
  for name in ("ppo", "gspo"):
    config = losses.LossConfig(policy_loss=name, loss_agg=mode, clip_ratio_low=0.1,
                               clip_ratio_high=0.15, clip_ratio_c=2.5)
    if name == "ppo":
      tok, clipped, dual = losses.ppo_clip_token_losses(x["logp"], x["old"], x["adv"], 0.1, 0.15,
                                                        2.5)
    else:
      tok, clipped, dual = losses.gspo_token_losses(x["logp"], x["old"], x["adv"], x["mask"],
                                                    0.1, 0.15)
    _, metrics = _loss(config, x)
    np.testing.assert_array_equal(metrics["pg_loss"], losses.aggregate(tok, x["mask"], mode))
    for key, flag in (("pg_clipfrac", clipped), ("pg_clipfrac_lower", dual)):
      np.testing.assert_array_equal(
          metrics[key], losses.aggregate(flag.astype(jnp.float32), x["mask"], "token-mean"))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_rollout_correction_levels(level):
  x = _inputs(3)
  diff = jnp.where(x["mask"], x["old"] - x["rollout"], 0.0)
  want = diff if level == "token" else jnp.broadcast_to(diff.sum(-1, keepdims=True), diff.shape)
  got = losses.rollout_log_ratio(x["old"], x["rollout"], x["mask"], level)
  np.testing.assert_array_equal(got, jnp.clip(want, -losses.LOG_RATIO_CLAMP,
                                              losses.LOG_RATIO_CLAMP))
  assert losses.ROLLOUT_CORRECTIONS.get("none") is None  # off: no weights, no metrics
  _, metrics = _loss(losses.LossConfig(), x)
  assert "rollout_is_weight" not in metrics


@pytest.mark.parametrize("iteration", range(7))
def test_the_schedules_are_verl_formulas(iteration):
  w, n, m, lr = 2, 6, 0.1, 1e-5
  config = train_step.UpdateConfig(lr=lr, warmup_steps=w, min_lr_ratio=m, total_iterations=n)
  assert train_step.iteration_learning_rate(config, iteration) == lr * min(1.0, iteration / w)
  config = dataclasses.replace(config, lr_schedule="cosine")
  got = train_step.iteration_learning_rate(config, iteration)
  if iteration < w:
    assert got == lr * (m + (1.0 - m) * iteration / w)
  else:
    cos = np.cos(np.pi * (iteration - w) / (n - w))
    np.testing.assert_allclose(got, lr * max(m, 0.5 * (1 + m) + 0.5 * (1 - m) * cos), rtol=1e-14)


# ------------------------------------------------------------------ adding a policy loss
def _toy_loss(logp_bt, old_logp_bt, adv_bt, mask_bt, config):
  """The unclipped importance-weighted policy gradient: -A exp(logp - old)."""
  del mask_bt, config
  loss_bt = -adv_bt * jnp.exp(logp_bt - old_logp_bt)
  no_bt = jnp.zeros(loss_bt.shape, bool)
  return loss_bt, no_bt, no_bt


@pytest.fixture
def toy_loss():
  losses.POLICY_LOSSES.register("toy", _toy_loss)
  yield "toy"
  losses.POLICY_LOSSES.unregister("toy")
  assert "toy" not in losses.POLICY_LOSSES


def test_an_unregistered_loss_is_refused():
  with pytest.raises(ValueError, match=r"policy_loss='toy': unknown policy loss 'toy'; "
                                       r"registered: \['gspo', 'ppo'\]"):
    losses.LossConfig(policy_loss="toy")


def test_a_registered_loss_runs_through_config_loss_and_gradient(toy_loss):
  exp = experiment.from_config(_config(**{"train.policy_loss": toy_loss}))
  assert exp.train.update.loss.policy_loss == "toy"
  x = _inputs(4)
  config = losses.LossConfig(policy_loss=toy_loss, entropy_coeff=0.0, use_kl_loss=False)
  (loss, metrics), grad = jax.value_and_grad(lambda lp: _loss(config, x, lp), has_aux=True)(
      x["logp"])
  ratio = jnp.exp(x["logp"] - x["old"])
  tokens = x["mask"].sum()
  np.testing.assert_allclose(loss, jnp.where(x["mask"], -x["adv"] * ratio, 0.0).sum() / tokens,
                             rtol=1e-6)
  np.testing.assert_allclose(grad, jnp.where(x["mask"], -x["adv"] * ratio, 0.0) / tokens,
                             rtol=1e-5, atol=1e-8)
  assert metrics["pg_clipfrac"] == 0.0
