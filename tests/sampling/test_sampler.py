"""The jit sampler against readable references on the tiny random-weight decoder.

References: a no-cache greedy loop that recomputes the whole sequence per token, a
teacher-forced forward pass (causal + pad mask) for the log-probs, a numpy top-k/top-p,
and a scripted model (logits that spell a fixed text) for stop strings, EOS and lengths.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config, decoder, sharding
from hgpo_jax.sampling import constrained
from hgpo_jax.sampling import engine as engine_lib
from hgpo_jax.sampling import sampler
from hgpo_jax.sampling import SamplingParams
from hgpo_jax.sampling import logits as logits_lib

PROMPTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
           "<|im_start|>user\nput a clean apple in the fridge<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smp(model, tok):
  return sampler.Sampler(model, tok, prompt_buckets=(16, 32), batch_buckets=(4, 8))


@pytest.fixture(scope="module")
def prompts(tok):
  ids = [tok.encode(p) for p in PROMPTS]
  assert len({len(p) for p in ids}) == 3 and max(len(p) for p in ids) <= 32
  return ids


def _teacher_forced_logits(model, prompt_ids, response_ids):
  """f32[len(response), V] per row: the logits that predict each response token (one
  no-cache forward over left-padded prompt+response)."""
  seqs = [list(p) + list(r) for p, r in zip(prompt_ids, response_ids)]
  width = max(len(s) for s in seqs)
  tokens = np.zeros((len(seqs), width), np.int32)
  input_mask = np.zeros((len(seqs), width), bool)
  for b, s in enumerate(seqs):
    tokens[b, width - len(s):] = s
    input_mask[b, width - len(s):] = True
  positions = np.maximum(np.cumsum(input_mask, axis=1) - 1, 0).astype(np.int32)
  logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(input_mask))
  logits = np.asarray(logits)
  return [logits[b, width - len(r) - 1:width - 1] for b, r in enumerate(response_ids)]


def _teacher_forced_logprobs(model, prompt_ids, response_ids):
  """log p(response token) from one no-cache forward over left-padded prompt+response."""
  out = []
  for logits, r in zip(_teacher_forced_logits(model, prompt_ids, response_ids), response_ids):
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    out.append(np.array([logp[i, t] for i, t in enumerate(r)], np.float32))
  return out


@jax.jit
def _forward_no_cache(model, tokens_bt, input_mask_bt):
  positions_bt = jnp.broadcast_to(jnp.arange(tokens_bt.shape[1]), tokens_bt.shape)
  return model(tokens_bt, positions_bt, input_mask_bt)[0]


def _greedy_no_cache(model, prompt, n, width=48):
  """Recomputes the whole (right-padded, fixed-width) sequence for every new token."""
  seq = list(prompt)
  for _ in range(n):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(seq)] = seq
    mask = np.arange(width)[None] < len(seq)
    logits = _forward_no_cache(model, jnp.asarray(tokens), jnp.asarray(mask))
    seq.append(int(jnp.argmax(logits[0, len(seq) - 1])))
  return seq[len(prompt):]


def test_greedy_kv_cache_equals_no_cache_recompute(smp, model, prompts):
  out = smp.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=10),
                     jax.random.key(0))
  assert out.stop_reason == ["length"] * 3  # random weights: EOS has probability ~1/512
  for prompt, got in zip(prompts, out.tokens):
    assert got == _greedy_no_cache(model, prompt, 10)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 20, 0.9)])
def test_logprobs_equal_teacher_forced_forward(smp, model, prompts, temperature, top_k, top_p):
  params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                  max_new_tokens=12)
  out = smp.generate(prompts, params, jax.random.key(3))
  want = _teacher_forced_logprobs(model, prompts, out.tokens)
  for got, ref, toks in zip(out.logprobs, want, out.tokens):
    assert got.shape == (len(toks),) and got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_seeded_sampling_is_deterministic_and_depends_on_rng(smp, prompts):
  params = SamplingParams(temperature=1.0, max_new_tokens=12)
  a = smp.generate(prompts, params, jax.random.key(7))
  b = smp.generate(prompts, params, jax.random.key(7))
  c = smp.generate(prompts, params, jax.random.key(8))
  assert a.tokens == b.tokens
  assert a.tokens != c.tokens


def test_row_sample_is_independent_of_batch_bucket(smp, prompts):
  params = SamplingParams(temperature=1.0, max_new_tokens=8)
  three = smp.generate(prompts, params, jax.random.key(1))
  five = smp.generate(prompts + [prompts[0]] * 2, params, jax.random.key(1))  # bucket 8
  assert five.tokens[:3] == three.tokens


def test_top_k_1_equals_greedy(smp, prompts):
  greedy = smp.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8),
                        jax.random.key(0))
  top1 = smp.generate(prompts, SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8),
                      jax.random.key(5))
  assert top1.tokens == greedy.tokens


def _filter_reference(logits, temperature, top_k, top_p):
  """numpy: temperature, keep top-k, then the smallest prefix with mass >= top_p."""
  x = logits / temperature
  order = np.argsort(-x, kind="stable")
  keep = np.zeros_like(x, bool)
  k = len(x) if top_k == 0 else top_k
  probs = np.exp(x[order[:k]] - x[order[0]])
  probs /= probs.sum()
  mass = 0.0
  for rank in range(k):
    keep[order[rank]] = True
    mass += probs[rank]
    if mass >= top_p:
      break
  return np.where(keep, x, -np.inf)


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.5), (10, 0.8), (0, 1e-6)])
def test_filter_logits_matches_numpy_reference(top_k, top_p):
  logits = np.random.default_rng(0).normal(size=(4, 50)).astype(np.float32) * 3
  got = np.asarray(logits_lib.filter_logits(jnp.asarray(logits), 0.7, jnp.int32(top_k),
                                         jnp.float32(top_p)))
  for row_got, row in zip(got, logits):
    want = _filter_reference(row.astype(np.float64), 0.7, top_k, top_p)
    np.testing.assert_array_equal(np.isfinite(row_got), np.isfinite(want))
    np.testing.assert_allclose(row_got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)


class ScriptedModel(nnx.Module):
  """Logits that spell `script[b]` after the prompt: the token at position n_b - 1 + j
  (n_b = prompt length) predicts script[b, j] with a margin of 30 nats."""

  def __init__(self, cfg, script_bm, prompt_lengths_b):
    self.cfg = cfg
    self.script = nnx.Variable(jnp.asarray(script_bm, jnp.int32))
    self.offset = nnx.Variable(jnp.asarray(prompt_lengths_b, jnp.int32) - 1)

  def hidden(self, tokens_bt, positions_bt, segment_ids_bt, cache=None, cache_index=None):
    return jnp.zeros(tokens_bt.shape + (self.cfg.hidden_dim,)), cache

  def __call__(self, tokens_bt, positions_bt, segment_ids_bt, cache=None, cache_index=None):
    script = self.script[...]
    b = tokens_bt.shape[0]
    step_bt = jnp.clip(positions_bt - self.offset[...][:b, None], 0, script.shape[1] - 1)
    target_bt = jnp.take_along_axis(script[:b], step_bt, axis=1)
    logits = 30.0 * jax.nn.one_hot(target_bt, self.cfg.vocab_size)
    return logits, cache

  def prefill(self, tokens_bt, positions_bt, segment_ids_bt, cache):
    return self.hidden(tokens_bt, positions_bt, segment_ids_bt, cache)

  def for_decoding(self):
    return self  # no output layer to cast (`Decoder.for_decoding`)

  def decode(self, tokens_bt, positions_bt, cache, cache_index):
    return self(tokens_bt, positions_bt, jnp.ones_like(positions_bt), cache, cache_index)


def _scripted_sampler(tok, texts_or_ids, prompts):
  rows = [tok.encode(t) if isinstance(t, str) else list(t) for t in texts_or_ids]
  width = max(len(r) for r in rows) + 4
  script = np.full((4, width), tok.encode(" x")[0], np.int32)  # filler after the script
  for b, r in enumerate(rows):
    script[b, :len(r)] = r
  lengths = [len(p) for p in prompts] + [1] * (4 - len(prompts))
  scripted = ScriptedModel(config.get_preset("tiny"), script, lengths)
  return sampler.Sampler(scripted, tok, prompt_buckets=(16, 32), batch_buckets=(4,))


def test_stop_strings_eos_and_length(tok, prompts):
  eos = tok.eos_ids[0]
  script = ["I think.</action> more", tok.encode("Done") + [eos] + tok.encode("tail"),
            "x</action>. and more"]
  smp = _scripted_sampler(tok, script, prompts)
  params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_strings=("</action>",))
  out = smp.generate(prompts, params, jax.random.key(0))
  # "</action>" is three tokens ('</', 'action', '>'): the stop is detected across them.
  assert tok.encode("</action>") == [483, 389, 65]
  assert out.texts == ["I think.</action>", "Done", "x</action>"]
  assert out.stop_reason == ["stop_string", "eos", "stop_string"]
  assert out.tokens[0] == tok.encode("I think.</action>")
  assert out.tokens[1] == tok.encode("Done") + [eos]  # EOS is part of the response tokens
  assert out.tokens[2] == tok.encode("x</action>.")  # the token '>.' runs past the stop string
  assert [len(lp) for lp in out.logprobs] == [len(t) for t in out.tokens]
  # The margin is 30 nats, so each scripted token has log-prob ~ -V·e^-30.
  assert all(np.all(lp > -1e-6) for lp in out.logprobs)

  short = smp.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=3),
                       jax.random.key(0))
  assert short.stop_reason == ["length", "length", "length"]
  assert [len(t) for t in short.tokens] == [3, 3, 3]
  assert short.tokens[0] == tok.encode("I think.</action>")[:3]

  ignoring = smp.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6,
                                                          ignore_eos=True), jax.random.key(0))
  assert ignoring.stop_reason[1] == "length"
  assert ignoring.tokens[1] == (tok.encode("Done") + [eos] + tok.encode("tail"))[:6]


def test_constrained_whole_response_only_produces_allowed_strings(smp, prompts):
  allowed = [["go to cabinet 1", "open fridge 1", "take apple 1 from countertop 1"],
             ["look"], ["examine mug 1", "examine mug 10", "inventory"]]
  params = SamplingParams(temperature=1.0, max_new_tokens=24)
  seen = set()
  for seed in range(6):
    out = smp.generate(prompts, params, jax.random.key(seed), allowed=allowed)
    for text, reason, options in zip(out.texts, out.stop_reason, allowed):
      assert reason == "constraint"
      assert text in {f"<action>{a}</action>" for a in options}
      seen.add(text)
  assert "<action>look</action>" in seen and len(seen) >= 4  # several strings are reached
  # Greedy with a single allowed string produces it exactly.
  single = smp.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24),
                        jax.random.key(0), allowed=[["heat egg 1 with microwave 1"]] * 3)
  assert single.texts == ["<action>heat egg 1 with microwave 1</action>"] * 3


def test_a_row_whose_actions_cannot_fit_in_max_new_tokens_is_refused(smp, tok, prompts):
  """A row whose every allowed action needs more than max_new_tokens could only produce a
  truncated, invalid action (a WebShop-mini search of up to 51 tokens at 32 did): refused."""
  action = "take apple 1 from countertop 1"
  need = len(tok.encode(f"<action>{action}</action>"))
  short = SamplingParams(temperature=1.0, max_new_tokens=need - 1)
  with pytest.raises(ValueError, match=rf"no allowed action fits in max_new_tokens={need - 1}: "
                                       rf"the shortest, '{action}', needs {need} tokens"):
    smp.generate(prompts, short, jax.random.key(0), allowed=[["look"], [action], ["look"]])
  # With a shorter action in the row, the row can still act.
  out = smp.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=need - 1),
                     jax.random.key(0), allowed=[["look", action]] * 3)
  assert all(r in ("constraint", "length") for r in out.stop_reason)
  out = smp.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=need),
                     jax.random.key(0), allowed=[[action]] * 3)
  assert out.texts == [f"<action>{action}</action>"] * 3


def test_constrained_logprobs_are_raw_model_logprobs(smp, model, prompts):
  allowed = [["go to cabinet 1", "open fridge 1"], [], ["look"]]  # row 1 is left free
  out = smp.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12),
                     jax.random.key(2), allowed=allowed)
  assert out.stop_reason[0] == out.stop_reason[2] == "constraint"
  assert out.stop_reason[1] == "length"
  want = _teacher_forced_logprobs(model, prompts, out.tokens)
  for got, ref in zip(out.logprobs, want):
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_response_choices_are_the_sets_the_sampler_chose_from(smp, model, tok, prompts):
  """`constrained.response_choices` (host) names the tokens the device step allowed: every
  sampled token is in its set, and greedy decoding takes the set's most likely token
  under the teacher-forced logits (the learner's constrained log-softmax runs over it)."""
  allowed = [["go to cabinet 1", "open fridge 1", "take apple 1 from countertop 1"],
             ["examine mug 1", "examine mug 10", "look"], ["look", "inventory"]]
  for constraint in (constrained.ActionConstraint(), constrained.ActionConstraint("", "")):
    sequences = [constrained.constrained_token_sequences(a, constraint, tok.encode)
                 for a in allowed]
    for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
      out = smp.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=24),
                         jax.random.key(seed), allowed=allowed, constraint=constraint)
      logits = _teacher_forced_logits(model, prompts, out.tokens)
      for row, (seqs, tokens) in enumerate(zip(sequences, out.tokens)):
        choices = constrained.response_choices(seqs, tokens, tok.eos_ids)
        assert len(choices) == len(tokens) and all(choices)
        for j, (token, ids) in enumerate(zip(tokens, choices)):
          assert token in ids
          if temperature == 0.0:
            assert token == ids[int(np.argmax(logits[row][j][list(ids)]))]


