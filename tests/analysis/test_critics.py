"""Critic-based estimators on the exact testbed (hgpo_jax/analysis/critics.py)."""

import numpy as np
import pytest

from hgpo_jax.analysis import critics
from hgpo_jax.analysis import sampling
from hgpo_jax.analysis import testbed

GAMMA = 0.95


@pytest.fixture(scope="module")
def small():
  """A binding horizon of 10 (truncated trajectories included), revisit policy, k_mem 1."""
  grid = testbed.make_grid()
  dag = testbed.build_dag(grid, 1, 10)
  sol = testbed.solve(dag, testbed.policy_logits(dag, testbed.PolicySpec("revisit", beta=2.0, seed=0)),
                      GAMMA)
  ro = sampling.sample(dag, sol, num_batches=6, group_size=4, seed=3)
  a_star, v = sampling.oracle_rows(dag, sol, ro)
  rows = np.arange(ro.num_rows)
  anchor = testbed.observations(grid, "exact")[ro.cell]
  returns = sampling.build(ro, rows, anchor, num_levels=1, gamma=GAMMA)
  mc = returns.to_input_order(returns.batch.returns).astype(np.float64) - v
  assert (~ro.done & (ro.step == 9)).any() and ro.done.any()  # truncated and terminated
  return dict(ro=ro, rows=rows, anchor=anchor, a_star=a_star, v=v, mc=mc)


def test_exact_critic_gae_lambda0_is_the_exact_advantage(small):
  g = critics.critic_batch(small["ro"], small["rows"], small["anchor"], gamma=GAMMA)
  adv = critics.gae_advantages(g, small["v"], gamma=GAMMA, lam=0.0)
  np.testing.assert_allclose(adv, small["a_star"], atol=2e-5)


def test_exact_critic_gae_lambda1_is_the_monte_carlo_advantage(small):
  g = critics.critic_batch(small["ro"], small["rows"], small["anchor"], gamma=GAMMA)
  adv = critics.gae_advantages(g, small["v"], gamma=GAMMA, lam=1.0)
  np.testing.assert_allclose(adv, small["mc"], atol=5e-5)
  assert not np.allclose(small["mc"], small["a_star"], atol=1e-2)  # MC is not A*


def test_exact_critic_hae(small):
  ro, rows, anchor, v = small["ro"], small["rows"], small["anchor"], small["v"]
  # lambda_turn = 0: every turn bootstraps one step ahead (V_high = V_low = V): A*.
  seg3 = critics.critic_batch(ro, rows, anchor, gamma=GAMMA, seg_len=3)
  adv = critics.hae_advantages(seg3, v, gamma=GAMMA, lambda_turn=0.0)
  np.testing.assert_allclose(adv, small["a_star"], atol=2e-5)
  # One segment per trajectory and lambda_turn = 1: the Monte-Carlo advantage.
  one = critics.critic_batch(ro, rows, anchor, gamma=GAMMA, seg_len=100)
  adv = critics.hae_advantages(one, v, gamma=GAMMA, lambda_turn=1.0)
  np.testing.assert_allclose(adv, small["mc"], atol=5e-5)
  # Segments of 3 turns, lambda_turn = 1: the return to the segment end plus the
  # discounted value at the next segment start, minus V (checked by hand on one row).
  adv = critics.hae_advantages(seg3, v, gamma=GAMMA, lambda_turn=1.0)
  i = int(np.flatnonzero((ro.step == 1) & np.isin(ro.traj, ro.traj[ro.step == 4]))[0])
  t = ro.traj[i]
  r = {s: ro.reward[(ro.traj == t) & (ro.step == s)][0] for s in (1, 2)}
  v3 = v[(ro.traj == t) & (ro.step == 3)][0]
  assert adv[i] == pytest.approx(r[1] + GAMMA * r[2] + GAMMA**2 * v3 - v[i], abs=2e-5)


@pytest.mark.parametrize("mode", critics.CRITIC_MODES)
def test_critic_quality_is_the_requested_explained_variance(small, mode):
  v = small["v"]
  key = small["ro"].step * 100_000 + small["ro"].node
  for ev in (0.0, 0.3, 0.9, 1.0):
    v_hat = critics.critic_values(v, key, ev, mode, np.random.default_rng(0))
    assert critics.explained_variance(v_hat, v) == pytest.approx(ev, abs=1e-9)
  np.testing.assert_allclose(critics.critic_values(v, key, 1.0, mode, np.random.default_rng(0)), v)
  # Rows at the same node share the critic's error.
  v_hat = critics.critic_values(v, key, 0.5, mode, np.random.default_rng(1))
  same = np.flatnonzero(key == key[np.argmax(np.bincount(np.unique(key, return_inverse=True)[1]))])
  assert np.ptp(v_hat[same] - v[same]) < 1e-12
  with pytest.raises(ValueError, match="critic mode"):
    critics.critic_values(v, key, 0.5, "blend", np.random.default_rng(0))
