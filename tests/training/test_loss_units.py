"""The loss unit (`UpdateConfig.loss_unit_rows`): the rows whose tokens one token mean
averages, independent of the micro-batches the update runs for memory.

verl averages tokens within each per-GPU micro-batch and then averages those means; the
project's update with a unit other than its micro-batch weights each token by
`train_batch.unit_weights`. These tests pin that an update with micro-batches of m rows and
units of u rows equals the update whose micro-batches *are* the u-row units, for u below
and above m, for the actor and for the three-head critic.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config as model_config
from hgpo_jax.models import critic
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding
from hgpo_jax.training import critic_step
from hgpo_jax.training import losses
from hgpo_jax.training import packing
from hgpo_jax.training import train_batch
from hgpo_jax.training import train_step

TINY = model_config.get_preset("tiny").replace(num_layers=1, vocab_size=64, mlp_dim=64)


def _mesh():
  return sharding.make_mesh(1, 1, 1, devices=fake_devices.take(1))


def _host_batch(rows=16, seed=0):
  """Random prompts/responses of varied lengths (rows 13.. empty: whole empty units)."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, TINY.vocab_size, rng.integers(1, 7)).tolist() for _ in range(rows)]
  responses = [rng.integers(1, TINY.vocab_size, rng.integers(1, 9)).tolist() if i < 12 else []
               for i in range(rows)]
  adv = rng.normal(size=rows).astype(np.float32)
  batch, _ = train_batch.build_train_batch(prompts, responses, adv, prompt_buckets=[8],
                                           response_buckets=[8], row_multiple=rows)
  return batch.replace(old_logprobs=batch.old_logprobs + 0.2 * np.sign(batch.advantages)
                       * batch.response_mask)


def _config(**kw):
  return train_step.UpdateConfig(**{"lr": 0.1, "eps": 1.0, "mini_batch_rows": 16, **kw})


def _actor_update(cfg, host):
  model = decoder.Decoder(TINY, rngs=nnx.Rngs(0))
  learner = train_step.Learner(model, _mesh(), cfg)
  state = learner.init_state(nnx.state(model, nnx.Param))
  new, metrics = learner.update(state, learner.put_batch(host))
  return jax.device_get(new.params), jax.device_get(metrics)


def _close(a, b, rtol=1e-5):
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=1e-7), a, b)


def test_unit_weights_are_the_mean_over_active_units_of_unit_token_means():
  mask = np.zeros((8, 3, 2), bool)
  mask[0, :2, 0] = mask[1, 0, 0] = True  # unit 0, channel 0: 3 entries
  mask[2, 1, 1] = True  # unit 1, channel 1: 1 entry; units 2 and 3 empty
  w = np.asarray(train_batch.unit_weights(mask, 2))
  assert np.allclose(w[mask], [1 / 6, 1 / 6, 1 / 6, 1 / 2]) and not w[~mask].any()
  x = np.random.default_rng(0).normal(size=mask.shape)
  expected = (x[:2, :, 0][mask[:2, :, 0]].mean() + x[2:4, :, 1][mask[2:4, :, 1]].mean()) / 2
  assert np.sum(w * x) == pytest.approx(expected)