def test_no_recompilation_within_a_bucket(model, tok, prompts):
  smp = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4, 8))
  params = SamplingParams(temperature=1.0, max_new_tokens=8)
  smp.generate(prompts, params, jax.random.key(0))
  count = smp.num_compilations
  assert count == 1
  # Other prompt lengths and batch size in the same buckets, other temperature and seed.
  smp.generate([prompts[2], prompts[0]], SamplingParams(temperature=0.4, max_new_tokens=8),
               jax.random.key(1))
  smp.generate(prompts + [[5, 6, 7]], params, jax.random.key(2))
  assert smp.num_compilations == count
  # Repeated prompts share a prefill: one program per (unique-prompt bucket, batch bucket).
  smp.generate(prompts + [prompts[0]], params, jax.random.key(2))
  smp.generate([prompts[1], prompts[1], prompts[2]], params, jax.random.key(3))
  assert smp.num_compilations == count + 1
  smp.generate(prompts * 2, params, jax.random.key(2))  # batch bucket 8 (shared): new program
  assert smp.num_compilations == count + 2


def test_shared_prefill_equals_one_prefill_per_row(model, tok, prompts):
  """Rows with the same prompt prefilled once (their cache rows copied) sample what rows
  prefilled one by one sample: same tokens, log-probs equal up to float reordering."""
  rows = [prompts[0], prompts[1], prompts[0], prompts[0], prompts[2], prompts[1]]
  params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
  out = {share: sampler.Sampler(model, tok, prompt_buckets=(32,), share_prefill=share).generate(
      rows, params, jax.random.key(4)) for share in (True, False)}
  assert out[True].tokens == out[False].tokens
  for a, b in zip(out[True].logprobs, out[False].logprobs):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)  # ~100x the f32 round-off of a logit
  # the rows of one prompt still draw their own samples (per-row keys)
  assert len({tuple(out[True].tokens[i]) for i in (0, 2, 3)}) > 1


