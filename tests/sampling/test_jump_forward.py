"""Jump-forward decoding (`Sampler(jump_forward=K)`): a constrained row's forced tokens are
fed up to K per decode step and scored from that step's logits.

The reference is the one-token lockstep loop (`jump_forward=0`) on the same sampler
settings: in float32 the two programs differ only in the shapes of the same products, so
every row's tokens, stop reason and length are equal and its log-probs (forced tokens'
included) agree to round-off, while the loop runs fewer steps. Cases: whole-trie
constraints (shared prefixes, one allowed action, free spans, rows left free), LoRA,
greedy, top-k/top-p, a response cut by max_new_tokens inside a forced run, per-layer
decode weights and cache, K = 1 and 3, and rows split over a mesh. The forced tables are
checked on a hand trie.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config, decoder, loading, lora, sharding
from hgpo_jax.rollout import params as rollout_params
from hgpo_jax.sampling import SamplingParams, constrained, inputs, jump_forward, sampler, types

TEXTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
         "put a clean apple in the fridge", "look", "take apple 1 from countertop 1",
         "open the drawer"]
ACTIONS = ["look", "go to bed 1", "go to cabinet 2", "go to cabinet 10",
           "take apple 1 from countertop 1", "inventory"]
KW = dict(prompt_buckets=(64,), batch_buckets=(8,))


def _equal(got, want):
  assert got.tokens == want.tokens
  assert got.stop_reason == want.stop_reason
  assert got.texts == want.texts
  for a, b in zip(got.logprobs, want.logprobs):
    assert len(a) == len(b)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def prompts(tok):
  return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def samplers(model, tok):
  """(one-token, jump-forward K=4) samplers of the tiny model."""
  return sampler.Sampler(model, tok, **KW), sampler.Sampler(model, tok, jump_forward=4, **KW)


@pytest.mark.parametrize("case", ["actions", "one_action", "some_rows_free", "greedy",
                                  "filtered", "cut"])
def test_jump_forward_samples_what_the_one_token_loop_samples(samplers, prompts, case):
  one, jump = samplers
  allowed = [ACTIONS] * len(prompts)
  params = SamplingParams(temperature=1.0, max_new_tokens=32, stop_strings=("e ",))
  if case == "one_action":
    allowed = [["take apple 1 from countertop 1"]] + [ACTIONS] * (len(prompts) - 1)
  elif case == "some_rows_free":
    allowed = [ACTIONS, [], ACTIONS, [], ACTIONS, ACTIONS]
  elif case == "greedy":
    params = SamplingParams(temperature=0.0, max_new_tokens=32)
  elif case == "filtered":
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=32)
  elif case == "cut":  # whole-trie rows must fit: cut the free rows inside their budget
    allowed = [[], [], [], [], ACTIONS, ACTIONS]
    params = SamplingParams(temperature=1.0, max_new_tokens=9)
  steps = []
  for seed in (0, 3, 7):
    want = one.generate(prompts, params, jax.random.key(seed), allowed=allowed)
    got = jump.generate(prompts, params, jax.random.key(seed), allowed=allowed)
    _equal(got, want)
    steps.append((got.decode_row_steps, want.decode_row_steps))
  if case not in ("some_rows_free", "cut"):
    # Every row constrained: the root's `<action>` run alone saves steps.
    assert all(g < w for g, w in steps), steps


def test_one_allowed_action_is_written_before_the_first_step_and_scored_in_it(samplers,
                                                                               prompts, tok):
  one, jump = samplers
  allowed = [["take apple 1 from countertop 1"]] * 2
  params = SamplingParams(temperature=1.0, max_new_tokens=32)
  want = one.generate(prompts[:2], params, jax.random.key(1), allowed=allowed)
  got = jump.generate(prompts[:2], params, jax.random.key(1), allowed=allowed)
  _equal(got, want)
  assert got.texts == ["<action>take apple 1 from countertop 1</action>"] * 2
  n = len(got.tokens[0])
  # one-token: a step per token. K = 4: the root's run of 4 before the first step, then
  # per step one masked draw and a run of 4, then a step that only scores the last run.
  assert want.decode_row_steps == 8 * n
  assert got.decode_row_steps == 8 * (-(-(n - 4) // 5) + 1)
  assert all(np.all(np.asarray(lp) < 0) for lp in got.logprobs)


@pytest.mark.parametrize("k", [1, 3])
def test_jump_forward_with_lora_per_layer_and_other_k(model, tok, prompts, k):
  adapted = loading.with_lora(decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(0)),
                              lora.LoraConfig(rank=4, alpha=8.0), seed=0)
  leaves, treedef = jax.tree.flatten(nnx.state(adapted, nnx.Param))
  nnx.update(adapted, jax.tree.unflatten(treedef, [
      x + 0.05 * jax.random.normal(jax.random.key(i), x.shape, x.dtype)
      for i, x in enumerate(leaves)]))
  allowed = [ACTIONS] * len(prompts)
  params = SamplingParams(temperature=1.0, max_new_tokens=32)
  for layers in ("auto", "per_layer"):
    one = sampler.Sampler(adapted, tok, decode_layers=layers, **KW)
    jump = sampler.Sampler(adapted, tok, decode_layers=layers, jump_forward=k, **KW)
    assert jump.engine.layered_cache == (layers == "per_layer")
    for seed in (0, 2):
      _equal(jump.generate(prompts, params, jax.random.key(seed), allowed=allowed),
             one.generate(prompts, params, jax.random.key(seed), allowed=allowed))


@pytest.mark.parametrize("case", ["actions", "one_action"])
def test_a_call_without_log_probs_ends_before_the_step_that_only_scores(samplers, prompts,
                                                                         case):
  """`need_logprobs=False` (an evaluation): the same program and draws, so the tokens,
  texts, stop reasons and every log-prob it computed equal the scoring call's bit for bit;
  the rows that got their tokens in the last step keep their final forced run (the tokens
  after their last draw) unscored, NaN (rows that ended earlier are scored by the steps the
  others still need), and the call runs one step fewer: the slowest rows' scoring step."""
  _, jump = samplers
  allowed = [ACTIONS] * len(prompts)
  if case == "one_action":  # every token forced: the root run and runs of K after draws
    allowed = [["take apple 1 from countertop 1"]] * len(prompts)
  params = SamplingParams(temperature=1.0, max_new_tokens=32)
  unscored = dataclasses.replace(params, need_logprobs=False)
  for seed in (0, 3, 7):
    want = jump.generate(prompts, params, jax.random.key(seed), allowed=allowed)
    got = jump.generate(prompts, unscored, jax.random.key(seed), allowed=allowed)
    assert (got.tokens, got.texts, got.stop_reason) == (want.tokens, want.texts,
                                                        want.stop_reason)
    assert got.decode_row_steps == want.decode_row_steps - 8  # one step of the 8-row bucket
    tails = []
    for a, b in zip(got.logprobs, want.logprobs):
      nan = np.isnan(a)
      tails.append(int(nan.sum()))
      assert tails[-1] <= 4 and nan[len(a) - tails[-1]:].all()  # a suffix of <= K tokens
      np.testing.assert_array_equal(a[~nan], b[~nan])
      assert np.all(np.isfinite(b))
    assert max(tails) >= 1


