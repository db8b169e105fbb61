"""Actor-loss tests: the docs/algorithms.md §11.6 micro-examples and numpy references for every mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hgpo_jax.training import losses


def test_ppo_dual_clip_micro_example():
  # docs/algorithms.md §11.6: (A, rho) = (+1, 1.3), (-1, 0.7), (-1, 5.0).
  adv = jnp.array([[1.0, -1.0, -1.0]])
  logp = jnp.log(jnp.array([[1.3, 0.7, 5.0]]))
  old = jnp.zeros_like(logp)
  tok, clipped, dual = losses.ppo_clip_token_losses(logp, old, adv, 0.2, 0.2, 3.0)
  np.testing.assert_allclose(tok, [[-1.2, 0.8, 3.0]], rtol=1e-6)
  np.testing.assert_array_equal(clipped, [[True, True, False]])
  np.testing.assert_array_equal(dual, [[False, False, True]])
  mean = losses.aggregate(tok, jnp.ones_like(tok, bool), "token-mean")
  np.testing.assert_allclose(mean, 0.866667, rtol=1e-6)


def test_low_var_kl_micro_example_and_clamp():
  kl = losses.low_var_kl(jnp.array([-1.0, 0.0, 30.0]), jnp.array([-1.2, 0.0, 0.0]))
  np.testing.assert_allclose(kl[0], 0.018731, rtol=1e-4)
  assert kl[1] == 0.0
  assert kl[2] == losses.KL_CLAMP  # exp(-30) + 30 - 1 = 29 -> clamped to 10


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("estimator", ["k3", "k1", "abs", "k2"])
def test_kl_gradient_is_finite_with_planted_logprobs_on_unscored_slots(estimator, mode):
  """A peaked model's log-prob of -1e4 on a slot that is not scored, whose reference
  log-prob is zero-filled, leaves the gradient finite and equal to the unplanted one
  (unclamped, k3's exp(ref - logp) overflows there and 0 x inf is NaN)."""
  rng = np.random.default_rng(3)
  shape = (4, 7)
  mask = rng.random(shape) < 0.6
  mask[2] = False  # an all-padding row
  logp = -rng.random(shape).astype(np.float32) * 3
  old = logp + rng.normal(size=shape).astype(np.float32) * 0.3
  ref = logp + rng.normal(size=shape).astype(np.float32) * 0.3
  adv = rng.normal(size=shape).astype(np.float32)
  ent = rng.random(shape).astype(np.float32)
  planted = np.where(mask, logp, -1e4).astype(np.float32)
  zero_filled = lambda x: jnp.asarray(np.where(mask, x, 0.0), jnp.float32)  # noqa: E731
  cfg = losses.LossConfig(kl_estimator=estimator, loss_agg=mode)
  m = jnp.asarray(mask)

  def grad(lp):
    f = lambda x: losses.actor_loss(x, ent, zero_filled(old), zero_filled(ref), adv, m, cfg)[0]  # noqa: E731
    return np.asarray(jax.grad(f)(jnp.asarray(lp)))

  got, want = grad(planted), grad(logp)
  assert np.all(np.isfinite(got))
  np.testing.assert_array_equal(got, want)
  assert np.all(got[~mask] == 0) and np.any(got[mask] != 0)
  if mode == "token-mean":  # the packed (weighted) loss reads the same slots
    w = jnp.asarray(mask / mask.sum(), jnp.float32)
    f = lambda x: losses.weighted_actor_loss(x, ent, zero_filled(old), zero_filled(ref), adv, w, cfg)[0]  # noqa: E731
    g = np.asarray(jax.grad(f)(jnp.asarray(planted)))
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, want, rtol=1e-5, atol=1e-8)


def test_low_var_kl_clamps_the_log_ratio_before_exp():
  """verl clamps ref - logp to +-20 before exp: no value changes (both ends are past the
  outer clamp), and the gradient at a log-ratio of 1e4 is 0, not NaN."""
  ref = jnp.array([0.0, 0.0, -25.0, 0.0])
  logp = jnp.array([-1e4, -25.0, 0.0, -0.5])
  kl = losses.low_var_kl(logp, ref)
  np.testing.assert_array_equal(kl[:3], [losses.KL_CLAMP] * 3)
  np.testing.assert_allclose(kl[3], np.exp(0.5) - 0.5 - 1.0, rtol=1e-6)
  g = jax.grad(lambda x: jnp.sum(losses.low_var_kl(x, ref)))(logp)
  np.testing.assert_array_equal(g[:3], [0.0, 0.0, 0.0])
  np.testing.assert_allclose(g[3], 1.0 - np.exp(0.5), rtol=1e-6)  # d/dlogp of e^(-logp) + logp - 1


def test_entropy_from_logits_matches_numpy():
  z = np.random.default_rng(0).normal(size=(2, 3, 7)).astype(np.float32) * 3
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  ref = -(p * np.log(p)).sum(-1)
  np.testing.assert_allclose(losses.entropy_from_logits(jnp.asarray(z)), ref, rtol=1e-5, atol=1e-6)
  uniform = losses.entropy_from_logits(jnp.zeros((1, 1, 5)))
  np.testing.assert_allclose(uniform, np.log(5.0), rtol=1e-6)


