"""The device program's arguments: `DecodeInputs` (arrays, one pytree) and `DecodeFlags`
(static, hashable), plus the left-padded prompt layout both the prefill and the decode read.

`Sampler.generate` packs a call into a `DecodeInputs` of host arrays placed on the mesh;
`hgpo_jax.training.programs` builds the same dataclass of `jax.ShapeDtypeStruct`s
(`DecodeInputs.abstract`), so the trainer's call and the registry's lowering cannot
disagree on an argument's order. Fields flatten in the order they are declared.

Left padding: row b holds its n_b prompt tokens in slots [P - n_b, P); slot s has RoPE
position s - (P - n_b), so the first real token has position 0 whatever the padding.
Query slot q attends key slot s iff P - n_b <= s <= q.
"""

from __future__ import annotations

import dataclasses

import flax
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hgpo_jax.models import sharding
from hgpo_jax.sampling import types


@flax.struct.dataclass
class TrieArrays:
  """The per-row constraint tries the device reads (`constrained.ConstraintTries`' arrays;
  shapes there). Inside the decode the tables of a step's rows are gathered by row."""
  edge_parent: jax.Array
  edge_token: jax.Array
  edge_child: jax.Array
  terminal: jax.Array
  has_children: jax.Array
  active: jax.Array
  free_class: jax.Array
  free_min: jax.Array
  free_max: jax.Array
  to_leaf: jax.Array

  @classmethod
  def of(cls, tries) -> "TrieArrays":
    """The arrays of a `constrained.ConstraintTries` (its host-side fields dropped)."""
    return cls(**{f.name: getattr(tries, f.name) for f in dataclasses.fields(cls)})

  def rows(self, rows_b) -> "TrieArrays":
    """The tables of rows `rows_b`; `active` stays the call's (it is read once, at the
    start of the call, never per step)."""
    gathered = {f.name: getattr(self, f.name)[rows_b] for f in dataclasses.fields(self)
                if f.name != "active"}
    return TrieArrays(active=self.active, **gathered)


@flax.struct.dataclass
class DecodeInputs:
  """The arrays of one generate call (B rows bucketed, prompts P slots, U prefilled rows).

  Attributes:
    tokens: i32[B, P] left-padded prompts (padding rows: one pad token).
    lengths: i32[B] prompt lengths.
    row_valid: bool[B] real rows (the rest are bucket padding, finished at once).
    prefill_tokens: i32[U, P] the prompts that are prefilled (`tokens` itself, U = B,
      unless `DecodeFlags.shared_prefill`: the distinct prompts).
    prefill_lengths: i32[U] their lengths.
    source: i32[B] the prefilled row whose cache row b takes.
    rng: the call's PRNG key: token j of row b uses `fold_in(fold_in(rng, j), b)`.
    temperature, top_k, top_p: f32, i32, f32 scalars (traced: one program for all values).
    stop_table: i32[A, V] the stop strings' token automaton (`constrained.TokenAutomaton`).
    use_stop: bool scalar: the call has stop strings.
    need_logprobs: bool scalar: every recorded token must have its log-prob
      (`types.SamplingParams.need_logprobs`).
    tries: the per-row constraint tries.
    free_masks: bool[C, V] tokens a free span of each class may write.
  """
  tokens: jax.Array
  lengths: jax.Array
  row_valid: jax.Array
  prefill_tokens: jax.Array
  prefill_lengths: jax.Array
  source: jax.Array
  rng: jax.Array
  temperature: jax.Array
  top_k: jax.Array
  top_p: jax.Array
  stop_table: jax.Array
  use_stop: jax.Array
  need_logprobs: jax.Array
  tries: TrieArrays
  free_masks: jax.Array

  @classmethod
  def abstract(cls, *, rows: int, prompt: int, unique: int, vocab: int, stop_rows: int,
               tries: TrieArrays, free_classes: int = 2, mesh=None) -> "DecodeInputs":
    """`jax.ShapeDtypeStruct`s of a call's inputs, placed as `Sampler.generate` places
    them on `mesh` (rows over the batch axes, tables replicated; see `placed`)."""
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    key = jax.eval_shape(lambda: jax.random.key(0))
    shapes = cls(
        tokens=sds((rows, prompt), jnp.int32), lengths=sds((rows,), jnp.int32),
        row_valid=sds((rows,), jnp.bool_), prefill_tokens=sds((unique, prompt), jnp.int32),
        prefill_lengths=sds((unique,), jnp.int32), source=sds((rows,), jnp.int32),
        rng=key, temperature=sds((), jnp.float32), top_k=sds((), jnp.int32),
        top_p=sds((), jnp.float32), stop_table=sds((stop_rows, vocab), jnp.int32),
        use_stop=sds((), jnp.bool_), need_logprobs=sds((), jnp.bool_),
        tries=jax.tree.map(lambda t: sds(t.shape, t.dtype), tries),
        free_masks=sds((free_classes, vocab), jnp.bool_))
    if mesh is None:
      return shapes
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, shardings(shapes, mesh))


