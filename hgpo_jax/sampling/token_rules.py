"""What a decode step does with its rows' logits, shared by the lockstep and the slotted
decode: constraint masks, sampling, stop strings, constraint transitions, stop reasons.

Constraints: per row a token trie (`hgpo_jax.sampling.constrained`), possibly with free
spans (a free query inside `search[...]`, a HiPER subgoal): at a free node the row writes
free tokens (a per-class token mask) up to the span's cap, and never so many that the
shortest completion of the trie would no longer fit in max_new_tokens. To change what a
token does to a row (a new stop condition, a new constraint rule), change `TokenRules.step`.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp

from hgpo_jax.sampling import inputs as inputs_lib
from hgpo_jax.sampling import logits as logits_lib
from hgpo_jax.sampling import types


@flax.struct.dataclass
class RowRules:
  """Per-row state of the token rules, carried from step to step (i32[R] each).

  Attributes:
    stop_state: the row's state in the stop-string automaton.
    phase: `types.FREE` or `types.IN_TRIE`.
    node: the row's node in its constraint trie.
    free_count: free tokens written at the current free node.
  """
  stop_state: jax.Array
  phase: jax.Array
  node: jax.Array
  free_count: jax.Array

  @classmethod
  def start(cls, phase_r: jax.Array) -> "RowRules":
    """Rows at the start of their response, in phase `phase_r`."""
    zeros_r = jnp.zeros_like(phase_r)
    return cls(stop_state=zeros_r, phase=phase_r, node=zeros_r, free_count=zeros_r)


@flax.struct.dataclass
class StepResult:
  """What `TokenRules.step` decides for each row.

  Attributes:
    token: i32[R] the sampled token.
    logprob: f32[R] its raw log-prob (log_softmax at temperature 1, no masks).
    reason: i32[R] the stop reason it causes (`types.STOP_REASONS` index; 0 = none).
    rules: the rows' rule state after it.
  """
  token: jax.Array
  logprob: jax.Array
  reason: jax.Array
  rules: RowRules


class TokenRules:
  """The token rules of one call (trace-time object: holds the call's traced inputs).

  Args:
    inputs: the call's `DecodeInputs` (rng, sampling scalars, stop table, tries, masks).
    flags: the call's `DecodeFlags`.
    vocab: the model's vocabulary size V.
    eos_ids: the tokenizer's EOS ids.
    max_candidates: K of `logits.filter_logits`.
  """

  def __init__(self, inputs: inputs_lib.DecodeInputs, flags: inputs_lib.DecodeFlags, *,
               vocab: int, eos_ids, max_candidates: int):
    self.vocab = vocab
    self.max_candidates = max_candidates
    self.eos_v = jnp.zeros((vocab,), bool).at[jnp.asarray(eos_ids)].set(True)
    self.inputs, self.flags = inputs, flags

  def start_phase(self) -> jax.Array:
    """i32[B] the phase each row of the call starts in."""
    if self.flags.constraint_mode == types.WHOLE_CONSTRAINT:
      return jnp.where(self.inputs.tries.active, types.IN_TRIE, types.FREE).astype(jnp.int32)
    return jnp.zeros((self.inputs.tokens.shape[0],), jnp.int32)

  def choose(self, logits_bv, rows_b, step):
    """i32[R] tokens of rows `rows_b` at `step` (scalar, or one per row)."""
    ins = self.inputs
    if self.flags.greedy:
      return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    if self.flags.filtered:
      logits_bv = logits_lib.filter_logits(logits_bv, ins.temperature, ins.top_k, ins.top_p,
                                           self.max_candidates)
    else:
      logits_bv = logits_bv / ins.temperature
    if jnp.ndim(step) == 0:
      keys_b = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(ins.rng, step),
                                                       rows_b)
    else:  # each row at its own step (slotted decode): the same key per (row, step)
      keys_b = jax.vmap(lambda j, r: jax.random.fold_in(jax.random.fold_in(ins.rng, j), r))(
          step, rows_b)
    return jax.vmap(jax.random.categorical)(keys_b, logits_bv).astype(jnp.int32)

  def step(self, logits_bv, rows_b, step, tries: inputs_lib.TrieArrays,
           rules: RowRules) -> StepResult:
    """The token, its raw log-prob, stop reason and next rule state of rows `rows_b`;
    `step` is a scalar or per row; `tries` are the rows' own tables."""
    vocab, max_new_tokens = self.vocab, self.flags.max_new_tokens
    phase_b, node_b, free_count_b, stop_state_b = (rules.phase, rules.node, rules.free_count,
                                                   rules.stop_state)
    batch = logits_bv.shape[0]
    logits_bv = logits_bv.astype(jnp.float32)
    at_node = lambda table_bn: jnp.take_along_axis(table_bn, node_b[:, None], axis=1)[:, 0]  # noqa: E731

    masked_bv = logits_bv
    constrained_run = self.flags.constraint_mode != types.NO_CONSTRAINT
    if constrained_run:
      # Tokens allowed at a trie node; at a free node also the free tokens (below the
      # cap, and while the shortest completion still fits in max_new_tokens), and its
      # edges once `min_tokens` free tokens were written or no more may be.
      in_trie_b = phase_b == types.IN_TRIE
      on_node_be = tries.edge_parent == node_b[:, None]
      targets_be = jnp.where(on_node_be, tries.edge_token, vocab)  # vocab = dropped
      edges_bv = jnp.zeros((batch, vocab), bool).at[jnp.arange(batch)[:, None], targets_be].set(
          True, mode="drop")
      edges_bv = edges_bv | (at_node(tries.terminal)[:, None] & self.eos_v[None, :])
      free_class_b = at_node(tries.free_class)
      is_free_b = free_class_b >= 0
      free_bv = self.inputs.free_masks[jnp.maximum(free_class_b, 0)]
      fits_b = step + 1 + at_node(tries.to_leaf) <= max_new_tokens
      may_write_b = (free_count_b < at_node(tries.free_max)) & fits_b
      may_end_b = (free_count_b >= at_node(tries.free_min)) | ~may_write_b
      at_free_bv = (edges_bv & may_end_b[:, None]) | (free_bv & may_write_b[:, None])
      allowed_bv = jnp.where(is_free_b[:, None], at_free_bv, edges_bv)
      masked_bv = jnp.where(in_trie_b[:, None] & ~allowed_bv, -jnp.inf, masked_bv)
    token_b = self.choose(masked_bv, rows_b, step)
    token_logp_b = logits_lib.token_logprob(logits_bv, token_b)

    is_eos_b = self.eos_v[token_b] & (not self.flags.ignore_eos)
    next_stop_b = self.inputs.stop_table[stop_state_b, token_b]
    stop_hit_b = self.inputs.use_stop & (next_stop_b < 0)
    stop_state_b = jnp.maximum(next_stop_b, 0)

    finished_constraint_b = jnp.zeros((batch,), bool)
    if constrained_run:
      match_be = (tries.edge_parent == node_b[:, None]) & (tries.edge_token == token_b[:, None])
      child_b = jnp.sum(jnp.where(match_be, tries.edge_child, 0), axis=1)
      child_is_leaf_b = ~jnp.take_along_axis(tries.has_children, child_b[:, None], axis=1)[:, 0]
      took_edge_b = in_trie_b & jnp.any(match_be, axis=1)
      finished_constraint_b = took_edge_b & child_is_leaf_b
      # Stop strings inside the forced text are the caller's own strings: not a stop.
      stop_hit_b = stop_hit_b & ~in_trie_b
      # A token at a free node that is no edge is a free token: stay, count it.
      wrote_free_b = in_trie_b & is_free_b & ~took_edge_b
      node_b = jnp.where(took_edge_b, child_b, node_b)
      free_count_b = jnp.where(took_edge_b, 0, free_count_b + wrote_free_b.astype(jnp.int32))

    new_reason_b = jnp.select(
        [finished_constraint_b, is_eos_b, stop_hit_b, step + 1 >= max_new_tokens],
        [types.CONSTRAINT, types.EOS, types.STOP, types.LENGTH], 0)
    return StepResult(token=token_b, logprob=token_logp_b, reason=new_reason_b,
                      rules=RowRules(stop_state=stop_state_b, phase=phase_b, node=node_b,
                                     free_count=free_count_b))
