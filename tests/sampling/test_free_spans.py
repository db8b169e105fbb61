"""Free spans in constrained decoding (`constrained.FreeSpan`): host-side tries and the
jit sampler on the tiny model, for HiPER's three blocks and WebShop's free search query."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config, decoder, sharding
from hgpo_jax.rollout import hiper, projection
from hgpo_jax.sampling import constrained, sampler
from hgpo_jax.sampling import SamplingParams

SPAN = constrained.FreeSpan(3, "]")
PROMPTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
           "<|im_start|>user\nput a clean apple in the fridge<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="module")
def smp(model, tok):
  return sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,))


@pytest.fixture(scope="module")
def prompts(tok):
  return [tok.encode(p) for p in PROMPTS]


# ------------------------------------------------------------------------------ host side
def test_split_placeholder_and_free_query_actions():
  got = constrained.split_placeholder("search[<your query>]", "<your query>", SPAN)
  assert got == ("search[", SPAN, "]")
  assert constrained.split_placeholder("click[x]", "<your query>", SPAN) == "click[x]"
  acts = projection.free_query_actions(["search[<your query>]", "click[next >]"], max_tokens=5)
  assert acts == [("search[", constrained.FreeSpan(5, "[]<>"), "]"), "click[next >]"]


def test_token_sequences_with_free_spans():
  vocab = {"<action>search[": [10, 11], "]</action>": [12, 13], "<action>look</action>": [10, 14, 13],
           "<action>": [10], "search[": [11]}
  enc = lambda s: vocab[s]
  whole = constrained.ActionConstraint()
  assert constrained.constrained_token_sequences([("search[", SPAN, "]"), "look"], whole, enc) == [
      [10, 11, SPAN, 12, 13], [10, 14, 13]]


@pytest.mark.parametrize("entry,match", [
    (("a", SPAN), "followed by fixed text"),  # a span at the end (suffix "" here)
    (("a[", SPAN, "x]"), "first character"),  # terminator does not start with a forbidden char
    (("a", SPAN, SPAN, "]"), "two free spans"),
    (("a", 3), "pieces must be str, FreeSpan or TokenIds"),
])
def test_bad_piece_entries_are_refused(entry, match):
  bare = constrained.ActionConstraint(prefix="", suffix="")
  with pytest.raises(ValueError, match=match):
    constrained.constrained_token_sequences([entry], bare, lambda s: [1] * len(s))


def test_free_span_arguments_are_checked():
  with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
    constrained.FreeSpan(2, "]", min_tokens=3)
  with pytest.raises(ValueError, match="terminator"):
    constrained.FreeSpan(2, "")


def test_build_tries_marks_shared_free_nodes():
  a, b = constrained.FreeSpan(4, "<>", 1), constrained.FreeSpan(2, "]", 0)
  # Row 0: two entries share the free node after [1, 2]; row 1: another class.
  rows = [[[1, 2, a, 7, 8], [1, 2, a, 7, 9], [3]], [[5, b, 6]], []]
  tries = constrained.build_tries(rows, batch_size=4)
  assert tries.free_forbidden == ("<>", "]")
  node = lambda row, path: _walk(tries, row, path)
  free0, free1 = node(0, [1, 2]), node(1, [5])
  assert tries.free_class[0, free0] == 0 and tries.free_class[1, free1] == 1
  assert (tries.free_min[0, free0], tries.free_max[0, free0]) == (1, 4)
  assert (tries.free_min[1, free1], tries.free_max[1, free1]) == (0, 2)
  assert (tries.free_class >= 0).sum() == 2  # no other node is free
  assert tries.terminal[0, node(0, [1, 2, 7, 8])] and tries.terminal[0, node(0, [1, 2, 7, 9])]
  # Fewest tokens to the end of an allowed sequence (free tokens do not count).
  assert [tries.to_leaf[0, node(0, p)] for p in ([], [1], [1, 2], [1, 2, 7], [3])] == [1, 3, 2, 1, 0]
  assert [tries.to_leaf[1, node(1, p)] for p in ([], [5], [5, 6])] == [2, 1, 0]
  np.testing.assert_array_equal(tries.active, [True, True, False, False])
  with pytest.raises(ValueError, match="same fixed text"):
    constrained.build_tries([[[1, a, 7], [1, b, 6]]], batch_size=1)


def _walk(tries, row, path):
  n = 0
  for token in path:
    edge = np.nonzero((tries.edge_parent[row] == n) & (tries.edge_token[row] == token))[0]
    assert len(edge) == 1, (row, path, token)
    n = int(tries.edge_child[row, edge[0]])
  return n


def test_free_token_mask():
  strings = ["ab", " cd", "a]", "", "  ", "\n", "x\x07", "\ufffd", "<|im_end|>", "ok"]
  mask = constrained.free_token_mask(strings, "]<", special_ids=[9])
  np.testing.assert_array_equal(mask, [1, 1, 0, 0, 0, 0, 0, 0, 0, 0])


# ----------------------------------------------------------------------------- jit sampler
def _free_part(text, start_tag, end_tag):
  i = text.index(start_tag) + len(start_tag)
  return text[i:text.index(end_tag, i)]


def _tokens_between(tok, response_ids, before, after):
  """Number of response tokens strictly between the fixed text ending in `before` and
  the fixed text starting with `after` (token texts concatenated)."""
  texts = [tok.decode([t]) for t in response_ids]
  pos, starts = 0, []
  for t in texts:
    starts.append(pos)
    pos += len(t)
  full = "".join(texts)
  lo = full.index(before) + len(before)
  hi = full.index(after, lo)
  inside = [j for j, s in enumerate(starts) if lo <= s < hi]
  assert all(starts[j] + len(texts[j]) <= hi for j in inside)  # tokens end at the terminator
  return len(inside)


def test_hiper_constrained_generation_always_parses_valid(smp, tok, prompts):
  admissible = [["go to cabinet 1", "look"], ["search[<your query>]", "click[back to search]"],
                ["open fridge 1", "take apple 1 from countertop 1"]]
  subgoals, first = ["None", "find the apple", "find the apple"], [True, False, False]
  cap = 4
  allowed = [hiper.constrained_responses(projection.free_query_actions(a, 3), s, f, cap)
             for a, s, f in zip(admissible, subgoals, first)]
  params = SamplingParams(temperature=1.0, max_new_tokens=96)
  switches, lengths, queries = set(), set(), set()
  for seed in range(8):
    out = smp.generate(prompts, params, jax.random.key(seed), allowed=allowed,
                       constraint=hiper.RESPONSE_CONSTRAINT)
    assert out.stop_reason == ["constraint"] * 3
    for b, (text, ids) in enumerate(zip(out.texts, out.tokens)):
      p = hiper.parse_response(text)
      assert p.valid and p.switch in ("KEEP", "SWITCH"), text
      switches.add(p.switch)
      if p.action.startswith("search["):
        query = p.action[len("search["):-1]
        assert query.strip() and not set(query) & set("[]<>"), text
        n = _tokens_between(tok, ids, "search[", "]</action>")
        assert 1 <= n <= 3, (text, n)
        queries.add(query)
      else:
        assert p.action in admissible[b], text
      if p.switch == "KEEP" and not first[b]:
        assert p.subgoal == subgoals[b]  # KEEP copies the current subgoal verbatim
      else:
        sub = _free_part(text, "<subgoal>", "</subgoal>")
        assert not set(sub) & set("<>\n")
        n = _tokens_between(tok, ids, "<subgoal>", "</subgoal>")
        assert 1 <= n <= cap, (text, n)
        lengths.add(n)
      assert tok.decode(ids) == text  # no EOS: the constraint ends the row
  # The random model rarely picks the one terminator token among ~400 free ones: the cap
  # ends the subgoals (measured: every free subgoal has exactly `cap` tokens).
  assert switches == {"KEEP", "SWITCH"} and len(queries) >= 2 and max(lengths) == cap


def test_constrained_free_span_logprobs_are_raw_model_logprobs(smp, model, tok, prompts):
  allowed = [[("search[", constrained.FreeSpan(5, "[]<>"), "]")], [], ["look"]]
  out = smp.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16),
                     jax.random.key(3), allowed=allowed)
  assert out.stop_reason[0] == "constraint" and out.texts[0].startswith("<action>search[")
  seqs = [list(p) + list(r) for p, r in zip(prompts, out.tokens)]
  width = max(len(s) for s in seqs)
  tokens = np.zeros((len(seqs), width), np.int32)
  mask = np.zeros((len(seqs), width), bool)
  for b, s in enumerate(seqs):
    tokens[b, width - len(s):], mask[b, width - len(s):] = s, True
  positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
  logits, _ = model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), -1))
  for b, r in enumerate(out.tokens):
    want = [logp[b, width - len(r) - 1 + j, t] for j, t in enumerate(r)]
    np.testing.assert_allclose(out.logprobs[b], want, atol=1e-4)


class ScriptedModel(nnx.Module):
  """Logits that spell `script[b]` after the prompt (margin 30 nats), as in test_sampler."""

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
    return 30.0 * jax.nn.one_hot(target_bt, self.cfg.vocab_size), cache

  def prefill(self, tokens_bt, positions_bt, segment_ids_bt, cache):
    return self.hidden(tokens_bt, positions_bt, segment_ids_bt, cache)

  def for_decoding(self):
    return self  # no output layer to cast (`Decoder.for_decoding`)

  def decode(self, tokens_bt, positions_bt, cache, cache_index):
    return self(tokens_bt, positions_bt, jnp.ones_like(positions_bt), cache, cache_index)


def _scripted_sampler(tok, rows, prompts):
  width = max(len(r) for r in rows) + 40
  filler = tok.encode(" egg")[0]
  script = np.full((4, width), filler, np.int32)  # after the script: " egg" forever
  for b, r in enumerate(rows):
    script[b, :len(r)] = r
  lengths = [len(p) for p in prompts] + [1] * (4 - len(prompts))
  return sampler.Sampler(ScriptedModel(config.get_preset("tiny"), script, lengths), tok,
                         prompt_buckets=(32,), batch_buckets=(4,))


def test_free_span_cap_and_minimum_are_enforced(tok, prompts):
  # Row 0 wants to write " egg" forever: cut at the cap, then the terminator is forced.
  # Row 1 wants to close the subgoal at once: one free token is required first.
  # Row 2 writes a short query and closes it itself.
  head = tok.encode("<switch>SWITCH</switch><subgoal>")
  tail = tok.encode("</subgoal><action>look</action>")
  rows = [head, head + tail[:1] + tail,  # wants the terminator at once, then again
          tok.encode("<action>search[ egg]</action>")]
  smp = _scripted_sampler(tok, rows, prompts)
  cap = 5
  allowed = [hiper.constrained_responses(["look"], "None", True, cap),
             hiper.constrained_responses(["look"], "None", True, cap),
             projection.free_query_actions(["search[<your query>]"], 3)]
  constraint = hiper.RESPONSE_CONSTRAINT
  out0 = smp.generate(prompts[:2], SamplingParams(temperature=1.0, max_new_tokens=80),
                      jax.random.key(0), allowed=allowed[:2], constraint=constraint)
  assert out0.texts[0] == "<switch>SWITCH</switch><subgoal>" + " egg" * cap + "</subgoal><action>look</action>"
  assert _tokens_between(tok, out0.tokens[0], "<subgoal>", "</subgoal>") == cap
  # Row 1: its first wish ("</") is masked, so one free token is sampled; then the
  # terminator is allowed and the script's "</subgoal><action>look</action>" follows.
  assert out0.tokens[1][:len(head)] == head and out0.tokens[1][len(head) + 1:] == tail
  assert _tokens_between(tok, out0.tokens[1], "<subgoal>", "</subgoal>") == 1
  out2 = smp.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=40),
                      jax.random.key(0), allowed=[[], [], allowed[2]])
  assert out2.texts[2] == "<action>search[ egg]</action>" and out2.stop_reason[2] == "constraint"


def test_free_span_stops_early_when_the_rest_would_not_fit(tok, prompts):
  # The script writes " egg" forever; the cap (40) is beyond the token budget, so the free
  # span ends exactly when the shortest completion still fits in max_new_tokens.
  head = tok.encode("<switch>SWITCH</switch><subgoal>")
  tail = tok.encode("</subgoal><action>look</action>")
  smp = _scripted_sampler(tok, [head] * 3, prompts)
  allowed = [hiper.constrained_responses(["look"], "None", True, 40)] * 3
  for budget in (len(head) + len(tail) + 1, len(head) + len(tail) + 7):
    out = smp.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=budget),
                       jax.random.key(0), allowed=allowed, constraint=hiper.RESPONSE_CONSTRAINT)
    free = budget - len(head) - len(tail)
    assert out.stop_reason == ["constraint"] * 3
    assert out.tokens[0] == head + tok.encode(" egg") * free + tail
    assert hiper.parse_response(out.texts[0]).valid


def test_free_spans_do_not_recompile_within_a_bucket(model, tok, prompts):
  smp = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,))
  params = SamplingParams(temperature=1.0, max_new_tokens=64)
  action = constrained.ActionConstraint()
  batches = [  # HiPER turns, a WebShop free query, plain admissible actions (no free span)
      ([hiper.constrained_responses(["go to cabinet 1", "look"], "None", True, 4)] * 3,
       hiper.RESPONSE_CONSTRAINT),
      ([hiper.constrained_responses(["open fridge 1", "look"], "find it", False, 6)] * 3,
       hiper.RESPONSE_CONSTRAINT),
      ([projection.free_query_actions(["search[<your query>]", "click[back to search]",
                                        "click[next >]", "click[b00kx1]", "click[b00kx2]",
                                        "click[b01qz3]", "click[b07mm4]", "click[b09yy5]"])] * 3,
       action),
      ([["go to cabinet 1", "go to cabinet 2", "go to countertop 1", "open fridge 1", "look",
         "take apple 1 from countertop 1", "inventory", "go to drawer 1", "examine desk 1"]] * 3,
       action),
  ]
  sizes = set()
  for allowed, constraint in batches:
    seqs = [constrained.constrained_token_sequences(a, constraint, tok.encode) for a in allowed]
    sizes.add(constrained.build_tries(seqs, 4).terminal.shape)
  assert len(sizes) == 1, sizes  # one node bucket, so one program for all batches
  for seed, (allowed, constraint) in enumerate(batches):
    out = smp.generate(prompts, params, jax.random.key(seed), allowed=allowed, constraint=constraint)
    assert out.stop_reason == ["constraint"] * 3
  assert smp.num_compilations == 1


def test_free_spans_sharded_equals_unsharded(tok, prompts):
  cfg = config.get_preset("tiny")
  plain = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  sharded = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2, devices=fake_devices.take(8))
  sharding.shard_model(sharded, mesh)
  ref = sampler.Sampler(plain, tok, prompt_buckets=(32,), batch_buckets=(4,))
  dist = sampler.Sampler(sharded, tok, prompt_buckets=(32,), batch_buckets=(4,), mesh=mesh)
  allowed = [hiper.constrained_responses(projection.free_query_actions(a, 3), "find it", False, 4)
             for a in (["look", "search[<your query>]"], ["go to desk 1"], ["open drawer 1", "look"])]
  params = SamplingParams(temperature=1.0, max_new_tokens=64)
  for seed in range(2):
    a = ref.generate(prompts, params, jax.random.key(seed), allowed=allowed,
                     constraint=hiper.RESPONSE_CONSTRAINT)
    b = dist.generate(prompts, params, jax.random.key(seed), allowed=allowed,
                      constraint=hiper.RESPONSE_CONSTRAINT)
    assert a.tokens == b.tokens and a.stop_reason == b.stop_reason == ["constraint"] * 3
    for x, y in zip(a.logprobs, b.logprobs):
      np.testing.assert_allclose(x, y, atol=1e-5)  # same as the unconstrained sharded test


def test_token_ids_piece_is_taken_as_its_ids_and_checked():
  """A `TokenIds` piece contributes its ids unchanged between separately tokenized text;
  it cannot end a free span (the terminator must be text) and may not be empty."""
  enc = lambda s: [ord(c) for c in s]
  seqs = constrained.constrained_token_sequences(
      [("ab", constrained.TokenIds((900, 901)), "c")], constrained.ActionConstraint("<", ">"), enc)
  assert seqs == [[ord("<"), ord("a"), ord("b"), 900, 901, ord("c"), ord(">")]]
  with pytest.raises(ValueError, match="free span must be followed by fixed text"):
    constrained.constrained_token_sequences(
        [(constrained.FreeSpan(3, "<"), constrained.TokenIds((5,)))],
        constrained.ActionConstraint("", ">"), enc)
  with pytest.raises(ValueError, match="at least one"):
    constrained.TokenIds(())