def test_a_group_sized_share_viewed_as_sharing_every_identical_prompt(model, tok, prompts):
  """`sharing_identical_prompts`: a sampler with `share_prefill=G` (which shares only what
  fits in ceil(rows / G) rows) viewed with `share_prefill=True` prefills a call's distinct
  prompts once each, in their batch bucket, on the same model and programs, and samples
  what the group-sized sampler samples; samplers that share all or nothing are their own
  view."""
  rows = [prompts[0], prompts[1], prompts[0], prompts[2], prompts[1], prompts[0]]
  params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
  grouped = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(1, 2, 4, 8),
                            share_prefill=4)
  view = grouped.sharing_identical_prompts()
  assert view is not grouped and view.share_prefill is True and grouped.share_prefill == 4
  assert view.model is grouped.model and view.generate_program is grouped.generate_program
  rng = jax.random.key(3)
  # 3 distinct prompts of 6 rows (bucket 8): 8 / 4 = 2 prefill rows for the group-sized
  # share, too few, so it prefills all 8; the view prefills the 3 in the bucket of 4
  assert grouped.pack(rows, params, rng)[0].prefill_tokens.shape[0] == 8
  assert view.pack(rows, params, rng)[0].prefill_tokens.shape[0] == 4
  a, b = grouped.generate(rows, params, rng), view.generate(rows, params, rng)
  assert a.tokens == b.tokens
  for x, y in zip(a.logprobs, b.logprobs):
    np.testing.assert_allclose(x, y, rtol=0, atol=1e-5)
  for share in (True, False):
    s = sampler.Sampler(model, tok, prompt_buckets=(32,), share_prefill=share)
    assert s.sharing_identical_prompts() is s


