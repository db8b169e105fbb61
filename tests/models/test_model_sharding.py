"""Mesh sharding on 8 fake CPU devices: sharded logits == unsharded, rules place params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import fake_devices
import model_fixtures
from hgpo_jax.models import load_model, make_mesh, param_shardings, shard_model
from hgpo_jax.models import sharding as sharding_lib


@pytest.fixture(scope="module")
def mesh():
  return make_mesh(data=2, fsdp=2, tensor=2, devices=fake_devices.take(8))


def test_make_mesh_axes_and_errors():
  mesh = make_mesh(fsdp=2, devices=fake_devices.take(8))
  assert mesh.axis_names == ("data", "fsdp", "tensor")
  assert dict(mesh.shape) == {"data": 4, "fsdp": 2, "tensor": 1}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  with pytest.raises(ValueError, match="device count"):
    make_mesh(data=3, fsdp=2, tensor=2, devices=fake_devices.take(8))


def test_logical_to_spec_rules(mesh):
  spec = sharding_lib.logical_to_spec
  assert spec(("layers", "embed", "heads", "head_dim"), mesh, shape=(2, 64, 4, 16)) == P(None, "fsdp", "tensor", None)
  assert spec(("batch", "length"), mesh, shape=(8, 5)) == P(("data", "fsdp"), None)
  # Not divisible (SmolLM2's 9 heads on tensor=2): replicated instead of failing.
  assert spec(("embed", "heads"), mesh, shape=(576, 9)) == P("fsdp", None)
  # A mesh axis is used once: the second "embed" dim stays replicated.
  assert spec(("embed", "embed"), mesh, shape=(64, 64)) == P("fsdp", None)


def test_sharded_logits_equal_unsharded(mesh, tmp_path):
  directory = str(tmp_path)
  model_fixtures.write_hf_dir(directory, "qwen2")
  tokens, mask, positions = model_fixtures.left_padded_batch(batch=4, pads=(0, 3, 7, 1))
  args = (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
  fwd = jax.jit(lambda m, t, p, a: m(t, p, a)[0])
  plain, _, _ = load_model(directory)
  want = np.asarray(fwd(plain, *args))

  loaded, _, _ = load_model(directory, mesh=mesh)  # placed while loading
  shards = loaded.layers.q[...].sharding
  assert shards.spec == P(None, "tensor", None, "fsdp")  # q: [L, H, Dh, D]
  assert loaded.layers.q[...].addressable_shards[0].data.shape == (2, 2, 16, 32)
  assert loaded.lm_head[...].sharding.spec == P("tensor", "fsdp")

  moved = shard_model(load_model(directory)[0], mesh)  # placed after loading
  assert moved.embed[...].sharding.spec == P("tensor", "fsdp")
  batch_sharding = jax.NamedSharding(mesh, P(("data", "fsdp")))
  sharded_args = tuple(jax.device_put(a, batch_sharding) for a in args)
  for model in (loaded, moved):
    got = np.asarray(fwd(model, *sharded_args))
    np.testing.assert_allclose(got[mask], want[mask], atol=2e-5)


def test_param_shardings_cover_optimizer_state(mesh):
  model, _, _ = load_model("tiny", mesh=mesh)
  with jax.set_mesh(mesh):
    opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
  shardings = param_shardings(opt, mesh)
  mu = shardings["opt_state"][0]["mu"]["layers"]["gate"]
  assert mu.get_value().spec == P(None, "tensor", "fsdp")  # gate: [L, F, D]
  assert shardings["step"].get_value().spec == P()


def test_sequence_parallel_blocks_give_the_unsplit_values(mesh, monkeypatch):
  """On a tensor-parallel mesh an accelerator program's full-sequence blocks keep the
  residual stream split over the sequence (`decoder.sequence_parallel`). Forced here for the
  8 fake CPU devices (tensor=2; on CPU targets the decoder leaves it off, and with T not a
  multiple of the tensor size): the program carries the sequence-split constraints and its
  hidden states are the unsplit sharded program's. (Not bit for bit: XLA:CPU blocks the
  products over half the positions differently; the sums are the same, so the values
  agree to float round-off, as the sharded logits above do.)"""
  from types import SimpleNamespace

  from hgpo_jax.models import attention, decoder as decoder_lib

  model = load_model("tiny", seed=3)[0]
  cfg = model.cfg
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=9, batch=4, length=12,
                                                             pads=(0, 3, 7, 1))
  rows = jax.NamedSharding(mesh, P(("data", "fsdp"), None))
  args = [jax.device_put(jnp.asarray(x), rows) for x in (tokens, positions, mask)]
  sharded = shard_model(model, mesh)
  hidden = lambda m, t, p, s: m.hidden(t, p, s)[0]  # noqa: E731
  split = "P(('data', 'fsdp'), 'tensor', None)"

  def run():
    fn = jax.jit(attention.traced_on(mesh, hidden))
    return np.asarray(fn(sharded, *args)), fn.trace(sharded, *args).jaxpr.pretty_print()

  real = decoder_lib.sequence_parallel
  tpu = [SimpleNamespace(platform="tpu")]
  with jax.set_mesh(mesh):
    assert real(cfg, attention.context_target(), (4, 12, cfg.hidden_dim)) is \
        decoder_lib.SequenceParallel.OFF  # CPU devices
    assert real(cfg, tpu, (4, 11, cfg.hidden_dim)) is decoder_lib.SequenceParallel.OFF
    assert real(cfg, tpu, (4, 12, cfg.hidden_dim)) is not decoder_lib.SequenceParallel.OFF
  want, plain = run()
  monkeypatch.setattr(decoder_lib, "sequence_parallel",
                      lambda c, target, shape: real(c, tpu, shape))
  got, forced = run()
  assert split in forced and split not in plain
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
