"""PPO-GAE (docs/algorithms.md §7): golden micro-example §11.6, equivalence with the loop
reference (per-row and multi-turn), sharding and dump fields."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hgpo_jax.advantages import gae
from hgpo_jax.advantages import hae_reference as ref
from hgpo_jax.advantages import registry
from hgpo_jax.advantages.gae import GaeOptions


def two_turn_fields():
  """One trajectory of two turns with responses of 3 and 2 tokens (+1 padding token)."""
  return {
      "mask": np.ones(2, bool), "traj": np.zeros(2, np.int32), "step": np.arange(2, dtype=np.int32),
      "reward": np.array([0.0, 10.0], np.float32), "done": np.array([False, True]),
      "action_valid": np.ones(2, bool), "score": np.array([10.0, 10.0], np.float32),
      "token_values": np.array([[4, 5, 6], [7, 8, 99]], np.float32),
      "response_mask": np.array([[1, 1, 1], [1, 1, 0]], bool),
  }


def test_golden_micro_example():
  # docs/algorithms.md §11.6: token rewards [0, 0, 10], values [4, 5, 6], gamma = lambda = 1 -> A = [6, 5, 4].
  f = two_turn_fields()
  out = gae.gae(ref.row_batch(f), GaeOptions(norm_adv=False))
  np.testing.assert_allclose(np.asarray(out.token_advantage)[0], [6, 5, 4])
  np.testing.assert_allclose(np.asarray(out.token_advantage)[1], [3, 2, 0])  # 10 - [7, 8]; padding 0
  np.testing.assert_allclose(out.value_targets["token"], [[10, 10, 10], [10, 10, 0]])
  np.testing.assert_allclose(out.advantage, [6, 3])
  np.testing.assert_array_equal(out.loss_mask, f["response_mask"])


def test_golden_whitening_unbiased():
  # A = [6, 5, 4, 3, 2]: mean 4, unbiased var 2.5.
  out = gae.gae(ref.row_batch(two_turn_fields()), GaeOptions())
  expect = (np.array([[6, 5, 4], [3, 2, 4]]) - 4.0) / np.sqrt(2.5 + 1e-8)
  expect[1, 2] = 0.0
  np.testing.assert_allclose(out.token_advantage, expect, rtol=1e-6, atol=1e-7)


def test_golden_multi_turn_chain():
  # Turns chained: tokens [4, 5, 6 | 7, 8] with one reward 10 at the very end -> A = 10 - V.
  out = gae.gae(ref.row_batch(two_turn_fields()), GaeOptions(multi_turn=True, norm_adv=False))
  np.testing.assert_allclose(out.token_advantage, [[6, 5, 4], [3, 2, 0]], rtol=1e-6)
  # gamma = 0.5, lambda = 1: A_j = discounted reward-to-go - V_j along the chain of 5 tokens.
  out = gae.gae(ref.row_batch(two_turn_fields()), GaeOptions(multi_turn=True, norm_adv=False, gamma=0.5))
  expect = [[10 * 0.5 ** 4 - 4, 10 * 0.5 ** 3 - 5, 10 * 0.5 ** 2 - 6], [10 * 0.5 - 7, 10 - 8, 0]]
  np.testing.assert_allclose(out.token_advantage, expect, rtol=1e-6)


EQUIVALENCE_OPTIONS = {
    "per_row_defaults": GaeOptions(),
    "per_row_discounted": GaeOptions(gamma=0.9, lam=0.7),
    "multi_turn_truncated_bootstrap": GaeOptions(multi_turn=True, gamma=0.95, lam=0.9, bootstrap_truncated=True),
    "multi_turn_raw": GaeOptions(multi_turn=True, norm_adv=False, invalid_penalty=0.5),
}


@pytest.mark.parametrize("name", sorted(EQUIVALENCE_OPTIONS))
def test_matches_reference_on_random_trajectories(name):
  opt = EQUIVALENCE_OPTIONS[name]
  rng = np.random.default_rng(sorted(EQUIVALENCE_OPTIONS).index(name))
  f = ref.random_fields(rng, num_traj=200, max_turns=8, num_tokens=24, capacity=1024)
  out = gae.gae(ref.row_batch(f), opt)
  expect = ref.gae(f, opt)
  np.testing.assert_allclose(out.token_advantage, expect["token_advantage"], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out.value_targets["token"], expect["returns"], rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(out.loss_mask, expect["loss_mask"])
  first = np.argmax(f["response_mask"], axis=1)
  np.testing.assert_allclose(out.advantage, np.where(f["mask"], expect["token_advantage"][np.arange(1024), first], 0),
                             rtol=1e-4, atol=1e-4)
  if opt.norm_adv:
    tok = np.asarray(out.token_advantage)[expect["loss_mask"]]
    assert abs(tok.mean()) < 1e-5 and abs(tok.std(ddof=1) - 1.0) < 1e-4


def test_sharded_equals_unsharded():
  # all devices of the process (8 by default; the reduction-order variations use 4 and 16)
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  f = ref.random_fields(np.random.default_rng(2), num_traj=200, max_turns=8, num_tokens=24, capacity=1024)
  batch = ref.row_batch(f)
  opt = EQUIVALENCE_OPTIONS["multi_turn_truncated_bootstrap"]
  plain = gae.gae(batch, opt)

  def put(x):
    spec = P(None, "data") if x.ndim == 2 and x.shape[0] != batch.capacity else P("data")
    return jax.device_put(x, NamedSharding(mesh, spec))

  sharded = gae.gae(jax.tree.map(put, batch), opt)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(sharded)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_dump_fields_and_errors():
  fields = gae.gae_fields_from_dump([{"token_values": [4, 5, 6]}, {"token_values": [7]}])
  np.testing.assert_array_equal(fields["token_values"], [[4, 5, 6], [7, 0, 0]])
  np.testing.assert_array_equal(fields["response_mask"], [[1, 1, 1], [1, 0, 0]])
  with pytest.raises(ValueError, match="no `token_values`"):
    gae.gae_fields_from_dump([{"reward": 0}])
  with pytest.raises(ValueError, match="more than num_tokens=2"):
    gae.gae_fields_from_dump([{"token_values": [1, 2, 3]}], num_tokens=2)
  f = two_turn_fields()
  with pytest.raises(ValueError, match="RowBatch.token_values"):
    gae.gae(ref.row_batch({**f, "token_values": None}), GaeOptions())


def test_registered_with_published_defaults():
  est = registry.get("gae")
  assert est.needs_critic and est.options_cls is GaeOptions
  opt = est.options()
  assert (opt.gamma, opt.lam, opt.norm_adv, opt.multi_turn) == (1.0, 1.0, True, False)