def test_sharded_equals_unsharded(tok, prompts):
  cfg = config.get_preset("tiny")
  plain = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  sharded = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2, devices=fake_devices.take(8))
  sharding.shard_model(sharded, mesh)
  ref = sampler.Sampler(plain, tok, prompt_buckets=(32,), batch_buckets=(4,))
  dist = sampler.Sampler(sharded, tok, prompt_buckets=(32,), batch_buckets=(4,), mesh=mesh)
  for params in (SamplingParams(temperature=0.0, max_new_tokens=8),
                 SamplingParams(temperature=1.0, max_new_tokens=8)):
    a = ref.generate(prompts, params, jax.random.key(4))
    b = dist.generate(prompts, params, jax.random.key(4))
    assert a.tokens == b.tokens
    for x, y in zip(a.logprobs, b.logprobs):
      np.testing.assert_allclose(x, y, atol=1e-5)


def _decode_program_text(smp, prompts, params) -> str:
  """The compiled generate program of `smp.generate(prompts, params, ...)`, as HLO text."""
  program, seen = smp.generate_program, []

  def record(*args, **kwargs):
    seen.append((args, kwargs))
    return program(*args, **kwargs)
  smp.generate_program = record
  try:
    out = smp.generate(prompts, params, jax.random.key(4))
  finally:
    smp.generate_program = program
  args, kwargs = seen[-1]
  return out, program.lower(*args, **kwargs).compile().as_text()


