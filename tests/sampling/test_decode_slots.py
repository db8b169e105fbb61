"""Continuous batching: a call of B rows decoded in S < B KV-cache rows ("slots").

`Sampler(decode_slots=S)` prefills a row when a slot frees and decodes every slot at its
own cache offset (`Decoder.hidden` with a per-row `cache_index`). The reference is the
lockstep program (every row its own cache row, all rows until the slowest ends): the same
tokens, stop reasons and lengths for the same key, log-probs within float rounding (the
matmuls run on S rows instead of B), fewer row-steps, a cache of S rows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config, decoder, sharding
from hgpo_jax.rollout import hiper
from hgpo_jax.rollout import params as rollout_params
from hgpo_jax.rollout import projection
from hgpo_jax.sampling import sampler
from hgpo_jax.sampling import SamplingParams

TEXTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
         "put a clean apple in the fridge", "look", "take apple 1 from countertop 1",
         "open the drawer", "examine the desk and the lamp on it", "inventory", "go to bed 1",
         "heat some egg and put it in the garbagecan", "clean the mug", "find two pillows",
         "cool a tomato"]


@pytest.fixture(scope="module")
def prompts(tok):
  return [tok.encode(t) for t in TEXTS]


def _same_samples(got, want, atol=1e-5):
  assert got.tokens == want.tokens
  assert got.stop_reason == want.stop_reason and got.texts == want.texts
  for x, y in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(x, y, atol=atol)
  assert got.decoded_tokens == want.decoded_tokens


PARAMS = {
    "sampled, stop string": SamplingParams(temperature=1.0, max_new_tokens=24,
                                                   stop_strings=("e ",)),
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=24),
    "top-k + top-p": SamplingParams(temperature=0.7, top_k=20, top_p=0.9,
                                            max_new_tokens=24),
}


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("slots,prefill_rows", [(4, 0), (8, 4), (2, 2)])
def test_slotted_decode_samples_what_lockstep_samples(model, tok, prompts, name, slots,
                                                      prefill_rows):
  """13 rows (batch bucket 16) in S slots, rows admitted one (prefill_rows 0) or
  prefill_rows at a time: the lockstep program's samples, in fewer row-steps."""
  params = PARAMS[name]
  kw = dict(prompt_buckets=(64,), batch_buckets=(16,), prefill_rows=prefill_rows)
  lockstep = sampler.Sampler(model, tok, **kw)
  slotted = sampler.Sampler(model, tok, decode_slots=slots, **kw)
  assert slotted.slots_for(16) == slots and slotted.slots_for(slots) == 0
  for seed in (0, 5):
    want = lockstep.generate(prompts, params, jax.random.key(seed))
    got = slotted.generate(prompts, params, jax.random.key(seed))
    _same_samples(got, want)
    # lockstep: 16 rows (3 of them padding) for the longest row's steps; slotted: S rows
    # per step (test_finished_rows_free_their_slots: fewer when lengths differ)
    assert want.decode_row_steps == 16 * max(len(t) for t in want.tokens)
    assert got.decoded_tokens <= got.decode_row_steps and got.decode_row_steps % slots == 0


def test_finished_rows_free_their_slots(model, tok, prompts):
  """Rows whose constrained responses have different, known lengths: lockstep runs all 16
  rows for the longest one; slots decode one token per live row and step while rows wait
  (here 1 row admitted at a time, so no slot waits), then the last rows' tail."""
  actions = ["look", "take apple 1 from countertop 1", "go to bed 1", "inventory"]
  allowed = [[actions[b % 4]] for b in range(13)]
  params = SamplingParams(temperature=1.0, max_new_tokens=24)
  kw = dict(prompt_buckets=(64,), batch_buckets=(16,))
  want = sampler.Sampler(model, tok, **kw).generate(prompts, params, jax.random.key(0),
                                                    allowed=allowed)
  got = sampler.Sampler(model, tok, decode_slots=4, **kw).generate(
      prompts, params, jax.random.key(0), allowed=allowed)
  _same_samples(got, want)
  lengths = [len(t) for t in want.tokens]
  assert len(set(lengths)) == 4 and want.decode_row_steps == 16 * max(lengths)
  # every step before the queue empties has its 4 slots live; after it, at most max(lengths)
  # steps of the last rows
  assert sum(lengths) <= got.decode_row_steps <= sum(lengths) + 4 * max(lengths)
  assert got.decode_row_steps < 0.75 * want.decode_row_steps


