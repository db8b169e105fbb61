"""Metrics of the bias study on inputs whose answers are known."""

import numpy as np
import pytest

from hgpo_jax.analysis import metrics


def test_step_errors_of_the_oracle_itself_and_of_a_rescaled_oracle_are_zero():
  rng = np.random.default_rng(0)
  key = rng.integers(0, 50, 2000)
  a_star = rng.normal(size=50)[key]
  for adv in (a_star, 3.0 * a_star):
    m = metrics.step_errors(adv, a_star, key)
    assert m["mse"] == pytest.approx(0.0, abs=1e-12)
    assert m["bias2"] == pytest.approx(0.0, abs=1e-12)
    assert m["sign"] == 1.0
  assert metrics.step_errors(3.0 * a_star, a_star, key)["scale"] == pytest.approx(1 / 3)


def test_step_errors_split_a_constant_offset_from_noise():
  """adv = A* + b_key + noise, noise sd 0.5 and offsets b_key with mean 0, sd 1 over
  keys. With scale ~1 the bias^2 is ~ mean b^2 and the variance ~ 0.25 (both divided
  by Var(A*)); 200 rows per key make the s^2/n correction small and the sampling
  error of each estimate ~ 0.25 * sqrt(2 / 199) / sqrt(40) < 0.01 (4 sigma < 0.04)."""
  rng = np.random.default_rng(1)
  keys = np.repeat(np.arange(40), 200)
  a_star = np.where(keys % 2 == 0, 2.0, -2.0)
  offset = rng.normal(0, 1, 40)
  offset -= offset.mean()
  adv = a_star + offset[keys] + rng.normal(0, 0.5, len(keys))
  m = metrics.step_errors(adv, a_star, keys)
  c = m["scale"]
  var_a = a_star.var()
  expected_bias = np.mean(((c - 1) * a_star + c * offset[keys])**2) / var_a
  assert m["bias2"] == pytest.approx(expected_bias, abs=0.04)
  assert m["var"] == pytest.approx(c**2 * 0.25 / var_a, abs=0.04)
  assert m["mse"] == pytest.approx(m["bias2"] + m["var"], rel=1e-12)


def test_unbiased_noisy_estimator_has_no_bias_and_unit_scale():
  """adv = A* + noise of sd 3 (Var(A*) = 4): the Monte Carlo-like estimator is unbiased,
  so the fitted scale is ~1 and bias^2 ~ 0 while the variance is ~9/4. 100 rows per key
  and 40 keys: the scale's standard error is ~ 3 / (2 sqrt(4000)) < 0.03 (tolerance
  0.1), bias^2 ~ (c - 1)^2 + sampling noise of the s^2/n correction (tolerance 0.05)."""
  rng = np.random.default_rng(3)
  keys = np.repeat(np.arange(40), 100)
  a_star = np.where(keys % 2 == 0, 2.0, -2.0)
  adv = a_star + rng.normal(0, 3.0, len(keys))
  m = metrics.step_errors(adv, a_star, keys)
  assert m["scale"] == pytest.approx(1.0, abs=0.1)
  assert m["bias2"] == pytest.approx(0.0, abs=0.05)
  assert m["var"] == pytest.approx(m["scale"]**2 * 9 / 4, rel=0.1)


def test_inconsistency_by_hand():
  """Level 0: groups {0,1,2} with V = 1, 2, 3 (within var 2/3) and {3} alone;
  level 1: {0,1} with V = 1, 2 (within var 1/4), rows 2-3 absent. Var(A*) = 2."""
  ctx = np.array([[0, 0, 0, 1], [0, 0, -1, -1]])
  value = np.array([1.0, 2.0, 3.0, 10.0])
  ci, alone = metrics.inconsistency(ctx, value, 2.0)
  np.testing.assert_allclose(ci, [(2 / 3) / 2, 0.25 / 2])
  np.testing.assert_allclose(alone, [0.25, 0.5])


def test_gradient_cosine_by_hand():
  """Two contexts, pi uniform. Batch 0: one row in context 0, action 1, adv 2 ->
  g_0 = 2 (e_1 - 1/4) = [-.5, 1.5, -.5, -.5] in context 0. With g* = that same vector
  the cosine is 1; batch 1 scores -1 times it, cosine -1; an all-zero batch gives 0."""
  probs = np.full((2, 4), 0.25)
  g_star = np.zeros((2, 4))
  g_star[0] = [-0.5, 1.5, -0.5, -0.5]
  cos = metrics.gradient_cosines(np.array([2.0, -2.0, 0.0]), np.array([0, 1, 2]),
                                 np.array([0, 0, 1]), np.array([1, 1, 3]), probs, g_star, 3)
  np.testing.assert_allclose(cos, [1.0, -1.0, 0.0], atol=1e-12)
  # Two rows of one batch in different contexts: g = [g0 ; 1 * (e_3 - 1/4)] in ctx 1.
  cos = metrics.gradient_cosines(np.array([2.0, 1.0]), np.array([0, 0]), np.array([0, 1]),
                                 np.array([1, 3]), probs, g_star, 1)
  g1 = np.array([-0.25, -0.25, -0.25, 0.75])
  expected = g_star[0] @ g_star[0] / (np.sqrt(g_star[0] @ g_star[0] + g1 @ g1)
                                      * np.linalg.norm(g_star))
  np.testing.assert_allclose(cos, [expected], rtol=1e-12)


def test_paired_mean_and_standard_error():
  m, se = metrics.paired(np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.0, 0.0, 0.0, 0.0]))
  assert m == 2.5
  assert se == pytest.approx(np.std([1, 2, 3, 4], ddof=1) / 2)