def test_fsdp_sampler_gathers_rows_not_the_output_layer(tok, prompts, monkeypatch):
  """On a mesh whose fsdp axis splits both the rows and the output layer's D (data=1 x
  fsdp=2 x tensor=2), a decode step gathers the rows' hidden states, not the tied
  embedding's [V/tensor, D] block (`Decoder.decode_logits`), and samples what the unsharded
  sampler samples. The same program with plain `logits` does gather that block: the check
  sees the regression it guards against."""
  cfg = config.get_preset("tiny")
  plain = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  sharded = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=fake_devices.take(4))
  sharding.shard_model(sharded, mesh)
  params = SamplingParams(temperature=1.0, max_new_tokens=8)
  gathered_block = rf"f32\[{cfg.vocab_size // 2},{cfg.hidden_dim}\]\S* all-gather\("
  ref = sampler.Sampler(plain, tok, prompt_buckets=(32,), batch_buckets=(4,))
  a = ref.generate(prompts, params, jax.random.key(4))
  dist = sampler.Sampler(sharded, tok, prompt_buckets=(32,), batch_buckets=(4,), mesh=mesh)
  b, text = _decode_program_text(dist, prompts, params)
  assert a.tokens == b.tokens
  for x, y in zip(a.logprobs, b.logprobs):
    np.testing.assert_allclose(x, y, atol=1e-5)
  import re
  assert not re.search(gathered_block, text)
  assert re.search(rf"f32\[4,1,{cfg.vocab_size // 2}\]\S* all-reduce\(", text)  # partial logits
  monkeypatch.setattr(decoder.Decoder, "decode_logits", decoder.Decoder.logits)
  dist = sampler.Sampler(sharded, tok, prompt_buckets=(32,), batch_buckets=(4,), mesh=mesh)
  assert re.search(gathered_block, _decode_program_text(dist, prompts, params)[1])


def test_for_decoding_casts_what_each_step_casts_and_keeps_the_logits():
  """`Decoder.for_decoding` under bf16 compute over float32 parameters: the tied embedding
  and the layers' projections become bf16 (cast once per call), the norms' scales stay
  float32, and the decode logits are bitwise the ones the float32-stored decoder computes
  (each step casts those weights to bf16 anyway); under float32 compute it is the decoder
  itself."""
  cfg = dataclasses.replace(config.get_preset("tiny"), dtype="bfloat16")
  model = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  view = model.for_decoding()
  assert model.embed[...].dtype == jnp.float32 and view.embed[...].dtype == jnp.bfloat16
  assert view.final_norm[...].dtype == jnp.float32
  cast = {n: w.dtype for n, w in view.layers.stacked().items()}
  assert cast == {n: jnp.float32 if n.endswith("norm") else jnp.bfloat16
                  for n in model.layers.stacked()}, cast
  cache = decoder.init_cache(cfg, 2, 8, jnp.float32)
  tokens, positions = jnp.array([[3], [7]]), jnp.array([[0], [0]])
  want, _ = model.decode(tokens, positions, cache, 0)
  got, _ = view.decode(tokens, positions, cache, 0)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert view.for_decoding() is view
  plain = decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(1))
  assert plain.for_decoding() is plain


