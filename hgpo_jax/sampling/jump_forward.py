"""Jump-forward decoding: a constrained row writes the tokens its trie forces without
sampling them one decode step at a time.

A trie node with exactly one edge, no EOS (not terminal) and no free span forces its
edge's token: the one-token loop (`engine.lockstep_decode`) spends a whole decode step of
every row to "sample" it. In an ALFWorld response `<action>go to cabinet 1</action>` most
tokens are forced (`<`, `action`, `>`, the closing three, an object's name once it is the
only one left): two to four of a response's ten to sixteen tokens are choices.

`jump_forward_decode` keeps every row's own token count j_b. After a row samples token j
it appends the run of forced tokens that follows (at most K = `Engine.jump_forward`, and
the run stops where the trie ends or the row reaches M tokens); the next step feeds the
sampled token and its run together, T = K + 1 positions per row at the row's own cache
index (`Decoder.decode_hidden` with an int32[B] index), the padding positions after a
row's real ones read by none of them. The logits of that step give each forced token's raw
log-prob (position t predicts token t + 1) and, at the row's last real position, the
distribution of its next choice. A row whose response ends on a forced run takes one more
step that only scores the run. The root's forced run (`<action>` here) is appended before
the first step, after the last prompt token.

Row b's token j keeps its `fold_in(fold_in(rng, j), b)` key and the same masks and
filters (`token_rules.TokenRules.step` with a per-row step), so its samples are the
one-token loop's up to float round-off of the multi-token forward (rows in FREE phase and
unconstrained calls are decoded by `lockstep_decode`).

A call whose caller reads no log-probs (`SamplingParams.need_logprobs` false: an
evaluation) ends once every row holds its tokens: the step that would only score the
final forced runs (`</action>` of every response) is left out, one of the ~4 steps of an
ALFWorld call, and the log-probs no step computed are NaN.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from hgpo_jax.models import decoder
from hgpo_jax.models import kv_cache
from hgpo_jax.sampling import decode_loop
from hgpo_jax.sampling import inputs as inputs_lib
from hgpo_jax.sampling import logits as logits_lib
from hgpo_jax.sampling import token_rules
from hgpo_jax.sampling import types


def forced_edges(tries: inputs_lib.TrieArrays) -> tuple[jax.Array, jax.Array]:
  """(i32[B, N] the token each trie node forces, -1 where it forces none; i32[B, N] the
  child it leads to). A node forces its edge's token when it has exactly one edge and is
  neither terminal (EOS allowed there) nor a free node (free tokens allowed there)."""
  batch, nodes = tries.terminal.shape
  rows_be = jnp.broadcast_to(jnp.arange(batch)[:, None], tries.edge_parent.shape)
  parent_be = jnp.where(tries.edge_parent >= 0, tries.edge_parent, nodes)  # nodes = dropped
  count_bn = jnp.zeros((batch, nodes), jnp.int32).at[rows_be, parent_be].add(1, mode="drop")
  token_bn = jnp.zeros((batch, nodes), jnp.int32).at[rows_be, parent_be].set(
      tries.edge_token, mode="drop")
  child_bn = jnp.zeros((batch, nodes), jnp.int32).at[rows_be, parent_be].set(
      tries.edge_child, mode="drop")
  forced_bn = (count_bn == 1) & ~tries.terminal & (tries.free_class < 0)
  return jnp.where(forced_bn, token_bn, -1), child_bn


def forced_run(forced, tries: inputs_lib.TrieArrays, node_b, next_b, go_b, *, steps: int,
               max_new_tokens: int):
  """The forced tokens that follow trie node `node_b` of each row with `go_b`, the first
  at token index `next_b`: at most `steps`, none at or past index M.

  Returns (i32[B, steps] the tokens (0 past a row's run), i32[B] the run's length, i32[B]
  the node after it, i32[B] the stop reason its last token causes: `types.CONSTRAINT` at
  a leaf, `types.LENGTH` at token M - 1, else 0)."""
  token_bn, child_bn = forced
  batch = node_b.shape[0]
  rows_b = jnp.arange(batch)
  tokens_bk = jnp.zeros((batch, steps), jnp.int32)
  count_b = jnp.zeros((batch,), jnp.int32)
  reason_b = jnp.zeros((batch,), jnp.int32)
  going_b = go_b
  for k in range(steps):
    token_b = token_bn[rows_b, node_b]
    index_b = next_b + k
    going_b = going_b & (token_b >= 0) & (index_b < max_new_tokens)
    child_b = child_bn[rows_b, node_b]
    tokens_bk = tokens_bk.at[:, k].set(jnp.where(going_b, token_b, 0))
    count_b = count_b + going_b.astype(jnp.int32)
    node_b = jnp.where(going_b, child_b, node_b)
    leaf_b = ~tries.has_children[rows_b, child_b]
    ends_b = jnp.where(leaf_b, types.CONSTRAINT,
                       jnp.where(index_b + 1 >= max_new_tokens, types.LENGTH, 0))
    reason_b = jnp.where(going_b, ends_b, reason_b)
    going_b = going_b & (ends_b == 0)
  return tokens_bk, count_b, node_b, reason_b


@flax.struct.dataclass
class JumpState:
  """The jump-forward loop's carry (B rows, T = K + 1 positions per step).

  `lengths` counts the tokens a row recorded (sampled and forced); the row's next choice
  is token `lengths`. `pending` holds the tokens whose keys the cache lacks: the row's last
  sampled token (the last prompt token at first) and the forced run after it, `count` of
  them; they lie at token indices [lengths - count, lengths) (-1: the last prompt token).
  """
  step: jax.Array  # i32[]: decode steps run
  cache: decoder.KVCache
  pending: jax.Array  # i32[B, T]
  count: jax.Array  # i32[B]
  tokens: jax.Array  # i32[B, M]
  logprobs: jax.Array  # f32[B, M]
  lengths: jax.Array  # i32[B]
  done: jax.Array  # bool[B]: no more choices
  scored: jax.Array  # bool[B]: done, and every recorded token has its log-prob
  reasons: jax.Array  # i32[B]
  rules: token_rules.RowRules


def jump_forward_decode(engine, model, rules: token_rules.TokenRules,
                        inputs: inputs_lib.DecodeInputs, phase_b, cache):
  """Every row in its own cache row, each at its own slot, forced runs written in one
  step (module docstring); returns the call's `decode_loop.DecodeResult`. `engine` is the
  sampler's `engine.Engine` (K = `engine.jump_forward` > 0); `cache` holds the prefilled
  prompts and room for K slots past P + M - 1 (`Engine.cache_length`)."""
  batch, plen = inputs.tokens.shape
  max_new = rules.flags.max_new_tokens
  k_max = engine.jump_forward
  width = k_max + 1
  rows_b = jnp.arange(batch)
  tries = inputs.tries
  forced = forced_edges(tries)
  run = lambda node_b, next_b, go_b: forced_run(  # noqa: E731
      forced, tries, node_b, next_b, go_b, steps=k_max, max_new_tokens=max_new)
  positions_t = jnp.arange(width, dtype=jnp.int32)

  def record(tokens_bm, values_bk, first_b, count_b):
    """`tokens_bm` with row b's values_bk[b, :count_b[b]] at [first_b[b], ...)."""
    index_bk = first_b[:, None] + positions_t[None, :values_bk.shape[1]]
    index_bk = jnp.where(positions_t[None, :values_bk.shape[1]] < count_b[:, None], index_bk,
                         max_new)  # max_new = dropped
    return tokens_bm.at[rows_b[:, None], index_bk].set(values_bk, mode="drop")

  def body(state: JumpState) -> JumpState:
    first_b = state.lengths - state.count  # token index of pending[0]
    positions_bt = (inputs.lengths + first_b)[:, None] + positions_t[None, :]
    logits_btv, cache = model.decode(state.pending, positions_bt, state.cache,
                                     plen + first_b)
    logits_btv = logits_btv.astype(jnp.float32)
    scoring_b = ~state.scored
    # Position t predicts pending[t + 1]: the raw log-probs of the forced tokens.
    logp_bt = jax.vmap(logits_lib.token_logprob, in_axes=(1, 1), out_axes=1)(
        logits_btv[:, :-1], state.pending[:, 1:])
    logprobs = record(state.logprobs, logp_bt, first_b + 1,
                      jnp.where(scoring_b, state.count - 1, 0))
    # The next choice, from the last real position of each row still choosing.
    last_bv = jnp.take_along_axis(logits_btv, (state.count - 1)[:, None, None], axis=1)[:, 0]
    out = rules.step(last_bv, rows_b, state.lengths, tries, state.rules)
    live_b = ~state.done
    reason_b = jnp.where(live_b, out.reason, 0)
    in_trie_b = out.rules.phase == types.IN_TRIE
    run_bk, run_b, node_b, run_reason_b = run(out.rules.node, state.lengths + 1,
                                              live_b & (reason_b == 0) & in_trie_b)
    reason_b = jnp.where(run_b > 0, run_reason_b, reason_b)
    tokens = record(state.tokens, jnp.concatenate([out.token[:, None], run_bk], axis=1),
                    state.lengths, jnp.where(live_b, 1 + run_b, 0))
    logprobs = record(logprobs, out.logprob[:, None], state.lengths, live_b.astype(jnp.int32))
    ends_b = live_b & (reason_b > 0)
    pending = jnp.where(live_b[:, None], jnp.concatenate([out.token[:, None], run_bk], axis=1),
                        state.pending)
    count_b = jnp.where(live_b, 1 + run_b, state.count)
    new_rules = out.rules.replace(
        node=node_b, free_count=jnp.where(run_b > 0, 0, out.rules.free_count))
    return JumpState(
        step=state.step + 1, cache=cache, pending=pending, count=count_b, tokens=tokens,
        logprobs=logprobs, lengths=state.lengths + jnp.where(live_b, 1 + run_b, 0),
        done=state.done | ends_b, scored=state.done | (ends_b & (run_b == 0)),
        reasons=jnp.where(ends_b, reason_b, state.reasons), rules=new_rules)

  def cond(state: JumpState):
    # Without `need_logprobs` a row is through once it holds its tokens (`done`): the step
    # that would only score its final forced run is not taken.
    through_b = jnp.where(inputs.need_logprobs, state.scored, state.done)
    return (state.step <= max_new) & ~jnp.all(through_b)

  if engine.layered_cache:
    cache = kv_cache.layered(cache)
  start = token_rules.RowRules.start(phase_b)
  valid_b = inputs.row_valid
  root_bk, root_b, root_node_b, root_reason_b = run(
      start.node, jnp.zeros((batch,), jnp.int32), valid_b & (phase_b == types.IN_TRIE))
  pending = jnp.concatenate([inputs.tokens[:, -1:], root_bk], axis=1)
  done_b = ~valid_b | (root_reason_b > 0)
  state = JumpState(
      step=jnp.int32(0), cache=cache, pending=pending, count=1 + root_b,
      tokens=record(jnp.full((batch, max_new), engine.pad_id, jnp.int32), root_bk,
                    jnp.zeros((batch,), jnp.int32), root_b),
      logprobs=jnp.where(inputs.need_logprobs, jnp.zeros((batch, max_new), jnp.float32),
                         jnp.nan),
      lengths=root_b, done=done_b,
      scored=~valid_b, reasons=root_reason_b,
      rules=start.replace(node=root_node_b))
  return decode_loop.run_loop(engine.decode_chunk, body, cond, state, max_new + 1)