@pytest.mark.parametrize("micro,unit", [(8, 4), (4, 8), (2, 16)])
def test_actor_update_with_loss_units_equals_micro_batches_of_the_unit(micro, unit):
  host = _host_batch()
  got, got_m = _actor_update(_config(micro_batch_rows=micro, loss_unit_rows=unit), host)
  ref, ref_m = _actor_update(_config(micro_batch_rows=unit), host)
  _close(got, ref)
  for key in ("loss", "pg_loss", "entropy", "kl", "grad_norm"):
    assert got_m[key] == pytest.approx(ref_m[key], rel=1e-5), key


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_weighted_update_is_the_same_on_a_sharded_mesh(shape):
  host = _host_batch()
  cfg = _config(micro_batch_rows=8, loss_unit_rows=4)
  ref, _ = _actor_update(cfg, host)
  model = decoder.Decoder(TINY, rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh(*shape, devices=fake_devices.take(8))
  learner = train_step.Learner(model, mesh, cfg)
  new, _ = learner.update(learner.init_state(nnx.state(model, nnx.Param)),
                          learner.put_batch(host))
  _close(jax.device_get(new.params), ref, rtol=1e-4)


def test_unit_equal_to_the_micro_batch_is_the_unweighted_update():
  host = _host_batch()
  assert not _config(micro_batch_rows=8, loss_unit_rows=8).unit_weighted
  a, _ = _actor_update(_config(micro_batch_rows=8, loss_unit_rows=8), host)
  b, _ = _actor_update(_config(micro_batch_rows=8), host)
  _close(a, b, rtol=0)


def test_packed_and_grouped_weights_follow_the_loss_unit():
  host = _host_batch()
  mask = np.asarray(host.response_mask, bool)
  for unit in (4, 16):
    expected = np.asarray(train_batch.unit_weights(mask[..., None], unit))[..., 0]
    assert np.allclose(packing.token_mean_weights(mask, unit), expected)
  packed = packing.pack_mini_batch(host, micro_batch_rows=4, loss_unit_rows=16)
  grouped = packing.group_mini_batch(host, micro_batch_rows=4, length_multiple=8,
                                     loss_unit_rows=16)
  total = float(np.sum(np.asarray(packed.loss_weights)))
  assert total == pytest.approx(1.0)  # one active unit: weights sum to its one token mean
  assert sum(float(np.sum(np.asarray(g.loss_weights))) for g in grouped) == pytest.approx(1.0)


def test_config_errors_name_the_loss_unit():
  with pytest.raises(ValueError, match=r"mini_batch_rows=16 must be a multiple of "
                                       r"loss_unit_rows=6"):
    _config(micro_batch_rows=8, loss_unit_rows=6)
  with pytest.raises(ValueError, match=r"loss_unit_rows=4 differs .* needs loss_agg='token-mean'"):
    _config(micro_batch_rows=8, loss_unit_rows=4,
            loss=losses.LossConfig(loss_agg="seq-mean-token-mean"))


def _critic_update(cfg, host, value_mask, returns):
  crit = critic.Critic(TINY, num_heads=3, rngs=nnx.Rngs(1))
  learner = critic_step.CriticLearner(crit, _mesh(), cfg)
  state = learner.init_state(nnx.state(crit, nnx.Param))
  vb = critic_step.value_batch(host, value_mask, returns, np.zeros_like(returns))
  new, metrics = learner.update(state, learner.put_batch(vb))
  return jax.device_get(new.params), jax.device_get(metrics)


@pytest.mark.parametrize("micro,unit", [(8, 4), (4, 8)])
def test_three_head_critic_update_with_loss_units_equals_micro_batches_of_the_unit(micro, unit):
  host = _host_batch()
  rng = np.random.default_rng(1)
  value_mask = np.asarray(host.response_mask, bool)[..., None] & (rng.random((16, 16, 3)) < 0.5)
  value_mask[:, :, 1] &= np.arange(16)[:, None] < 5  # the high head only in the first rows
  returns = rng.normal(size=value_mask.shape).astype(np.float32)
  got, got_m = _critic_update(_config(micro_batch_rows=micro, loss_unit_rows=unit), host,
                              value_mask, returns)
  ref, ref_m = _critic_update(_config(micro_batch_rows=unit), host, value_mask, returns)
  _close(got, ref)
  assert got_m["value_loss"] == pytest.approx(ref_m["value_loss"], rel=1e-5)


def test_multi_head_value_loss_sums_the_heads_token_means():
  rng = np.random.default_rng(2)
  v, v_old, r = (rng.normal(size=(4, 5, 3)).astype(np.float32) for _ in range(3))
  mask = rng.random((4, 5, 3)) < 0.5
  mask[..., 2] = False  # a head without targets adds 0 (HiPER dp_critic.py)
  loss, _ = losses.multi_head_value_loss(v, v_old, r, mask, 0.5)
  per_head = [losses.value_loss(v[..., h], v_old[..., h], r[..., h], mask[..., h], 0.5)[0]
              for h in range(3)]
  assert float(loss) == pytest.approx(float(sum(per_head)), rel=1e-6)
  assert float(per_head[2]) == 0.0