def test_an_unrolled_decode_layer_loop_computes_the_scanned_one(monkeypatch):
  """On accelerators the decode step's layer loop is unrolled (`decoder.decode_layer_unroll`:
  all layers on GPUs and TPUs, 1 on CPUs); forced on a CPU, the unrolled step gives the
  scanned step's logits and cache."""
  class Device:
    def __init__(self, platform):
      self.platform = platform
  cfg = config.get_preset("tiny")
  for accelerator in ("gpu", "cuda", "tpu"):
    assert decoder.decode_layer_unroll(cfg, [Device(accelerator)]) == cfg.num_layers
  assert decoder.decode_layer_unroll(cfg, jax.devices()) == 1
  model = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  cache = decoder.init_cache(cfg, 2, 8, jnp.float32)
  cache = decoder.KVCache(k=jax.random.normal(jax.random.key(0), cache.k.shape),
                          v=jax.random.normal(jax.random.key(1), cache.v.shape))
  tokens, positions = jnp.array([[3], [7]]), jnp.array([[4], [2]])
  step = jax.jit(lambda m, c: m.decode(tokens, positions, c, 4))
  want = step(model, cache)
  monkeypatch.setattr(decoder, "decode_layer_unroll", lambda cfg, target: cfg.num_layers)
  got = jax.jit(lambda m, c: m.decode(tokens, positions, c, 4))(model, cache)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_on_accelerators_the_decode_step_reads_per_layer_weights_and_one_gate_up(monkeypatch):
  """`decoder.per_layer_decode_weights` (GPU and TPU targets): `for_decoding` gives every layer's
  weights their own arrays, stacks each layer's gate and up into one gate_up [2, F, D] and
  concatenates q, k and v into one qkv [H + 2 Hkv, Dh, D] (the separate ones dropped), and
  the decode step (a Python loop over the layers) gives
  the stacked scan's logits and cache; `stacked()` of that view restacks them for a
  prefill. CPU targets keep the stacked weights. Forced on a CPU, with and
  without Qwen2's q/k/v biases (one qkv_bias); gate_up is not made when F is split over
  the mesh (tensor=2), nor qkv when the heads are."""
  class Device:
    def __init__(self, platform):
      self.platform = platform
  cfg = config.get_preset("tiny")
  chosen = decoder.per_layer_decode_weights
  assert all(chosen(cfg, [Device(p)]) for p in ("gpu", "cuda", "tpu"))
  assert not chosen(cfg, [Device("cpu")]) and not chosen(cfg, jax.devices())
  cache = decoder.init_cache(cfg, 2, 8, jnp.float32)
  cache = decoder.KVCache(k=jax.random.normal(jax.random.key(0), cache.k.shape),
                          v=jax.random.normal(jax.random.key(1), cache.v.shape))
  tokens, positions = jnp.array([[3], [7]]), jnp.array([[4], [2]])
  step = jax.jit(lambda m, c: m.for_decoding().decode(tokens, positions, c, 4))
  models = [decoder.Decoder(c, rngs=nnx.Rngs(1)) for c in (cfg, cfg.replace(qkv_bias=True))]
  assert models[0].for_decoding() is models[0]  # f32 over f32 weights, a CPU: nothing to do
  wants = [step(m, cache) for m in models]
  monkeypatch.setattr(decoder, "per_layer_decode_weights", lambda cfg, target: True)
  h, kv = cfg.num_heads, cfg.num_kv_heads
  for model, want in zip(models, wants):
    view = model.for_decoding()
    per_layer = view.layers.unstacked()
    assert len(per_layer) == cfg.num_layers
    names = set(per_layer[0])
    assert {"gate_up", "qkv"} <= names and not names & {"gate", "up", "q", "k", "v"}, names
    np.testing.assert_array_equal(np.asarray(per_layer[1]["gate_up"][1]),
                                  np.asarray(model.layers.up[...][1]))
    stacked = view.layers.stacked()  # restacked for a prefill
    np.testing.assert_array_equal(np.asarray(stacked["qkv"])[:, :h],
                                  np.asarray(model.layers.q[...]))
    np.testing.assert_array_equal(np.asarray(stacked["qkv"])[:, h + kv:],
                                  np.asarray(model.layers.v[...]))
    if model.cfg.qkv_bias:
      assert "qkv_bias" in names and not names & {"q_bias", "k_bias", "v_bias"}, names
      np.testing.assert_array_equal(np.asarray(stacked["qkv_bias"])[:, h:h + kv],
                                    np.asarray(model.layers.k_bias[...]))
    assert view.for_decoding() is view
    # a new jit: `step`'s cached programs were traced before the patch
    got = jax.jit(lambda m, c: m.for_decoding().decode(tokens, positions, c, 4))(model, cache)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
  model = models[0]
  mesh = sharding.make_mesh(data=1, fsdp=1, tensor=2, devices=fake_devices.take(2))
  with jax.set_mesh(mesh):
    assert not model._f_unsplit()  # F split over tensor=2: gate and up stay two weights
    assert not model._heads_unsplit()  # heads split too: q, k and v stay three
  assert model._f_unsplit() and model._heads_unsplit()


