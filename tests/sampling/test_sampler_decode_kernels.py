"""The sampler with the Pallas decode kernels (`model.decode_attention_impl`), run in Pallas
interpret mode on CPU: the samples of the XLA form (tokens equal, log-probs within float
rounding), through the decoder's stacked-cache path (each layer read in place) and a cache
rounded up to `engine.KERNEL_CACHE_MULTIPLE` slots, in lockstep and in slots; and the kernel
itself is in the generate program (equal samples alone would also hold if the model fell
back to the XLA form)."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from hgpo_jax.models import config, decoder
from hgpo_jax.sampling import engine, sampler
from hgpo_jax.sampling import SamplingParams

TEXTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
         "put a clean apple in the fridge", "look", "open the drawer"]


def _model(impl):
  cfg = config.get_preset("tiny").replace(decode_attention_impl=impl)
  return decoder.Decoder(cfg, rngs=nnx.Rngs(0))


def test_the_cache_length_is_a_multiple_of_128_on_gpus_and_under_kernels_only():
  """XLA's decode attention on GPUs and both Pallas kernels get a cache of a multiple of
  128 slots (`engine.cache_multiple`); the XLA form on CPUs and TPUs keeps P + M - 1."""
  class Device:
    def __init__(self, platform):
      self.platform = platform
  xla = config.get_preset("tiny")
  for platform, want in (("cpu", 1), ("tpu", 1), ("gpu", 128), ("cuda", 128)):
    assert engine.cache_multiple(xla, [Device(platform)]) == want, platform
  kernel = dataclasses.replace(xla, decode_attention_impl="pallas_tpu")
  assert engine.cache_multiple(kernel, [Device("tpu")]) == engine.KERNEL_CACHE_MULTIPLE


KERNEL_NAMES = {"pallas_tpu": "decode_attention_tpu", "pallas_gpu": "decode_attention_gpu"}
"""The `pl.pallas_call` name of each kernel (`hgpo_jax.models.decode_kernels`)."""


def _pallas_calls(jaxpr):
  """The names of the `pallas_call`s in `jaxpr` and every jaxpr nested in its equations
  (loop bodies, branches, shard_maps)."""
  jaxpr = getattr(jaxpr, "jaxpr", jaxpr)  # a ClosedJaxpr's own
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      yield eqn.params["name"]
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          yield from _pallas_calls(sub)


def _kernels_in_program(smp, prompts, params) -> set[str]:
  """The Pallas decode kernels (`KERNEL_NAMES` keys) called by the generate program of a
  call, read from its traced program: in interpret mode (CPU) a kernel lowers to plain HLO
  ops with no custom call, and its name is left only in the HLO's location metadata, which
  JAX's trace caches can carry from one kernel's program into another's."""
  inputs, flags = smp.pack(prompts, params, jax.random.key(0))
  traced = smp.generate_program.trace(smp.model, smp._placed(inputs), flags=flags)
  calls = set(_pallas_calls(traced.jaxpr))
  return {impl for impl, name in KERNEL_NAMES.items() if name in calls}


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
@pytest.mark.parametrize("slots", [0, 2])
def test_kernel_sampler_samples_what_the_xla_sampler_samples(tok, impl, slots):
  prompts = [tok.encode(t) for t in TEXTS]
  params = SamplingParams(temperature=1.0, max_new_tokens=12)
  kw = dict(prompt_buckets=(64,), batch_buckets=(8,), decode_slots=slots)
  xla = sampler.Sampler(_model("xla"), tok, **kw)
  kernel = sampler.Sampler(_model(impl), tok, **kw)
  # the XLA form's cache is rounded to 128 slots on GPUs too (`engine.cache_multiple`)
  on_gpu = jax.devices()[0].platform == "gpu"
  assert xla.engine.cache_multiple == (engine.KERNEL_CACHE_MULTIPLE if on_gpu else 1)
  assert kernel.engine.cache_multiple == engine.KERNEL_CACHE_MULTIPLE
  assert kernel.engine.cache_length(64, 12) == 128
  assert xla.engine.cache_length(64, 12) == (128 if on_gpu else 75)
  assert _kernels_in_program(kernel, prompts, params) == {impl}
  assert _kernels_in_program(xla, prompts, params) == set()
  want = xla.generate(prompts, params, jax.random.key(4))
  got = kernel.generate(prompts, params, jax.random.key(4))
  assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
  for x, y in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(x, y, atol=2e-5)


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_gpu"])
def test_kernel_sampler_on_a_mesh_samples_what_the_unsharded_xla_sampler_samples(tok, impl):
  """A data=2 x tensor=2 sampler mesh (4 fake devices): the kernel runs under shard_map on
  each device's rows and kv heads, and the samples are the unsharded XLA sampler's."""
  import fake_devices
  from hgpo_jax.models import sharding
  prompts = [tok.encode(t) for t in TEXTS]
  params = SamplingParams(temperature=1.0, max_new_tokens=10)
  kw = dict(prompt_buckets=(64,), batch_buckets=(8,))
  want = sampler.Sampler(_model("xla"), tok, **kw).generate(prompts, params, jax.random.key(7))
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2, devices=fake_devices.take(4))
  sharded = _model(impl)
  sharding.shard_model(sharded, mesh)
  kernel = sampler.Sampler(sharded, tok, mesh=mesh, **kw)
  assert _kernels_in_program(kernel, prompts, params) == {impl}
  got = kernel.generate(prompts, params, jax.random.key(7))
  assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
  for x, y in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(x, y, atol=2e-5)
