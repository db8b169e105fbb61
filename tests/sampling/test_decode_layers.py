"""`decode_layers="per_layer"`: a decode step over per-layer weights (and, on CPUs, a
per-layer cache), the decode weights made once per weight version.

The reference is the default sampler ("auto": on a CPU, a scan over the stacked layers, the
decode weights made inside every call). In float32 the two programs differ only in how XLA
orders the same sums, so the tokens are equal and the log-probs agree to round-off; with
LoRA adapters (merged into the decode weights) as without. The decode weights are made
once per version of the model's parameters: a second call reuses them, a new model or an
in-place update makes new ones (and samples what a fresh sampler samples).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hgpo_jax.models import config, decoder, kv_cache, loading, lora
from hgpo_jax.rollout import params as rollout_params
from hgpo_jax.sampling import SamplingParams, engine, sampler

TEXTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
         "put a clean apple in the fridge", "look", "take apple 1 from countertop 1",
         "open the drawer"]
ACTIONS = ["look", "go to bed 1", "go to cabinet 2", "take apple 1 from countertop 1",
           "inventory"]
KW = dict(prompt_buckets=(64,), batch_buckets=(8,))


def _close(got, want):
  assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
  for a, b in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
  assert got.decode_row_steps == want.decode_row_steps


@pytest.fixture(scope="module")
def adapted():
  """The tiny decoder with LoRA adapters on every projection, B made non-zero."""
  model = loading.with_lora(decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(0)),
                            lora.LoraConfig(rank=4, alpha=8.0), seed=0)
  state = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(state)
  nnx.update(model, jax.tree.unflatten(treedef, [
      x + 0.05 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)
      for i, x in enumerate(leaves)]))
  return model


@pytest.mark.parametrize("which", ["base", "lora"])
@pytest.mark.parametrize("constrained", [False, True])
def test_per_layer_decode_samples_what_the_stacked_scan_samples(model, adapted, tok, which,
                                                                constrained):
  m = model if which == "base" else adapted
  prompts = [tok.encode(t) for t in TEXTS]
  allowed = [ACTIONS] * len(prompts) if constrained else None
  params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_strings=("e ",))
  auto = sampler.Sampler(m, tok, **KW)
  per_layer = sampler.Sampler(m, tok, decode_layers="per_layer", **KW)
  assert (auto.engine.per_layer, auto.engine.layered_cache) == (False, False)
  assert (per_layer.engine.per_layer, per_layer.engine.layered_cache) == (True, True)
  for seed in (0, 5):
    _close(per_layer.generate(prompts, params, jax.random.key(seed), allowed=allowed),
           auto.generate(prompts, params, jax.random.key(seed), allowed=allowed))


def test_decode_weights_are_made_once_per_weight_version(model, tok):
  prompts = [tok.encode(t) for t in TEXTS]
  params = SamplingParams(temperature=1.0, max_new_tokens=12)
  smp = sampler.Sampler(model, tok, decode_layers="per_layer", **KW)
  made = []
  program = smp._decoding_program
  smp._decoding_program = lambda m: made.append(1) or program(m)
  first = smp.generate(prompts, params, jax.random.key(0))
  again = smp.generate(prompts, params, jax.random.key(0))
  assert len(made) == 1 and again.tokens == first.tokens
  view = smp.decoding_model()
  assert isinstance(view.layers, decoder.DecodeWeights) and view.layers.per_layer
  assert view.for_decoding(True) is view  # the program makes nothing more from it

  # a new model (the trainer's next weights), then an in-place update of it
  other = decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(1))
  smp.model = other
  got = smp.generate(prompts, params, jax.random.key(0))
  assert len(made) == 2
  _close(got, sampler.Sampler(other, tok, **KW).generate(prompts, params, jax.random.key(0)))
  state = nnx.state(other, nnx.Param)
  nnx.update(other, jax.tree.map(lambda x: x * 1.5, state))
  got = smp.generate(prompts, params, jax.random.key(0))
  assert len(made) == 3
  _close(got, sampler.Sampler(other, tok, **KW).generate(prompts, params, jax.random.key(0)))

  # "auto" on a CPU passes the model itself (the program makes the decode weights)
  auto = sampler.Sampler(model, tok, **KW)
  assert auto.decoding_model() is model


def test_layered_cache_decode_step_equals_the_stacked_one(model):
  """One decode step of 2 new tokens over a filled cache: the hidden states and every layer's
  cache (the new slots written, the rest kept) equal the stacked layout's."""
  cfg = model.cfg
  rng = np.random.default_rng(0)
  cache = kv_cache.KVCache(
      k=jnp.asarray(rng.normal(size=kv_cache.cache_shape(cfg, 3, 20)), jnp.float32),
      v=jnp.asarray(rng.normal(size=kv_cache.cache_shape(cfg, 3, 20)), jnp.float32))
  tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (3, 2)), jnp.int32)
  positions = jnp.asarray([[9, 10], [4, 5], [11, 12]], jnp.int32)
  view = model.for_decoding(True)
  h_ref, c_ref = jax.jit(lambda m, c: m.for_decoding().decode_hidden(tokens, positions, c, 12))(
      model, cache)
  h, c = jax.jit(lambda m, c: m.decode_hidden(tokens, positions, kv_cache.layered(c), 12))(
      view, cache)
  assert kv_cache.is_layered(c) and len(c.k) == cfg.num_layers
  np.testing.assert_allclose(h, h_ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jnp.stack(c.k), c_ref.k, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(jnp.stack(c.v), c_ref.v, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(jnp.stack(c.k)[:, :, :, :12], cache.k[:, :, :, :12])
  with pytest.raises(ValueError, match="per-layer cache"):
    model.for_decoding().decode_hidden(tokens, positions, kv_cache.layered(cache), 12)


def test_decode_layers_resolve_by_the_target_platform_and_refuse_other_names():
  cpu = jax.devices("cpu")
  assert engine.resolve_decode_layers("auto", cpu) == (False, False)
  assert engine.resolve_decode_layers("per_layer", cpu) == (True, True)

  class Gpu:
    platform = "gpu"
  assert engine.resolve_decode_layers("per_layer", [Gpu()]) == (True, False)
  with pytest.raises(ValueError, match=r"decode_layers='stacked': use one of \('auto', "):
    engine.resolve_decode_layers("stacked", cpu)
  with pytest.raises(ValueError, match="decode_layers='scan'; use one of"):
    rollout_params.RolloutParams(decode_layers="scan")
  assert rollout_params.RolloutParams().decode_layers == "auto"