def test_jump_forward_with_free_spans(samplers, prompts):
  one, jump = samplers
  span = constrained.FreeSpan(3, "]")
  allowed = [[("search[", span, "]"), "click[next >]", "look"]] * len(prompts)
  params = SamplingParams(temperature=1.0, max_new_tokens=32)
  for seed in (0, 4):
    _equal(jump.generate(prompts, params, jax.random.key(seed), allowed=allowed),
           one.generate(prompts, params, jax.random.key(seed), allowed=allowed))


def test_jump_forward_sharded_equals_unsharded(tok, prompts):
  """Rows split over a data=4 x tensor=2 mesh (8 fake devices), the cache written per row
  on each device: the unsharded one-token samples."""
  cfg = config.get_preset("tiny")
  plain = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  sharded = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2, devices=fake_devices.take(8))
  sharding.shard_model(sharded, mesh)
  allowed = [ACTIONS] * len(prompts)
  params = SamplingParams(temperature=1.0, max_new_tokens=32)
  want = sampler.Sampler(plain, tok, **KW).generate(prompts, params, jax.random.key(4),
                                                    allowed=allowed)
  got = sampler.Sampler(sharded, tok, mesh=mesh, jump_forward=3, **KW).generate(
      prompts, params, jax.random.key(4), allowed=allowed)
  _equal(got, want)


