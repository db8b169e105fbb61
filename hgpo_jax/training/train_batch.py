"""The token-level training batch (one row per env step) and its host-side builder.

Layout of a row (verl's layout): `tokens[b] = [pad.. prompt | response ..pad]`, the
prompt left-padded to the prompt bucket `P`, the response right-padded to the response
bucket `Rt`, `L = P + Rt`. Padding tokens have `input_mask` False and position 0 (the
first real token also has position 0; positions count real tokens only).

Scoring convention (used by `train_step.scored_logprobs` and the losses): a per-token
array `x_bl` holds at column `l` the quantity *of token `l`*, computed from the model
output at position `l - 1` (the position that predicts it). `response_mask[b, l]` is
True exactly for the real response tokens, so column 0 (always prompt or padding) is
never scored and holds 0.

Row padding: rows are padded up to a multiple of `row_multiple` (the mini-batch size,
itself a multiple of the micro-batch size x the data-parallel size) by *copying real
rows with an all-False response mask and zero advantages*. verl's `adjust_batch`
duplicates rows with their masks, which double-counts those rows in the loss; here the
copies exist only so that every shape divides evenly (docs/algorithms.md §1: the padding is
for divisibility), and they contribute nothing to the loss or the gradient. Copies rather
than pad-token rows keep every attention row non-empty.

The update's one layout is `SegmentBatch`: token rows of segments, each attending to
itself only, with the scored tokens gathered into score slots. A TrainBatch mini-batch
is one segment per row (`TrainBatch.segments`: segment id 1 on its real tokens, 0 on
padding, score slots = its response columns); `training.packing` fills the same layout
with several steps per row (packing) or with micro-batches of their own row lengths
(length grouping). Each layout carries per-slot loss weights that make every
micro-batch's loss its share of the mini-batch loss (`unit_weights`).
"""

from __future__ import annotations

import bisect
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np


@flax.struct.dataclass
class TrainBatch:
  """Token-level batch. `B` rows (env steps), `L` = prompt bucket + response bucket."""

  tokens: jax.Array
  """int32[B, L]: left-padded prompt followed by the right-padded response."""
  positions: jax.Array
  """int32[B, L]: 0-based position of each real token; 0 on padding."""
  input_mask: jax.Array
  """bool[B, L]: real (non-padding) tokens."""
  response_mask: jax.Array
  """bool[B, L]: scored tokens: the real response tokens (all False on padding rows)."""
  advantages: jax.Array
  """f32[B, L]: advantage of token l (0 where not scored)."""
  old_logprobs: jax.Array
  """f32[B, L]: log pi_old(token l | tokens < l); the builder leaves 0 (`train_step.fill_logprobs`
  fills them in the `SegmentBatch` this batch is laid out as, on the device)."""
  ref_logprobs: jax.Array
  """f32[B, L]: log pi_ref(token l | tokens < l); as `old_logprobs`."""
  rollout_logprobs: Optional[jax.Array] = None
  """f32[B, L]: the sampler's log-prob of token l when it sampled it (0 off the scored
  tokens); None when the builder got none."""
  choices: Optional[jax.Array] = None
  """int32[B, L, K]: the token ids the constraint allowed at token l (-1 padded), for the
  constrained log-probs (`with_choices`); all -1 where the whole vocabulary was open. None:
  every token is scored under the full softmax."""

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def seq_len(self) -> int:
    return self.tokens.shape[1]

  def segments(self, score_columns: Optional[int], unit_rows: int,
               with_rollout: bool = False) -> "SegmentBatch":
    """This mini-batch in the update's layout, one segment per row (numpy or traced).

    Args:
      score_columns: score slots are the last `score_columns` columns (the response
        bucket: the output layer runs there only); None: every column but the first.
        Scored tokens must lie in them (the builder puts responses last).
      unit_rows: rows per loss unit (`unit_weights`).
      with_rollout: carry `rollout_logprobs` (the loss reads them: rollout correction);
        else the layout leaves them out, and the update's inputs are those without them.
    """
    seq = self.seq_len
    first = seq - (seq - 1 if score_columns is None else min(score_columns, seq - 1))
    tail = lambda x: x[:, first:]
    response_mask = tail(self.response_mask)
    return SegmentBatch(
        tokens=self.tokens, positions=self.positions,
        segment_ids=jnp.asarray(self.input_mask).astype(jnp.int32),
        score_index=jnp.broadcast_to(jnp.arange(first, seq, dtype=jnp.int32),
                                     (self.num_rows, seq - first)),
        score_mask=response_mask, advantages=tail(self.advantages),
        loss_weights=unit_weights(response_mask[..., None], unit_rows)[..., 0],
        old_logprobs=tail(self.old_logprobs), ref_logprobs=tail(self.ref_logprobs),
        rollout_logprobs=tail(self.rollout_logprobs) if with_rollout else None,
        choices=None if self.choices is None else tail(self.choices))