def _np_aggregate(x, m, mode, norm=None):
  """Plain-loop reference of verl's `agg_loss` (rows without tokens skipped)."""
  rows = [(x[b][m[b]]) for b in range(x.shape[0])]
  if mode == "token-mean":
    return sum(r.sum() for r in rows) / max(sum(len(r) for r in rows), 1)
  if mode == "seq-mean-token-sum-norm":
    return sum(r.sum() for r in rows) / (norm or x.shape[1])
  rows = [r for r in rows if len(r)]
  if mode == "seq-mean-token-sum":
    return np.mean([r.sum() for r in rows])
  if mode == "seq-mean-token-mean":
    return np.mean([r.mean() for r in rows])
  raise AssertionError(mode)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_aggregate_matches_numpy(mode):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(5, 9)).astype(np.float64)
  m = rng.random((5, 9)) < 0.6
  m[3] = False  # an all-padding row
  x[~m] = np.nan  # masked values must not leak
  got = losses.aggregate(jnp.asarray(x, jnp.float32), jnp.asarray(m), mode, norm_length=12 if "norm" in mode else None)
  want = _np_aggregate(np.nan_to_num(x), m, mode, 12)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_aggregate_empty_mask_is_zero():
  for mode in losses.LOSS_AGG_MODES:
    assert float(losses.aggregate(jnp.ones((2, 3)), jnp.zeros((2, 3), bool), mode)) == 0.0


def test_actor_loss_combines_terms_and_grads_are_finite():
  rng = np.random.default_rng(2)
  shape = (3, 6)
  logp = jnp.asarray(-rng.random(shape) * 3, jnp.float32)
  old = logp + jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
  ref = logp + jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
  adv = jnp.asarray(rng.normal(size=shape), jnp.float32)
  ent = jnp.asarray(rng.random(shape), jnp.float32)
  mask = jnp.asarray(rng.random(shape) < 0.7)
  cfg = losses.LossConfig()
  loss, met = losses.actor_loss(logp, ent, old, ref, adv, mask, cfg)
  tok, _, _ = losses.ppo_clip_token_losses(logp, old, adv)
  kl = losses.low_var_kl(logp, ref)
  m = np.asarray(mask)
  want = (np.asarray(tok)[m].mean() - 0.001 * np.asarray(ent)[m].mean() + 0.01 * np.asarray(kl)[m].mean())
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  np.testing.assert_allclose(met["approx_kl"], (np.asarray(old) - np.asarray(logp))[m].mean(), rtol=1e-5)
  g = jax.grad(lambda lp: losses.actor_loss(lp, ent, old, ref, adv, mask, cfg)[0])(logp)
  assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[~m] == 0)
  no_kl, met2 = losses.actor_loss(logp, ent, old, ref, adv, mask, losses.LossConfig(use_kl_loss=False))
  assert "kl" not in met2
  np.testing.assert_allclose(loss - no_kl, 0.01 * np.asarray(kl)[m].mean(), rtol=1e-4)


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_kl_coef_zero_leaves_out_the_kl_term_and_changes_no_bit(mode, monkeypatch):
  """kl_coef=0 is the KL loss off (`LossConfig.kl_in_loss`): the reference log-probs are
  not read and there is no `kl` metric; the loss, its gradient and every other metric are
  bitwise those of the term at weight 0 (the rule before: a term whenever `use_kl_loss`)."""
  rng = np.random.default_rng(5)
  shape = (3, 6)
  logp = jnp.asarray(-rng.random(shape) * 3, jnp.float32)
  old = logp + jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
  ref = logp + jnp.asarray(rng.normal(size=shape) * 0.3, jnp.float32)
  adv = jnp.asarray(rng.normal(size=shape), jnp.float32)
  ent = jnp.asarray(rng.random(shape), jnp.float32)
  mask = jnp.asarray(rng.random(shape) < 0.7)
  cfg = losses.LossConfig(kl_coef=0.0, loss_agg=mode, norm_length=6)
  assert not cfg.kl_in_loss and losses.LossConfig(kl_coef=1e-3).kl_in_loss
  assert not losses.LossConfig(use_kl_loss=False, kl_coef=0.5).kl_in_loss

  def loss_and_grad(ref_bt):
    fn = lambda lp: losses.actor_loss(lp, ent, old, ref_bt, adv, mask, cfg)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(logp)

  (loss, metrics), grad = loss_and_grad(ref)
  (loss_no_ref, _), grad_no_ref = loss_and_grad(jnp.full(shape, jnp.nan))  # not read
  assert "kl" not in metrics and loss_no_ref == loss
  np.testing.assert_array_equal(grad_no_ref, grad)
  with monkeypatch.context() as m:
    m.setattr(losses.LossConfig, "kl_in_loss", property(lambda self: self.use_kl_loss))
    (before, before_metrics), before_grad = loss_and_grad(ref)
  assert before_metrics.pop("kl") > 0
  assert np.asarray(before).tobytes() == np.asarray(loss).tobytes()
  assert np.asarray(before_grad).tobytes() == np.asarray(grad).tobytes()
  assert {k: float(v) for k, v in before_metrics.items()} == {k: float(v) for k, v in metrics.items()}


def test_loss_config_rejects_bad_values():
  with pytest.raises(ValueError, match="loss_agg"):
    losses.LossConfig(loss_agg="token-sum")
  with pytest.raises(ValueError, match="clip_ratio_c"):
    losses.LossConfig(clip_ratio_c=1.0)