def test_unconstrained_calls_keep_the_one_token_program(samplers, prompts):
  one, jump = samplers
  params = SamplingParams(temperature=1.0, max_new_tokens=12)
  got = jump.generate(prompts, params, jax.random.key(0))
  want = one.generate(prompts, params, jax.random.key(0))
  assert got.tokens == want.tokens
  for a, b in zip(got.logprobs, want.logprobs):
    np.testing.assert_array_equal(a, b)  # the same program: bit for bit
  assert got.decode_row_steps == want.decode_row_steps


def test_forced_tables_and_runs_on_a_hand_trie():
  # row 0: "a b c" and "a b d": root -a-> 1 -b-> 2, 2 has two edges (c, d) -> 3, 4
  # row 1: "e f" and "e": node 1 is terminal (EOS allowed), so not forced
  tries = constrained.build_tries([[[5, 6, 7], [5, 6, 8]], [[9, 10], [9]]], 2)
  arrays = inputs.TrieArrays.of(tries)
  arrays = jax.tree.map(jnp.asarray, arrays)
  token_bn, child_bn = jump_forward.forced_edges(arrays)
  assert token_bn[0, :5].tolist() == [5, 6, -1, -1, -1]
  assert child_bn[0, :2].tolist() == [1, 2]
  assert token_bn[1, :3].tolist() == [9, -1, -1]
  zeros = jnp.zeros((2,), jnp.int32)
  go = jnp.array([True, True])
  toks, count, node, reason = jump_forward.forced_run(
      (token_bn, child_bn), arrays, zeros, zeros, go, steps=3, max_new_tokens=8)
  assert toks.tolist() == [[5, 6, 0], [9, 0, 0]]
  assert count.tolist() == [2, 1] and node.tolist() == [2, 1] and reason.tolist() == [0, 0]
  # the budget: token index 1 is the last one (M = 2), so the run ends there by LENGTH
  toks, count, node, reason = jump_forward.forced_run(
      (token_bn, child_bn), arrays, zeros, zeros, go, steps=3, max_new_tokens=2)
  assert count.tolist() == [2, 1] and reason.tolist() == [types.LENGTH, 0]
  # a run that reaches a leaf ends with CONSTRAINT: row 0 from node 2 has two edges, none
  tries1 = constrained.build_tries([[[5, 6]]], 1)
  arrays1 = jax.tree.map(jnp.asarray, inputs.TrieArrays.of(tries1))
  forced1 = jump_forward.forced_edges(arrays1)
  toks, count, node, reason = jump_forward.forced_run(
      forced1, arrays1, jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int32),
      jnp.array([True]), steps=4, max_new_tokens=8)
  assert toks.tolist() == [[5, 6, 0, 0]] and count.tolist() == [2]
  assert reason.tolist() == [types.CONSTRAINT]


def test_bad_jump_forward_settings_are_refused(model, tok):
  with pytest.raises(ValueError, match="jump_forward=-1 must be an int >= 0"):
    sampler.Sampler(model, tok, jump_forward=-1, **KW)
  with pytest.raises(ValueError, match="lockstep decoding only"):
    sampler.Sampler(model, tok, jump_forward=2, decode_slots=4, **KW)
  with pytest.raises(ValueError, match="lockstep decoding only"):
    rollout_params.RolloutParams(jump_forward=2, decode_slots=4)
  with pytest.raises(ValueError, match="jump_forward must be >= 0"):
    rollout_params.RolloutParams(jump_forward=-1)
