"""The value model: read-out positions, values from the backbone, init from the policy."""

import jax
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.advantages.hae import TAG_ACTION as A
from hgpo_jax.advantages.hae import TAG_OTHER as O
from hgpo_jax.advantages.hae import TAG_SUBGOAL as G
from hgpo_jax.advantages.hae import TAG_SWITCH as S
from hgpo_jax.models import config as model_config
from hgpo_jax.models import critic
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding

TINY = model_config.get_preset("tiny").replace(num_layers=1, vocab_size=64, mlp_dim=64)


# ------------------------------------------------------------------ read-out positions
@pytest.mark.parametrize("tags,low", [
    # <switch>KEEP</switch> (3 tokens) <subgoal>..</subgoal> (4) <action>..</action> (3)
    ([S, S, S, G, G, G, G, A, A, A], 7),
    # untagged text between the blocks: still the first token after the subgoal span
    ([O, S, S, O, G, G, O, A, A], 6),
    # no subgoal block: the first token after </switch>
    ([S, S, A, A, A], 2),
    # neither switch nor subgoal: the first response token
    ([A, A, A], 0),
    ([O, O], 0),
    # truncated inside the subgoal (it runs to the end): falls back to after </switch>
    ([S, S, S, G, G], 3),
    # truncated inside the switch: first token
    ([S, S, S], 0),
    # a response of one token
    ([G], 0),
])
def test_hiper_readout_positions(tags, low):
  assert critic.hiper_readout(tags) == (low, 0, 0)
  assert critic.hiper_readout(np.asarray(tags, np.int8)) == (low, 0, 0)


# ------------------------------------------------------------------ values
def _policy(seed=0):
  return decoder.Decoder(TINY, rngs=nnx.Rngs(seed))


def _critic_from(policy, num_heads=3):
  params = critic.params_from_policy(nnx.state(policy, nnx.Param), TINY, num_heads, seed=1)
  graphdef, _ = nnx.split(critic.abstract_critic(TINY, num_heads), nnx.Param)
  return nnx.merge(graphdef, params), params


def _batch():
  tokens = np.array([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]], np.int32)
  mask = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], bool)
  positions = np.where(mask, np.cumsum(mask, 1) - 1, 0).astype(np.int32)
  return tokens, positions, mask


def test_values_are_the_head_on_the_previous_positions_hidden_state():
  policy = _policy()
  model, params = _critic_from(policy)
  tokens, positions, mask = _batch()
  values = np.asarray(model.values(tokens, positions, mask))
  assert values.shape == (2, 6, 3)
  hidden, _ = policy.hidden(tokens, positions, mask)
  hidden = np.asarray(hidden, np.float64)
  w, c = np.asarray(params["value_head"], np.float64), np.asarray(params["value_bias"], np.float64)
  expected = np.zeros((2, 6, 3))
  for b in range(2):
    for l in range(1, 6):  # column l reads position l - 1
      expected[b, l] = w @ hidden[b, l - 1] + c
  # f32 dot over D = 64 terms of magnitude ~1 x 0.02: absolute error ~64 ulps of the sum.
  np.testing.assert_allclose(values, expected, rtol=0, atol=1e-5)
  assert np.all(values[:, 0] == 0)


def test_init_copies_the_policy_backbone_and_drops_the_output_layer():
  untied = TINY.replace(tie_embeddings=False)
  policy = decoder.Decoder(untied, rngs=nnx.Rngs(0))
  params = critic.params_from_policy(nnx.state(policy, nnx.Param), untied, 1, seed=1)
  pure = nnx.to_pure_dict(nnx.state(policy, nnx.Param))
  assert set(params["backbone"]) == {"embed", "layers", "final_norm"}  # no lm_head
  for a, b in zip(jax.tree.leaves(params["backbone"]), jax.tree.leaves({k: pure[k] for k in critic.BACKBONE_KEYS})):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert params["value_head"].shape == (1, TINY.hidden_dim)
  assert np.all(params["value_bias"] == 0)
  # N(0, 0.02^2) over 64 entries: the sample std is within 0.02 * (1 +- 0.5) w.p. > 1 - 1e-6
  assert 0.01 < float(np.std(params["value_head"])) < 0.03
  # The critic's backbone is the policy's: the same hidden states on the same tokens
  # (the same program on the same weights in one process: exact).
  graphdef, _ = nnx.split(critic.abstract_critic(untied, 1), nnx.Param)
  model = nnx.merge(graphdef, params)
  tokens, positions, mask = _batch()
  h_policy, _ = policy.hidden(tokens, positions, mask)
  h_critic, _ = model.backbone.hidden(tokens, positions, mask)
  np.testing.assert_array_equal(np.asarray(h_policy), np.asarray(h_critic))


def test_bad_head_count_and_params():
  with pytest.raises(ValueError, match="num_heads=2"):
    critic.Critic(TINY, 2, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="lack"):
    critic.params_from_policy({"embed": np.zeros((2, 2))}, TINY, 1, seed=0)


def test_critic_params_follow_the_logical_axis_rules():
  mesh = sharding.make_mesh(2, 2, 2, devices=fake_devices.take(8))
  abstract = critic.abstract_critic(TINY, 3)
  shardings = nnx.to_pure_dict(sharding.param_shardings(nnx.state(abstract, nnx.Param), mesh))
  assert tuple(shardings["value_head"].spec) == (None, "fsdp")  # [heads, embed]
  assert tuple(shardings["value_bias"].spec) == (None,)
  assert tuple(shardings["backbone"]["layers"]["q"].spec) == (None, "tensor", None, "fsdp")
