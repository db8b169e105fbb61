"""Row packing of the actor update: a mini-batch's env steps laid end to end in fewer rows.

Why: `train_batch.build_train_batch` pads every row to the iteration's prompt bucket plus
the response bucket, so a mini-batch whose prompts range from 300 to 640 tokens spends a
third of the update's FLOPs on padding (`train/token_fill` 0.60-0.72 in the SmolLM2 job,
docs/performance.md). Packing puts several steps ("segments") into one row of the same
length, each attending only to itself (its segment id, `hgpo_jax.models.attention`) with
positions that restart at 0, so every real token sees exactly the keys and positions it
sees unpacked.

What stays exact: the loss. The unpacked update averages token means over the mini-batch's
micro-batches (verl's gradient accumulation, `train_step` module docstring), a quantity
that depends on which rows share a micro-batch. Under `token-mean` aggregation it is a
weighted token sum, `sum_t w_t x_t` with `w_t = 1 / (k_active * n_scored(micro(t)))`, the
micro-batch taken in the *unpacked* layout. `pack_mini_batch` computes these weights on the
host before packing, so the packed update (`losses.weighted_actor_loss`) optimises the
same function whatever rows the segments land in; only float reduction order differs.
(The update reads every layout this way: an unpacked mini-batch gets the same weights on
the device, `train_batch.TrainBatch.segments`.)

Scored tokens are gathered into `S` slots per packed row (`score_index`), so the output
layer runs on the scored tokens only (an unpacked row's slots are its response columns).

Layout of a packed row: `[seg 1 | seg 2 | ... | pad]`, a segment = the step's prompt then
its response, real tokens only; `segment_ids` 1, 2, ... per row and 0 on padding.
Padding rows (all 0) bring the row count to a multiple of the micro-batch; they score
nothing.

Rows that move nothing (`skip_zero_advantage`, `train.skip_zero_advantage`): a step whose
scored tokens all have advantage exactly 0 adds exact zeros to the gradient of a loss
whose every term is multiplied by the advantage (PPO-clip and GSPO without the KL and
entropy terms: `UpdateConfig` refuses the option otherwise). Its token weights stay
counted in the others' (the weights come from the whole mini-batch), so dropping it
leaves the loss, its gradient and the optimizer step as they are, up to float summation
order; a group whose trajectories all score alike (GRPO, GiGPO and HGPO give it zero
advantages) then costs no update time. The `entropy` and `approx_kl` metrics, weighted
sums, then cover the updated tokens only (the update divides them by their share of
the weight, `updated_weight`).

Length-grouped micro-batches (`group_mini_batch`, `train.group_by_length`) use the same
layout and the same weights with one segment per row: the mini-batch's steps are sorted
by length and cut into micro-batches of `micro_batch_rows` steps, and each micro-batch
gets its own row length (its longest step, rounded up to `length_multiple`). Where no two
steps fit in one row (packing saves nothing), the short steps still stop paying for the
long ones' padding. The update then runs one compiled gradient program per row length
and takes the optimizer step after the last (`train_step.Learner.update_mini_batch`).

The update takes an iteration as a list of mini-batches, each a tuple of parts (a part:
rows of one shape, cut into micro-batches by the update): `pack_batch` gives one packed
part per mini-batch, `group_batch` one part per micro-batch, `plain_batch` the unpacked
rows as they are (laid out on the device, `train_batch.TrainBatch.segments`).
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from hgpo_jax.training import train_batch as train_batch_lib

PackedBatch = train_batch_lib.SegmentBatch
"""The update's layout (`train_batch.SegmentBatch`), under the name this module's results go by."""


def token_mean_weights(response_mask: np.ndarray, micro_batch_rows: int) -> np.ndarray:
  """f32[M, L] weights `w` with `sum(w * x)` = the unpacked update's token-mean loss.

  The mean over micro-batches that score at least one token (k_active) of each micro-batch's
  mean over its scored tokens; `micro_batch_rows` consecutive rows form a micro-batch (the
  callers pass the loss unit; `train_batch.unit_weights` is the same on the device).
  """
  rows = response_mask.shape[0]
  if rows % micro_batch_rows:
    raise ValueError(f"{rows} rows are not a multiple of micro_batch_rows={micro_batch_rows}.")
  per_micro = response_mask.reshape(rows // micro_batch_rows, -1).sum(axis=1)
  active = max(int(np.sum(per_micro > 0)), 1)
  inv = np.where(per_micro > 0, 1.0 / (active * np.maximum(per_micro, 1)), 0.0)
  w = np.repeat(inv, micro_batch_rows)[:, None] * response_mask
  return w.astype(np.float32)


def _kept_spans(batch: train_batch_lib.TrainBatch,
                skip_zero_advantage: bool = False) -> list[tuple[int, int, int]]:
  """(row, first real column, end) of every row that scores a token (the builder's
  padding copies and empty responses add nothing to the loss and are dropped); with
  `skip_zero_advantage` also the rows whose scored tokens all have advantage 0 are dropped
  (module docstring); a batch with no row kept keeps its first row."""
  input_mask = np.asarray(batch.input_mask, bool)
  response_mask = np.asarray(batch.response_mask, bool)
  moving = (np.asarray(batch.advantages) != 0) & response_mask
  keep = [i for i in range(batch.num_rows) if response_mask[i].any()
          and (not skip_zero_advantage or moving[i].any())] or [0]
  spans = []
  for i in keep:
    cols = np.flatnonzero(input_mask[i])
    start, stop = int(cols[0]), int(cols[-1]) + 1
    if not input_mask[i, start:stop].all():
      raise ValueError(f"row {i}: real tokens are not contiguous; packing needs "
                       "[pad.. prompt | response ..pad] rows (train_batch layout)")
    spans.append((i, start, stop))
  return spans


def _layout(batch: train_batch_lib.TrainBatch, weights: np.ndarray, spans, bins, *,
            num_rows: int, seq_len: int, score_multiple: int, pad_id: int) -> PackedBatch:
  """A PackedBatch of `num_rows` rows of `seq_len` tokens; row r holds the spans
  `bins[r]` (indices into `spans`) in mini-batch order; rows past `len(bins)` are padding."""
  tokens = np.asarray(batch.tokens)
  response_mask = np.asarray(batch.response_mask, bool)
  advantages = np.asarray(batch.advantages, np.float32)
  scored_per_bin = [sum(int(response_mask[spans[j][0]].sum()) for j in b) for b in bins]
  slots = max(score_multiple, -(-max(scored_per_bin) // score_multiple) * score_multiple)
  out_tokens = np.full((num_rows, seq_len), pad_id, np.int32)
  positions = np.zeros((num_rows, seq_len), np.int32)
  segment_ids = np.zeros((num_rows, seq_len), np.int32)
  score_index = np.ones((num_rows, slots), np.int32)
  score_mask = np.zeros((num_rows, slots), bool)
  out_adv = np.zeros((num_rows, slots), np.float32)
  out_w = np.zeros((num_rows, slots), np.float32)
  choices = None if batch.choices is None else np.asarray(batch.choices, np.int32)
  out_choices = None if choices is None else np.full((num_rows, slots, choices.shape[-1]), -1,
                                                     np.int32)
  for r, members in enumerate(bins):
    col, slot = 0, 0
    for seg, j in enumerate(sorted(members), start=1):  # segments in mini-batch order
      i, start, stop = spans[j]
      n = stop - start
      out_tokens[r, col:col + n] = tokens[i, start:stop]
      positions[r, col:col + n] = np.arange(n)
      segment_ids[r, col:col + n] = seg
      scored = np.flatnonzero(response_mask[i, start:stop])
      k = len(scored)
      score_index[r, slot:slot + k] = col + scored
      score_mask[r, slot:slot + k] = True
      out_adv[r, slot:slot + k] = advantages[i, start + scored]
      out_w[r, slot:slot + k] = weights[i, start + scored]
      if choices is not None:
        out_choices[r, slot:slot + k] = choices[i, start + scored]
      col += n
      slot += k
  zeros = np.zeros((num_rows, slots), np.float32)
  return PackedBatch(tokens=out_tokens, positions=positions, segment_ids=segment_ids,
                     score_index=score_index, score_mask=score_mask, advantages=out_adv,
                     loss_weights=out_w, old_logprobs=zeros, ref_logprobs=zeros.copy(),
                     choices=out_choices)


def _bins(lengths: Sequence[int], capacity: int) -> list[list[int]]:
  """First-fit decreasing: segment indices per row; ties keep the input order."""
  order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
  bins: list[list[int]] = []
  free: list[int] = []
  for i in order:
    for b, room in enumerate(free):
      if lengths[i] <= room:
        bins[b].append(i)
        free[b] -= lengths[i]
        break
    else:
      bins.append([i])
      free.append(capacity - lengths[i])
  return bins


def pack_mini_batch(batch: train_batch_lib.TrainBatch, *, micro_batch_rows: int,
                    row_multiple: Optional[int] = None, score_multiple: int = 32,
                    pad_id: int = 0, loss_unit_rows: int = 0,
                    skip_zero_advantage: bool = False) -> PackedBatch:
  """Packs one host mini-batch (a `build_train_batch` result, `M` rows) into rows of the
  same length.

  Args:
    batch: numpy TrainBatch of one mini-batch (old/ref log-probs are not carried: fill
      them on the packed batch).
    micro_batch_rows: the unpacked micro-batch (defines the loss weights unless
      `loss_unit_rows` is set).
    row_multiple: packed rows are padded to a multiple of this (default micro_batch_rows:
      the packed batch is split into micro-batches of that many rows).
    score_multiple: score slots per row are rounded up to a multiple of this, so that
      iterations reuse compiled shapes (the response bucket is a good choice).
    pad_id: token at padding positions.
    loss_unit_rows: rows per loss unit (`train_step.UpdateConfig.loss_unit_rows`): the
      weights average token means over units of this many unpacked rows; 0: micro_batch_rows.
    skip_zero_advantage: also drop the rows whose scored tokens all have advantage 0
      (module docstring).

  Rows without a scored token (the builder's padding copies, empty responses) add nothing
  to the loss and are dropped; a mini-batch with no scored token keeps its first row.
  """
  row_multiple = row_multiple or micro_batch_rows
  weights = token_mean_weights(np.asarray(batch.response_mask, bool),
                              loss_unit_rows or micro_batch_rows)
  spans = _kept_spans(batch, skip_zero_advantage)
  bins = _bins([stop - start for _, start, stop in spans], batch.seq_len)
  n_rows = -(-len(bins) // row_multiple) * row_multiple
  return _layout(batch, weights, spans, bins, num_rows=n_rows, seq_len=batch.seq_len,
                 score_multiple=score_multiple, pad_id=pad_id)


def group_mini_batch(batch: train_batch_lib.TrainBatch, *, micro_batch_rows: int,
                     length_multiple: int, score_multiple: int = 32,
                     pad_id: int = 0, loss_unit_rows: int = 0,
                     skip_zero_advantage: bool = False) -> tuple[PackedBatch, ...]:
  """One host mini-batch as length-grouped micro-batches (module docstring).

  The steps that score a token, longest first (ties in row order), are cut into
  micro-batches of `micro_batch_rows` steps, one step per row from column 0; each
  micro-batch's rows are as long as its longest step rounded up to `length_multiple`
  (at most the batch's own row length), and the last one is completed with padding rows.
  The loss weights are those of the unpacked mini-batch (loss units of `loss_unit_rows`
  rows, 0: micro_batch_rows), so the update optimises the same loss. With
  `skip_zero_advantage` the steps whose scored tokens all have advantage 0 are left out
  (module docstring).

  Returns:
    the micro-batches, longest rows first; each a PackedBatch of `micro_batch_rows` rows.
  """
  if length_multiple < 1:
    raise ValueError(f"length_multiple={length_multiple} must be >= 1.")
  weights = token_mean_weights(np.asarray(batch.response_mask, bool),
                              loss_unit_rows or micro_batch_rows)
  spans = _kept_spans(batch, skip_zero_advantage)
  length = [stop - start for _, start, stop in spans]
  order = sorted(range(len(spans)), key=lambda j: (-length[j], j))
  micro = []
  for s in range(0, len(order), micro_batch_rows):
    members = order[s:s + micro_batch_rows]
    seq = min(-(-length[members[0]] // length_multiple) * length_multiple, batch.seq_len)
    micro.append(_layout(batch, weights, spans, [[j] for j in members],
                         num_rows=micro_batch_rows, seq_len=seq,
                         score_multiple=score_multiple, pad_id=pad_id))
  return tuple(micro)


def _each_mini_batch(batch: train_batch_lib.TrainBatch, mini_batch_rows: int, lay_out, **options):
  """`lay_out(mini-batch, **options)` of every mini-batch of a host TrainBatch, in order."""
  return [lay_out(chunk, **options) for chunk in train_batch_lib.row_chunks(batch, mini_batch_rows)]


def plain_batch(batch: train_batch_lib.TrainBatch, *, mini_batch_rows: int) -> list[tuple]:
  """Every mini-batch of a host TrainBatch as it is: one part each (the update lays it out
  as one segment per row, `train_batch.TrainBatch.segments`)."""
  return _each_mini_batch(batch, mini_batch_rows, lambda chunk: (chunk,))


def group_batch(batch: train_batch_lib.TrainBatch, *, mini_batch_rows: int, micro_batch_rows: int,
                length_multiple: int, score_multiple: int = 32,
                pad_id: int = 0, loss_unit_rows: int = 0,
                skip_zero_advantage: bool = False) -> list[tuple]:
  """`group_mini_batch` of every mini-batch of a host TrainBatch, in order."""
  return _each_mini_batch(batch, mini_batch_rows, group_mini_batch, micro_batch_rows=micro_batch_rows,
                          length_multiple=length_multiple, score_multiple=score_multiple,
                          pad_id=pad_id, loss_unit_rows=loss_unit_rows,
                          skip_zero_advantage=skip_zero_advantage)


def pack_batch(batch: train_batch_lib.TrainBatch, *, mini_batch_rows: int, micro_batch_rows: int,
               row_multiple: Optional[int] = None, score_multiple: int = 32,
               pad_id: int = 0, loss_unit_rows: int = 0,
               skip_zero_advantage: bool = False) -> list[tuple]:
  """`pack_mini_batch` of every mini-batch of a host TrainBatch, in order, one part each."""
  pack = lambda chunk, **options: (pack_mini_batch(chunk, **options),)
  return _each_mini_batch(batch, mini_batch_rows, pack, micro_batch_rows=micro_batch_rows,
                          row_multiple=row_multiple, score_multiple=score_multiple, pad_id=pad_id,
                          loss_unit_rows=loss_unit_rows, skip_zero_advantage=skip_zero_advantage)


def num_rows(batches: Sequence[tuple]) -> int:
  """Rows of an iteration's mini-batches (summed over their parts)."""
  return sum(part.num_rows for parts in batches for part in parts)


def token_fill(batches: Sequence[tuple]) -> float:
  """Real share of the tokens of an iteration's mini-batches (the unpacked batch's
  `mean(input_mask)`)."""
  parts = [part for parts in batches for part in parts]
  real = sum(int(np.sum(np.asarray(part.input_mask))) for part in parts)
  return real / sum(part.num_rows * part.seq_len for part in parts)