def test_a_sampler_on_per_layer_weights_samples_what_the_stacked_one_samples(
    model, tok, prompts, monkeypatch):
  """The whole generate call (prefill on the restacked layers, decode on the per-layer
  weights and gate_up, `per_layer_decode_weights` forced on a CPU) samples the tokens of
  the stacked sampler, with log-probs equal up to float round-off."""
  params = SamplingParams(temperature=1.0, max_new_tokens=10)
  want = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,)).generate(
      prompts, params, jax.random.key(3))
  monkeypatch.setattr(decoder, "per_layer_decode_weights", lambda cfg, target: True)
  got = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,)).generate(
      prompts, params, jax.random.key(3))
  assert got.tokens == want.tokens
  for x, y in zip(got.logprobs, want.logprobs):
    np.testing.assert_allclose(x, y, atol=1e-5)


def test_auto_decode_attention_is_the_gpu_kernel_on_gpus_only():
  """'auto' decode attention by the target devices' platform: pallas_gpu on GPUs (a
  power-of-two head_dim; else xla), xla on CPUs and TPUs."""
  from hgpo_jax.models import attention
  class Device:
    def __init__(self, platform):
      self.platform = platform
  resolve = attention.resolve_decode_impl
  assert resolve("auto", [Device("gpu")], head_dim=128) == "pallas_gpu"
  assert resolve("auto", [Device("gpu")]) == "pallas_gpu"
  assert resolve("auto", [Device("gpu")], head_dim=96) == "xla"
  assert resolve("auto", [Device("tpu")], head_dim=128) == "xla"
  assert resolve("auto", jax.devices(), head_dim=128) == "xla"
  assert resolve("xla", [Device("gpu")], head_dim=128) == "xla"


def test_user_errors_are_clear(smp, prompts):
  with pytest.raises(ValueError, match="exceeds the largest bucket 32"):
    smp.generate([[5] * 40], SamplingParams(max_new_tokens=4), jax.random.key(0))
  with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
    smp.generate(prompts * 3, SamplingParams(max_new_tokens=4), jax.random.key(0))
  with pytest.raises(ValueError, match="one list of strings per prompt"):
    smp.generate(prompts, SamplingParams(max_new_tokens=4), jax.random.key(0),
                 allowed=[["look"]])
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1.0)
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)


def test_a_bfloat16_kv_cache_holds_bfloat16_and_samples_the_teacher_forced_logprobs(
    model, tok, prompts, monkeypatch):
  """`cache_dtype="bfloat16"` (what "auto" is on TPU/GPU): the cache the program allocates is
  bf16, and log-probs stay within bf16 rounding of keys/values (2^-8 relative) of the
  float32 teacher-forced forward; "auto" on CPU keeps the compute dtype."""
  assert sampler.Sampler(model, tok).cache_dtype == jnp.float32
  assert engine_lib.resolve_cache_dtype("auto", [_Device("tpu")], jnp.float32) == jnp.bfloat16
  assert engine_lib.resolve_cache_dtype("", [_Device("tpu")], jnp.float32) == jnp.float32
  with pytest.raises(ValueError, match="kv_cache_dtype='fp8'"):
    engine_lib.resolve_cache_dtype("fp8", [_Device("cpu")], jnp.float32)
  seen = []
  real = decoder.init_cache
  monkeypatch.setattr(decoder, "init_cache",
                      lambda *a: seen.append(a[-1]) or real(*a))
  smp = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,),
                        cache_dtype="bfloat16")
  out = smp.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12),
                     jax.random.key(3))
  assert seen and all(jnp.dtype(d) == jnp.bfloat16 for d in seen)
  want = _teacher_forced_logprobs(model, prompts, out.tokens)
  for got, ref in zip(out.logprobs, want):
    np.testing.assert_allclose(got, ref, atol=1e-2)  # measured: 1.0e-3 at most
    assert np.max(np.abs(got - ref)) > 0  # the cache's rounding shows


