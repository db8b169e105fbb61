"""run.SamplerWeights: the sampler's copy of the policy, resharded on device."""

import jax
import numpy as np
from flax import nnx

import fake_devices
from hgpo_jax.models import config, decoder, sharding
from hgpo_jax.training import run, train_step


def _learner(mesh):
  model = decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(0))
  cfg = train_step.UpdateConfig(mini_batch_rows=8, micro_batch_rows=4)
  return model, train_step.Learner(model, mesh, cfg)


def test_one_process_plays_the_training_params_themselves():
  mesh = sharding.make_mesh(2, 2, 2, devices=fake_devices.take(8))
  model, learner = _learner(mesh)
  state = learner.init_state(nnx.state(model, nnx.Param))
  weights = run.SamplerWeights(learner, mesh)
  played = weights(state.params)
  assert nnx.state(played, nnx.Param)["embed"][...] is state.params["embed"]
  # what the rollout thread keeps: a copy that no later update's donation can reach
  assert _buffers(weights.copy(state.params)).isdisjoint(_buffers(state.params))
  assert _buffers(weights.stored(state.params)) == _buffers(state.params)


def test_a_process_block_of_the_rollout_mesh_gets_the_whole_policy():
  """Two 'processes' of 4 devices each (one real process): the training mesh splits the
  parameters over fsdp=4 across both; the sampler's copy lives on the first block's
  devices (its sampling mesh, fsdp=2) with the same values and the training specs."""
  devices = fake_devices.take(8)
  mesh = sharding.make_mesh(1, 4, 2, devices=devices)
  blocks = [sharding.make_mesh(-1, 2, 2, devices=devices[i:i + 4]) for i in (0, 4)]
  rollout = jax.sharding.Mesh(np.concatenate([b.devices for b in blocks]), sharding.MESH_AXES,
                              axis_types=(jax.sharding.AxisType.Auto,) * 3)
  model, learner = _learner(mesh)
  state = learner.init_state(nnx.state(model, nnx.Param))
  played = nnx.state(run.SamplerWeights(learner, blocks[0], rollout)(state.params), nnx.Param)
  got, want = nnx.to_pure_dict(played), state.params
  for path, leaf in jax.tree_util.tree_leaves_with_path(got):
    ref = want
    for k in path:
      ref = ref[k.key]
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))
    assert leaf.sharding.mesh.devices.tolist() == blocks[0].devices.tolist()
    assert leaf.sharding.spec == ref.sharding.spec
  # something is split over fsdp (4 ways in training, 2 on the block), not all replicated
  assert any("fsdp" in leaf.sharding.spec for leaf in jax.tree.leaves(got))


def test_split_placement_moves_a_copy_onto_the_samplers_devices():
  """One process, split placement: the learner on 4 devices, the sampler on the other 4
  (its own data x tensor shape); the sampler plays the same values there, with the
  training specs, and `copy` never shares a buffer with the learner's params."""
  devices = fake_devices.take(8)
  mesh = sharding.make_mesh(1, 4, 1, devices=devices[:4])
  sample_mesh = sharding.make_mesh(-1, 1, 2, devices=devices[4:])
  model, learner = _learner(mesh)
  state = learner.init_state(nnx.state(model, nnx.Param))
  weights = run.SamplerWeights(learner, sample_mesh, split=True)
  played = nnx.to_pure_dict(nnx.state(weights(state.params), nnx.Param))
  assert weights.transfer_s > 0
  for leaf, ref in zip(jax.tree.leaves(played), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))
    assert set(leaf.sharding.device_set) == set(devices[4:])
    assert leaf.sharding.spec == ref.sharding.spec
  assert _buffers(weights.copy(state.params)).isdisjoint(_buffers(state.params))


def _buffers(tree) -> set[int]:
  return {s.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
          for s in x.addressable_shards}