def test_slotted_decode_of_a_shared_prefill_copies_its_rows(model, tok, prompts):
  """A first turn (groups of one prompt, `share_prefill=G`): the slots take their rows'
  prefilled caches from the shared prefill; the samples are the lockstep program's."""
  rows = [prompts[0]] * 4 + [prompts[1]] * 4 + [prompts[2]] * 4 + [prompts[3]] * 4
  params = SamplingParams(temperature=1.0, max_new_tokens=16)
  kw = dict(prompt_buckets=(64,), batch_buckets=(4, 16), share_prefill=4)
  want = sampler.Sampler(model, tok, **kw).generate(rows, params, jax.random.key(2))
  slotted = sampler.Sampler(model, tok, decode_slots=4, **kw)
  calls = []
  program = slotted.generate_program
  slotted.generate_program = lambda m, *a, **s: calls.append(s) or program(m, *a, **s)
  got = slotted.generate(rows, params, jax.random.key(2))
  assert calls[0]["flags"].shared_prefill and calls[0]["flags"].slots == 4
  _same_samples(got, want)


def test_slotted_decode_walks_constraint_tries_and_free_spans(model, tok, prompts):
  """HiPER turns with free subgoals and a free search query: each slot reads its row's trie
  (the tables are gathered by row), so every response parses and equals lockstep's."""
  admissible = [["go to cabinet 1", "look"], ["search[<your query>]", "click[back to search]"],
                ["open fridge 1", "take apple 1 from countertop 1"]] * 3
  allowed = [hiper.constrained_responses(projection.free_query_actions(a, 3), "find it",
                                         b % 2 == 0, 4) for b, a in enumerate(admissible)]
  params = SamplingParams(temperature=1.0, max_new_tokens=96)
  kw = dict(prompt_buckets=(64,), batch_buckets=(16,))
  lockstep = sampler.Sampler(model, tok, **kw)
  slotted = sampler.Sampler(model, tok, decode_slots=4, **kw)
  for seed in (0, 1):
    want = lockstep.generate(prompts[:9], params, jax.random.key(seed), allowed=allowed,
                             constraint=hiper.RESPONSE_CONSTRAINT)
    got = slotted.generate(prompts[:9], params, jax.random.key(seed), allowed=allowed,
                           constraint=hiper.RESPONSE_CONSTRAINT)
    _same_samples(got, want)
    assert got.stop_reason == ["constraint"] * 9
    assert all(hiper.parse_response(t).valid for t in got.texts)


def test_slotted_decode_sharded_equals_unsharded(tok, prompts):
  """Slots split over a data=4 x tensor=2 mesh (8 fake devices): the unsharded samples."""
  cfg = config.get_preset("tiny")
  plain = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  sharded = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2, devices=fake_devices.take(8))
  sharding.shard_model(sharded, mesh)
  kw = dict(prompt_buckets=(64,), batch_buckets=(16,))
  want = sampler.Sampler(plain, tok, **kw).generate(
      prompts, PARAMS["sampled, stop string"], jax.random.key(4))
  dist = sampler.Sampler(sharded, tok, mesh=mesh, decode_slots=8, prefill_rows=4, **kw)
  got = dist.generate(prompts, PARAMS["sampled, stop string"], jax.random.key(4))
  _same_samples(got, want)
  with pytest.raises(ValueError, match=r"decode_slots=6 must be .* multiple of the mesh's "
                                       r"batch-parallel size 4"):
    sampler.Sampler(sharded, tok, mesh=mesh, decode_slots=6, **kw)


