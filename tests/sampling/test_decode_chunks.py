"""Chunked lockstep decode: K decode steps per iteration of the device loop.

`Sampler(decode_chunk=K)` runs an inner loop of K steps (known trip count) and tests
"every row finished?" once per K (`engine.lockstep_decode`), which spares XLA:GPU a host
round trip per token. The reference is the one-step loop (`decode_chunk=1`, the CPU
default): the same program step for step, so the samples are equal bit for bit, the
reported step count included, for any K (dividing max_new_tokens or not, past the moment
every row stopped, and K > max_new_tokens).
"""

import jax
import numpy as np
import pytest

from hgpo_jax.sampling import engine, sampler
from hgpo_jax.sampling import SamplingParams

TEXTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
         "put a clean apple in the fridge", "look", "take apple 1 from countertop 1",
         "open the drawer", "inventory"]

PARAMS = {
    "sampled, stop string": SamplingParams(temperature=1.0, max_new_tokens=21,
                                                   stop_strings=("e ",)),
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=21),
    "top-k + top-p": SamplingParams(temperature=0.7, top_k=20, top_p=0.9,
                                            max_new_tokens=21),
}


def _identical(got, want):
  assert got.tokens == want.tokens and got.texts == want.texts
  assert got.stop_reason == want.stop_reason
  for x, y in zip(got.logprobs, want.logprobs):
    np.testing.assert_array_equal(x, y)
  assert (got.decoded_tokens, got.decode_row_steps) == (want.decoded_tokens,
                                                        want.decode_row_steps)


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("chunk", [4, 5, 32])
def test_chunked_decode_samples_what_the_one_step_loop_samples(model, tok, name, chunk):
  prompts = [tok.encode(t) for t in TEXTS]
  kw = dict(prompt_buckets=(64,), batch_buckets=(8,))
  one = sampler.Sampler(model, tok, decode_chunk=1, **kw)
  chunked = sampler.Sampler(model, tok, decode_chunk=chunk, **kw)
  assert (one.engine.decode_chunk, chunked.engine.decode_chunk) == (1, chunk)
  for seed in (0, 3):
    want = one.generate(prompts, PARAMS[name], jax.random.key(seed))
    _identical(chunked.generate(prompts, PARAMS[name], jax.random.key(seed)), want)


def test_chunked_decode_stops_counting_when_every_row_stopped(model, tok):
  """Constrained responses of known lengths end long before max_new_tokens: the chunk's
  later steps record nothing and the reported steps are the longest response's."""
  actions = ["look", "go to bed 1", "inventory"]
  prompts = [tok.encode(t) for t in TEXTS[:6]]
  allowed = [[actions[b % 3]] for b in range(6)]
  params = SamplingParams(temperature=1.0, max_new_tokens=40)
  kw = dict(prompt_buckets=(64,), batch_buckets=(8,))
  want = sampler.Sampler(model, tok, decode_chunk=1, **kw).generate(
      prompts, params, jax.random.key(1), allowed=allowed)
  got = sampler.Sampler(model, tok, decode_chunk=8, **kw).generate(
      prompts, params, jax.random.key(1), allowed=allowed)
  _identical(got, want)
  assert want.decode_row_steps == 8 * max(len(t) for t in want.tokens) < 8 * 40


def test_decode_chunk_resolves_by_the_target_platform():
  cpu = jax.devices("cpu")
  assert engine.resolve_decode_chunk(0, cpu) == 1
  assert engine.resolve_decode_chunk(6, cpu) == 6

  class Gpu:
    platform = "gpu"
  assert engine.resolve_decode_chunk(0, [Gpu()]) == engine.GPU_DECODE_CHUNK
  with pytest.raises(ValueError, match="decode_chunk_steps"):
    engine.resolve_decode_chunk(-1, cpu)
