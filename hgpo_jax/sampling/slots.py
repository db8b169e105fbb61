"""Continuous batching: which rows enter which cache rows ("slots") of a slotted decode.

A call of B rows with `DecodeFlags.slots = S < B` decodes in S cache rows. Before each
decode step `engine.slotted_decode` runs `admit_rows` while `may_admit` holds: the next
`Admission.rows` waiting rows are prefilled into the first free slots (or, after a shared
prefill, their prompt's cache rows are copied there), and start at token 0 with their own
rule state. A row that finishes frees its slot at once. To change how rows are admitted
(another order, admitting fewer or more at a time), change these two functions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp

from hgpo_jax.models import kv_cache
from hgpo_jax.sampling import inputs as inputs_lib
from hgpo_jax.sampling import token_rules


@flax.struct.dataclass
class SlotState:
  """The S slots of a slotted decode: the carry of its decode loop.

  Attributes:
    cache: the S-row KV cache.
    row: i32[S] the call row a slot decodes (B: none).
    step: i32[S] the token index its row samples next.
    prev: i32[S] the token fed to it at the next step.
    active: bool[S] the slot holds a row that has not finished.
    rules: the slots' rule state (`token_rules.RowRules`).
    next_row: i32[] the first row not admitted yet.
  """
  cache: kv_cache.KVCache
  row: jax.Array
  step: jax.Array
  prev: jax.Array
  active: jax.Array
  rules: token_rules.RowRules
  next_row: jax.Array

  @classmethod
  def empty(cls, cache: kv_cache.KVCache, slots: int, batch: int) -> "SlotState":
    """No slot holds a row (row `batch` = none: writes for it are dropped)."""
    zeros_s = jnp.zeros((slots,), jnp.int32)
    return cls(cache=cache, row=jnp.full((slots,), batch, jnp.int32), step=zeros_s,
               prev=zeros_s, active=jnp.zeros((slots,), bool),
               rules=token_rules.RowRules.start(zeros_s),
               next_row=jnp.int32(0))


@dataclasses.dataclass(frozen=True)
class Admission:
  """What admission reads (trace-time constants of one slotted decode).

  Attributes:
    model: the decoder.
    inputs: the call's `DecodeInputs` (B rows).
    phase: i32[B] the phase each row starts in.
    shared_cache: the shared prefill's cache of the distinct prompts, or None (each
      admitted row is prefilled).
    slots: S.
    rows: rows admitted at a time (`Sampler.admit_rows`).
    cache_len: slots of the cache, P + M - 1.
    n_valid: i32[] real rows of the call (rows >= it are bucket padding, never admitted).
    prefill: `engine.prefill` bound to the engine: (model, tokens, lengths, cache) -> cache.
    empty_cache: (rows, length) -> an empty cache.
    constrain: (cache, rows, length) -> the cache on its shardings, or None (no mesh).
  """
  model: Any
  inputs: inputs_lib.DecodeInputs
  phase: jax.Array
  shared_cache: Any
  slots: int
  rows: int
  cache_len: int
  n_valid: jax.Array
  prefill: Callable
  empty_cache: Callable
  constrain: Callable | None


def may_admit(adm: Admission, state: SlotState) -> jax.Array:
  """Whether rows wait and enough slots are free for the next admission (all waiting
  rows when fewer than `adm.rows` wait)."""
  waiting = adm.n_valid - state.next_row
  free = adm.slots - jnp.sum(state.active.astype(jnp.int32))
  return (waiting > 0) & (free >= jnp.minimum(adm.rows, waiting))


def admit_rows(adm: Admission, state: SlotState) -> SlotState:
  """`state` with the next `adm.rows` rows in its first free slots (fewer at the end of the
  call): their prompts' first P-1 slots in the slots' cache rows, step 0, the last prompt
  token as the next input, fresh rule state."""
  ins = adm.inputs
  batch, plen = ins.tokens.shape
  admit, slots = adm.rows, adm.slots
  cache = state.cache
  rows_a = state.next_row + jnp.arange(admit)
  real_a = rows_a < adm.n_valid
  free_a = jnp.nonzero(~state.active, size=admit, fill_value=slots)[0]
  slot_a = jnp.where(real_a, free_a, slots)  # slot `slots`: dropped
  take_a = jnp.minimum(rows_a, batch - 1)
  if plen > 1:
    if adm.shared_cache is None:
      part = adm.prefill(adm.model, ins.tokens[take_a], ins.lengths[take_a],
                         adm.empty_cache(admit, plen - 1))
    else:
      part = jax.tree.map(lambda c: jnp.take(c, ins.source[take_a], axis=1), adm.shared_cache)
    zero_a = jnp.zeros((admit,), jnp.int32)
    cache = jax.tree.map(
        lambda full, new: kv_cache.write_rows(full, new, slot_a, zero_a, real_a), cache, part)
    if adm.constrain is not None:
      cache = adm.constrain(cache, slots, adm.cache_len)
  put = lambda x_s, v_a: x_s.at[slot_a].set(v_a, mode="drop")  # noqa: E731
  zero_a = jnp.zeros((admit,), jnp.int32)
  return SlotState(
      cache=cache, row=put(state.row, rows_a), step=put(state.step, zero_a),
      prev=put(state.prev, ins.tokens[take_a, -1]), active=put(state.active, real_a),
      rules=jax.tree.map(put, state.rules, token_rules.RowRules.start(adm.phase[take_a])),
      next_row=state.next_row + jnp.sum(real_a.astype(jnp.int32)))
