"""HGPO's variance-aware level weights (weights="inverse_variance"): a hand derivation
on the golden batch of docs/algorithms.md and the option's error messages.
(Golden values of every row: tests/advantages/test_golden.py; kernel == float64
reference on random rollouts: tests/advantages/test_reference_equivalence.py.)"""

import sys
import os

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "advantages"))
import advantage_cases  # noqa: E402  (shared golden batch of the advantage tests)
from hgpo_jax.advantages import registry  # noqa: E402


def test_row_17_by_hand():
  """Row 17 (group g2, trajectory t6, step 1, anchor Q), norm="mean", nu = 2.
  Level 0, anchor Q in g2: rows 11, 17, 18 with returns 8.925 (9.025 - 0.1, invalid),
  0, 0: mean 2.975, SS_0 = 5.95^2 + 2 * 2.975^2 = 53.10375, s_0^2 = SS_0 / 2.
  Level 1, key (P, Q): rows 11 and 17, returns 8.925, 0: mean 4.4625,
  SS_1 = 2 * 4.4625^2 = 39.8278125. Level 2: row 17 has one predecessor only.
  Items: a_0 = -2.975, a_1 = -4.4625.
  w_0 = 3 / ((SS_0 + 2 s_0^2) / (3 - 1 + 2)),  w_1 = 2 / ((SS_1 + 2 s_0^2) / (2 - 1 + 2)).
  A = (w_0 a_0 + w_1 a_1) / (w_0 + w_1) = -3.515909..."""
  ss0, ss1 = 5.95**2 + 2 * 2.975**2, 2 * 4.4625**2
  s0 = ss0 / 2
  w0 = 3 / ((ss0 + 2 * s0) / 4)
  w1 = 2 / ((ss1 + 2 * s0) / 3)
  expected = (w0 * -2.975 + w1 * -4.4625) / (w0 + w1)
  assert expected == pytest.approx(-3.515909, abs=1e-6)
  est = registry.get("hgpo")
  adv = advantage_cases.kernel_advantages(
      advantage_cases.golden_rows(), "hgpo", est.options(k=2, norm="mean",
                                                         weights="inverse_variance"),
      num_levels=3, capacity=32)
  # float32 kernel on returns ~10: a few ulps of 10 through two divisions.
  assert adv[17] == pytest.approx(expected, rel=1e-5)
  # The recipe weights (2 : 3) give a different value on the same row: -3.867499.
  recipe = advantage_cases.kernel_advantages(
      advantage_cases.golden_rows(), "hgpo", est.options(k=2, norm="mean"), num_levels=3,
      capacity=32)
  assert recipe[17] == pytest.approx(-3.867499, abs=1e-5)


def test_a_stronger_prior_moves_the_weights_toward_group_size():
  """nu -> infinity: every level's variance becomes s_0^2, so w_k -> n_k / s_0^2 and
  row 17 becomes (3 a_0 + 2 a_1) / 5 = -3.57."""
  est = registry.get("hgpo")
  adv = advantage_cases.kernel_advantages(
      advantage_cases.golden_rows(), "hgpo",
      est.options(k=2, norm="mean", weights="inverse_variance", variance_prior=1e6),
      num_levels=3, capacity=32)
  assert adv[17] == pytest.approx((3 * -2.975 + 2 * -4.4625) / 5, abs=1e-4)


def test_option_errors_are_one_line():
  est = registry.get("hgpo")
  with pytest.raises(ValueError, match="no weight for the base_group"):
    est.options(weights="inverse_variance", base_group=True)
  with pytest.raises(ValueError, match="variance_prior"):
    est.options(weights="inverse_variance", variance_prior=0.0)
  with pytest.raises(ValueError, match="is not one of"):
    est.options(weights="precision")


def test_golden_zeros_stay_exact():
  """Rows whose every level group has equal returns get exactly 0, as with the recipe."""
  est = registry.get("hgpo")
  adv = advantage_cases.kernel_advantages(
      advantage_cases.golden_rows(), "hgpo", est.options(weights="inverse_variance"),
      num_levels=3, capacity=32)
  assert np.all(adv[[2, 4, 6, 13, 15]] == 0.0)