@flax.struct.dataclass
class SegmentBatch:
  """The update's layout (module docstring): `R` rows of `L` tokens, `S` score slots per row.

  Every log-prob pass and every update step reads this layout; a plain row is one
  segment (`TrainBatch.segments`), a packed row several (`packing.pack_mini_batch`).
  """

  tokens: jax.Array
  """int32[R, L]: the row's segments (left-padded prompt and response for a plain row;
  segments end to end, then `pad_id`, for a packed one)."""
  positions: jax.Array
  """int32[R, L]: position within the segment (0 at each segment's first token; 0 on pad)."""
  segment_ids: jax.Array
  """int32[R, L]: 1, 2, ... for the row's segments, 0 on padding."""
  score_index: jax.Array
  """int32[R, S]: column of each scored (response) token; unused slots hold any column >= 1."""
  score_mask: jax.Array
  """bool[R, S]: used slots."""
  advantages: jax.Array
  """f32[R, S]: advantage of the slot's token."""
  loss_weights: jax.Array
  """f32[R, S]: weight of the slot's token in the mini-batch's token-mean loss (`unit_weights`)."""
  old_logprobs: jax.Array
  """f32[R, S]: log pi_old of the slot's token; filled by `train_step.fill_logprobs`."""
  ref_logprobs: jax.Array
  """f32[R, S]: log pi_ref of the slot's token; filled by `train_step.fill_logprobs`."""
  rollout_logprobs: Optional[jax.Array] = None
  """f32[R, S]: the sampler's log-prob of the slot's token; None unless the loss reads it
  (`TrainBatch.segments(..., with_rollout=True)`)."""
  choices: Optional[jax.Array] = None
  """int32[R, S, K]: the token ids the constraint allowed at the slot's token (-1 padded;
  all -1: the full softmax); None: every slot under the full softmax (`TrainBatch.choices`)."""

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def seq_len(self) -> int:
    return self.tokens.shape[1]

  @property
  def input_mask(self):
    """bool[R, L]: real (non-padding) tokens."""
    return self.segment_ids > 0

  def segments(self, score_columns: Optional[int], unit_rows: int,
               with_rollout: bool = False) -> "SegmentBatch":
    """Itself: already laid out (the signature of `TrainBatch.segments`)."""
    del score_columns, unit_rows, with_rollout
    return self