_BY_ROW = ("tokens", "lengths", "row_valid", "prefill_tokens", "prefill_lengths", "source")
"""Fields split over the mesh's batch axes along their leading dim (by their own size)."""


def shardings(inputs: DecodeInputs, mesh) -> DecodeInputs:
  """A `DecodeInputs` of NamedShardings: the row arrays over the logical "batch" axis (a
  leading dim it does not divide stays whole), the tries by row when they have one per
  row, everything else replicated."""
  rows = inputs.tokens.shape[0]
  rep = NamedSharding(mesh, P())

  def by_row(x):
    spec = sharding.logical_to_spec(("batch",) + (None,) * (len(x.shape) - 1), mesh,
                                    shape=x.shape)
    return NamedSharding(mesh, spec)

  fields = {f.name: rep for f in dataclasses.fields(DecodeInputs)}
  fields.update({name: by_row(getattr(inputs, name)) for name in _BY_ROW})
  fields["tries"] = jax.tree.map(lambda t: by_row(t) if t.shape[0] == rows else rep,
                                 inputs.tries)
  return DecodeInputs(**fields)


@dataclasses.dataclass(frozen=True)
class DecodeFlags:
  """The static arguments of the generate program (part of its compile key).

  Attributes:
    max_new_tokens: most tokens sampled per row (M; the cache holds P + M - 1 slots).
    greedy: argmax decoding (temperature 0).
    filtered: top-k or top-p on (`logits.filter_logits`).
    constraint_mode: `types.NO_CONSTRAINT` or `types.WHOLE_CONSTRAINT`.
    ignore_eos: keep sampling past EOS tokens.
    shared_prefill: prefill the U distinct prompts `DecodeInputs.prefill_tokens` and give
      row b the cache row `source[b]`.
    slots: 0 decodes all B rows in lockstep; S < B decodes S cache rows and admits the
      next rows as slots free (`engine.slotted_decode`).
  """
  max_new_tokens: int
  greedy: bool
  filtered: bool
  constraint_mode: int
  ignore_eos: bool
  shared_prefill: bool
  slots: int = 0

  @classmethod
  def of(cls, params: types.SamplingParams, *, constrained: bool, shared_prefill: bool,
         slots: int) -> "DecodeFlags":
    """The flags of a call with `params`."""
    return cls(max_new_tokens=params.max_new_tokens, greedy=params.greedy,
               filtered=params.filtered,
               constraint_mode=types.WHOLE_CONSTRAINT if constrained else types.NO_CONSTRAINT,
               ignore_eos=params.ignore_eos, shared_prefill=shared_prefill, slots=slots)


def left_padded(prompts, rows: int, plen: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
  """(i32[rows, P] `prompts` left-padded with `pad_id`, i32[rows] their lengths); rows
  past the prompts hold one pad token (finished at once)."""
  tokens = np.full((rows, plen), pad_id, np.int32)
  lengths = np.ones((rows,), np.int32)
  for b, prompt in enumerate(prompts):
    tokens[b, plen - len(prompt):] = prompt
    lengths[b] = len(prompt)
  return tokens, lengths


def prefill_layout(lengths_b: jax.Array, prompt_len: int) -> tuple[jax.Array, jax.Array]:
  """(positions, segment ids), each int32[B, P-1], of the prefill of left-padded prompts.

  Row b holds its n_b = lengths_b[b] prompt tokens in slots [P - n_b, P) (module
  docstring); the prefill runs slots [0, P-1). Slot s has position max(s - (P - n_b), 0)
  and segment 1 if real, else 0 (padding, which real tokens never read).
  """
  pad_b = prompt_len - lengths_b
  slot_t = jnp.arange(prompt_len - 1)
  positions_bt = jnp.maximum(slot_t[None, :] - pad_b[:, None], 0)
  return positions_bt, (slot_t[None, :] >= pad_b[:, None]).astype(jnp.int32)


def decode_positions(lengths_b: jax.Array, step) -> jax.Array:
  """int32[B, 1] position of the token fed at decode step `step` (the last prompt token at
  step 0), written at cache slot P - 1 + step. The decoder reads row b's earlier tokens
  from the slots [slot - position, slot) = [P - n_b, slot): no mask is needed."""
  return (lengths_b - 1 + step)[:, None]