def test_slotted_program_holds_a_cache_of_its_slots(model, tok, prompts):
  """The compiled slotted program's temporaries are those of S cache rows and of one
  admitted row's prefill: smaller than the lockstep program's (B cache rows, B rows'
  prefill) by more than the 24 rows' cache (32 distinct prompts, 256 + 64 tokens)."""
  def temp_bytes(smp):
    seen = []
    program = smp.generate_program
    smp.generate_program = lambda m, *a, **s: seen.append((a, s)) or program(m, *a, **s)
    distinct = [p + tok.encode(f" {i}") for i, p in enumerate((prompts * 3)[:32])]
    smp.generate(distinct, SamplingParams(max_new_tokens=64), jax.random.key(0))
    args, static = seen[0]
    return program.lower(smp.model, *args, **static).compile().memory_analysis(
        ).temp_size_in_bytes

  kw = dict(prompt_buckets=(256,), batch_buckets=(32,))
  full = temp_bytes(sampler.Sampler(model, tok, **kw))
  slotted = temp_bytes(sampler.Sampler(model, tok, decode_slots=8, **kw))
  cfg = model.cfg
  row_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (256 + 63) * 4
  assert full - slotted >= 0.9 * (32 - 8) * row_bytes


def test_decoder_per_row_cache_index_reads_and_writes_each_rows_offset(model):
  """`Decoder.decode` with an int32[B] cache_index: row b writes its new key/value at its
  own slot and reads slots before it; the logits equal a teacher-forced forward."""
  cfg = model.cfg
  rng = np.random.RandomState(0)
  lengths = [3, 7, 5]
  seqs = [rng.randint(3, 100, size=n + 1) for n in lengths]
  cache = decoder.init_cache(cfg, 3, 12)
  for b, seq in enumerate(seqs):  # prefill row b's first n tokens into its own row
    one = decoder.init_cache(cfg, 1, lengths[b])
    _, one = model.prefill(jnp.asarray(seq[None, :-1]), jnp.arange(lengths[b])[None],
                           jnp.ones((1, lengths[b]), jnp.int32), one)
    cache = decoder.KVCache(k=cache.k.at[:, b, :, :lengths[b]].set(one.k[:, 0]),
                            v=cache.v.at[:, b, :, :lengths[b]].set(one.v[:, 0]))
  index = jnp.asarray(lengths, jnp.int32)
  last = jnp.asarray([[s[-1]] for s in seqs])
  logits, new = model.decode(last, index[:, None], cache, index)
  for b, seq in enumerate(seqs):
    n = len(seq)
    full, _ = model(jnp.asarray(seq[None]), jnp.arange(n)[None], jnp.ones((1, n), jnp.int32))
    np.testing.assert_allclose(logits[b, 0], full[0, -1], atol=1e-5)
    # its new key landed at its own slot; the slots after it are untouched
    assert not np.allclose(new.k[:, b, :, lengths[b]], 0)
    np.testing.assert_array_equal(new.k[:, b, :, lengths[b] + 1:], 0)
  # an index at the cache's end drops the write instead of clamping it onto the past
  end = jnp.asarray([12, 12, 12], jnp.int32)
  _, dropped = model.decode(last, end[:, None], cache, end)
  np.testing.assert_array_equal(dropped.k, cache.k)


def test_decode_slots_config_is_checked(model, tok):
  with pytest.raises(ValueError, match="decode_slots=-1 must be an int >= 0"):
    sampler.Sampler(model, tok, decode_slots=-1)
  with pytest.raises(ValueError, match="decode_slots must be >= 0"):
    rollout_params.RolloutParams(decode_slots=-2)