def unit_weights(mask_mlc: jax.Array, unit_rows: int) -> jax.Array:
  """f32[M, L, C] token weights of a mini-batch whose loss unit is `unit_rows` rows.

  With `U` the units (consecutive `unit_rows` rows) that score an entry, `n_uc` the scored
  entries of unit u in channel c (the actor: C = 1, its response tokens; the critic: one
  channel per value head) and `w_t = 1 / (U * n_uc)` on the scored entries (0 elsewhere),

      sum_t w_t x_t = (1 / U) sum_u sum_c token-mean_{u,c}(x),

  verl's loss (per-GPU micro-batch token means, / gradient accumulation, averaged over
  GPUs), whatever the micro-batches of the update are. With units equal to micro-batches
  it is the mean over active micro-batches of their token means. (`packing` computes the
  same weights on the host, `packing.token_mean_weights`, before it moves tokens.)

  Args:
    mask_mlc: bool[M, L, C] scored entries; M a multiple of unit_rows.
    unit_rows: rows per unit.
  """
  mask = jnp.asarray(mask_mlc).astype(jnp.float32)
  rows, channels = mask.shape[0], mask.shape[-1]
  counts_uc = mask.reshape(rows // unit_rows, -1, channels).sum(axis=1)
  active = jnp.maximum(jnp.sum(jnp.any(counts_uc > 0, axis=-1)), 1).astype(jnp.float32)
  inv_uc = jnp.where(counts_uc > 0, 1.0 / (active * jnp.maximum(counts_uc, 1.0)), 0.0)
  return jnp.repeat(inv_uc, unit_rows, axis=0)[:, None, :] * mask


def pick_bucket(length: int, buckets: Sequence[int], what: str) -> int:
  """The smallest bucket >= length; a clear error if none fits."""
  buckets = sorted(buckets)
  i = bisect.bisect_left(buckets, length)
  if i == len(buckets):
    raise ValueError(f"{what} length {length} exceeds the largest bucket {buckets[-1]}; add a larger bucket or truncate.")
  return buckets[i]


def build_train_batch(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    advantages: np.ndarray | Sequence[Sequence[float]],
    *,
    prompt_buckets: Sequence[int],
    response_buckets: Sequence[int],
    row_multiple: int,
    pad_id: int = 0,
    row_buckets: Optional[Sequence[int]] = None,
) -> tuple[TrainBatch, int]:
  """Builds a padded numpy TrainBatch from token ids (host side, no JAX).

  Args:
    prompt_ids: N prompts, each a non-empty sequence of token ids.
    response_ids: N responses (may be empty: such a row scores nothing).
    advantages: f32[N] one advantage per row, broadcast to its response tokens, or N
      per-token sequences, each as long as its response.
    prompt_buckets: allowed prompt lengths P (the smallest that fits all prompts is used).
    response_buckets: allowed response lengths.
    row_multiple: rows are padded to a multiple of this (the mini-batch size).
    pad_id: token id written at padding positions (never attended to, never scored).
    row_buckets: optional allowed row counts (each a multiple of row_multiple) so that
      iterations with different step counts reuse compiled shapes.

  Returns:
    (batch, num_real_rows): the batch holds numpy arrays; old/ref log-probs are zeros.
  """
  n = len(prompt_ids)
  if n == 0 or len(response_ids) != n:
    raise ValueError(f"need the same positive number of prompts and responses, got {n} and {len(response_ids)}.")
  if row_multiple <= 0:
    raise ValueError(f"row_multiple={row_multiple} must be positive.")
  if any(len(p) == 0 for p in prompt_ids):
    raise ValueError("every prompt needs at least one token (the first response token is predicted from it).")
  per_row = isinstance(advantages, np.ndarray) and advantages.ndim == 1
  if per_row and advantages.shape[0] != n:
    raise ValueError(f"got {advantages.shape[0]} row advantages for {n} rows.")
  if not per_row:
    if len(advantages) != n or any(len(a) != len(r) for a, r in zip(advantages, response_ids)):
      raise ValueError("per-token advantages must give one value per response token of every row.")

  p_len = pick_bucket(max(len(p) for p in prompt_ids), prompt_buckets, "prompt")
  r_len = pick_bucket(max(len(r) for r in response_ids), response_buckets, "response")
  rows = -(-n // row_multiple) * row_multiple
  if row_buckets is not None:
    rows = pick_bucket(rows, row_buckets, "row count")
    if rows % row_multiple:
      raise ValueError(f"row bucket {rows} is not a multiple of row_multiple={row_multiple}.")
  seq = p_len + r_len

  tokens = np.full((rows, seq), pad_id, np.int32)
  input_mask = np.zeros((rows, seq), bool)
  response_mask = np.zeros((rows, seq), bool)
  adv = np.zeros((rows, seq), np.float32)
  for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
    tokens[i, p_len - len(p):p_len] = p
    tokens[i, p_len:p_len + len(r)] = r
    input_mask[i, p_len - len(p):p_len + len(r)] = True
    response_mask[i, p_len:p_len + len(r)] = True
    adv[i, p_len:p_len + len(r)] = advantages[i] if per_row else np.asarray(advantages[i], np.float32)
  # Padding rows: copies of real rows (cyclically), nothing scored.
  for i in range(n, rows):
    tokens[i] = tokens[i % n]
    input_mask[i] = input_mask[i % n]
  positions = np.maximum(np.cumsum(input_mask, axis=1, dtype=np.int32) - 1, 0).astype(np.int32)
  positions = np.where(input_mask, positions, 0).astype(np.int32)
  zeros = np.zeros((rows, seq), np.float32)
  batch = TrainBatch(
      tokens=tokens, positions=positions, input_mask=input_mask, response_mask=response_mask,
      advantages=adv, old_logprobs=zeros, ref_logprobs=zeros.copy())
  return batch, n


def with_rollout_logprobs(batch: TrainBatch, logprobs: Sequence[Sequence[float]]) -> TrainBatch:
  """`batch` (host arrays, `build_train_batch`'s layout) with `rollout_logprobs`: row i's
  response is the last `len(logprobs[i])` real tokens of the row, and each gets its value
  (the sampler's log-prob of the token); padding rows and prompts hold 0.

  Args:
    logprobs: one sequence per real row (the first len(logprobs) rows), each as long as
      the row's response.
  """
  input_mask = np.asarray(batch.input_mask, bool)
  out = np.zeros(input_mask.shape, np.float32)
  for i, values in enumerate(logprobs):
    if len(values):
      columns = np.flatnonzero(input_mask[i])[-len(values):]
      out[i, columns] = np.asarray(values, np.float32)
  return batch.replace(rollout_logprobs=out)


def with_choices(batch: TrainBatch, choices: Sequence[Optional[Sequence[Sequence[int]]]],
                 max_choices: int) -> TrainBatch:
  """`batch` (host arrays, `build_train_batch`'s layout) scored under the constraint that
  sampled it: `choices[i]` holds, per response token of row i, the ids the constraint
  allowed there (`rollout.StepRow.response_choices`; None: the row decoded freely).

  A token with two or more allowed ids gets them in `choices` (the learner's log-softmax
  runs over them: the log-prob of the policy that acted); a forced token (one id) carries
  no choice (its constrained log-prob is 0 whatever the weights) and leaves the response
  mask; a token with none (a free span, a free row) stays scored under the full softmax.

  Raises:
    ValueError: a token had more than `max_choices` allowed ids.
  """
  input_mask = np.asarray(batch.input_mask, bool)
  response_mask = np.array(batch.response_mask, bool)
  out = np.full(input_mask.shape + (max_choices,), -1, np.int32)
  for i, row in enumerate(choices):
    if not row:
      continue
    columns = np.flatnonzero(input_mask[i])[-len(row):]
    for column, allowed in zip(columns, row):
      if len(allowed) > max_choices:
        raise ValueError(f"a response token had {len(allowed)} allowed tokens, more than "
                         f"train.max_choices={max_choices}; raise it")
      if len(allowed) == 1:
        response_mask[i, column] = False
      elif allowed:
        out[i, column, :len(allowed)] = allowed
  return batch.replace(choices=out, response_mask=response_mask)


def slice_rows(batch: TrainBatch, start: int, stop: int) -> TrainBatch:
  """Rows [start, stop) of every field (host or device arrays)."""
  return jax.tree.map(lambda x: x[start:stop], batch)


def row_chunks(batch, size: int) -> list:
  """`batch` (any batch of rows: TrainBatch, SegmentBatch, `critic_step.ValueBatch`) in
  consecutive chunks of `size` rows (the batch itself if it is one chunk)."""
  if batch.num_rows % size:
    raise ValueError(f"batch has {batch.num_rows} rows, not a multiple of mini_batch_rows={size}; "
                     f"build it with row_multiple=mini_batch_rows.")
  if batch.num_rows == size:
    return [batch]
  return [slice_rows(batch, start, start + size) for start in range(0, batch.num_rows, size)]