@dataclasses.dataclass
class _Device:
  platform: str


def test_fixed_trie_nodes_give_one_constrained_program_and_the_same_tokens(model, tok, prompts):
  """`trie_nodes` (rollout.max_trie_nodes) fixes the tries' shapes: allowed sets of very
  different sizes share one compiled constrained program and sample what per-call sized
  tries sample; a trie over the cap is a one-line error naming the config field."""
  small = [["look"], ["look"], ["inventory"]]
  large = [[f"go to cabinet {i}" for i in range(1, 30)], ["look"], ["examine mug 1", "inventory"]]
  params = SamplingParams(temperature=1.0, max_new_tokens=24)
  fixed = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,), trie_nodes=256)
  sized = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,))
  for allowed in (small, large):
    a = fixed.generate(prompts, params, jax.random.key(7), allowed=allowed)
    b = sized.generate(prompts, params, jax.random.key(7), allowed=allowed)
    assert a.tokens == b.tokens
  assert fixed.num_compilations == 1 and sized.num_compilations == 2
  tiny_cap = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,), trie_nodes=16)
  with pytest.raises(ValueError, match="rollout.max_trie_nodes"):
    tiny_cap.generate(prompts, params, jax.random.key(7), allowed=large)
  with pytest.raises(ValueError, match="trie_nodes=-1"):
    sampler.Sampler(model, tok, trie_nodes=-1)


def test_prefill_in_row_chunks_equals_one_prefill(tok, prompts, monkeypatch):
  """`prefill_rows` (rollout.prefill_chunk_rows): 8 rows prefilled 2 (unsharded) or 4 (over
  data=4: one row per device per step) at a time sample what one prefill of all rows
  samples, with shared and unshared prefill (shared: the cache rows copied to the call's
  rows as many per step); a chunk that is not a multiple of the mesh's
  batch-parallel size is refused."""
  cfg = config.get_preset("tiny")
  rows = prompts + [prompts[0][:5], prompts[1][3:], prompts[2][:9], [7, 8, 9], prompts[1]]
  params = SamplingParams(temperature=1.0, max_new_tokens=8)
  plain = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  sharded = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2, devices=fake_devices.take(8))
  sharding.shard_model(sharded, mesh)
  chunked, copy = engine_lib.chunked_prefill, engine_lib.chunked_copy
  for model, kw, chunk in ((plain, {}, 2), (sharded, {"mesh": mesh}, 4)):
    for share in (False, True):
      ref = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(8,),
                            share_prefill=share, **kw)
      got = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(8,),
                            share_prefill=share, prefill_rows=chunk, **kw)
      traced, copied = [], []
      monkeypatch.setattr(engine_lib, "chunked_prefill",
                          lambda *a: traced.append(1) or chunked(*a))
      monkeypatch.setattr(engine_lib, "chunked_copy", lambda *a: copied.append(1) or copy(*a))
      a = ref.generate(rows, params, jax.random.key(5))
      b = got.generate(rows, params, jax.random.key(5))
      assert traced  # the loop ran (8 prefill rows > the chunk)
      assert bool(copied) == share  # shared: the 8 rows' cache copied a chunk per step
      assert a.tokens == b.tokens
      for x, y in zip(a.logprobs, b.logprobs):
        np.testing.assert_allclose(x, y, atol=1e-5)
  with pytest.raises(ValueError, match="prefill_rows=2 must be .* multiple of the mesh's "
                                       "batch-parallel size 4"):
    sampler.Sampler(sharded, tok, mesh=mesh, prefill_rows=2)


def test_decode_work_counts_the_lockstep_rows(smp, prompts):
  """`decoded_tokens` / `decode_row_steps`: 3 rows in the batch bucket of 4 decode in
  lockstep until the longest ends; a row cut at EOS or a padding row still costs its
  row-steps."""
  full = smp.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=8,
                                                      ignore_eos=True), jax.random.key(0))
  assert (full.decoded_tokens, full.decode_row_steps) == (24, 32)  # 3 x 8 of 4 x 8
  out = smp.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=48,
                                                     stop_strings=("e",)), jax.random.key(1))
  lengths = [len(t) for t in out.tokens]
  assert len(set(lengths)) > 1  # rows stop at different steps
  assert out.decoded_tokens == sum(lengths)
  assert out.decode_row_steps == 4 * max(lengths)
