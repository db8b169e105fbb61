"""Decode attention kernels that read only each row's valid cache slots (Pallas, GPU and TPU).

Drop-in replacements, by signature, for `attention.decode_attention` (the readable XLA form,
which reads all S slots of every row and masks them): T new tokens (T = 1 when sampling) of
row b attend over the cache slots [cache_start_b[b], end_b) of a KV cache [B, Hkv, S, Dh]
(end_b = cache_index, or cache_index[b] per row) and over themselves by the segment rule
(1) of attention.py. Decode at small batch is bound by memory bandwidth, so the kernels
skip the cache blocks that hold no valid slot instead of loading and masking them.

  `decode_attention_gpu`  Pallas on the Triton backend: split-K flash decoding (Dao et al.,
    "Flash-Decoding for long-context inference", 2023; split-K as in CUTLASS GEMMs). Grid
    (B, Hkv, k_splits): each program owns one row, one kv head with all G = H / Hkv query
    heads (and all T new tokens) as the rows of one matrix, and a contiguous range of
    cache blocks, of which its loop visits only those that intersect the row's valid
    range (masked loads inside the two boundary blocks, so invalid slots are never read).
    Each split writes its normalised partial output and log-sum-exp; they are combined
    by (2) outside the kernel, for a sampling step with many splits (few rows) by a
    second kernel (`gpu_merge_splits`, grid (B, Hkv)) where XLA would launch three.
  `decode_attention_tpu`  Pallas on Mosaic (TPU): grid (B / rows_per_step,), each step a
    group of rows, with each row's [start, end) as scalar-prefetch operands. The caches
    stay in HBM; the kernel copies each row's valid blocks of all kv heads into a two-slot
    VMEM buffer itself (the next copy in flight while the current block is computed), so
    no invalid block is copied and no grid step is spent on one; an online softmax
    (FlashAttention's recurrence) runs across each row's blocks in VMEM scratch.

The new tokens are not in the cache yet. A sampling step has one (T = 1), which every
query reads by rule (1) whatever its segment: both kernels take its key and value and fold
it into their online softmax as one more slot (`_fold_new_token`; the GPU kernel in its
first split), so the step's attention is the kernel and, on GPU, the merge of its splits.
For T > 1 (a T x T problem by rule (1)) the new tokens' attention over themselves is
computed in plain JAX. Parts are merged by log-sum-exp:
    out = sum_i exp(lse_i - M) o_i / sum_i exp(lse_i - M),   M = max_i lse_i,         (2)
over the parts i (cache splits, new tokens); an empty part has o = 0 and lse = -1e30, and
the part holding the new tokens is never empty (every query reads itself), so (2) is
always defined.

Both also take `layer=` with all layers' caches [L, B, Hkv, S, Dh] and read that layer in
place. Inside a scan over layers, passing each layer's slice (scan xs) instead makes XLA
materialise the slice before the custom call, a copy of the layer's whole cache per layer
and step (tests/models/test_decode_kernels.py shows it on XLA:TPU).

Both kernels run off-device in Pallas interpret mode (`interpret=None` picks it when the
target platform is not the kernel's; the DMA test passes
`pltpu.InterpretParams()`). Limits: `decode_attention_gpu` needs a power-of-two head_dim
and a cache length S that is a multiple of 16 (Triton tensors have power-of-two sides);
`decode_attention_tpu` takes any S (blocks of 512, 256 or 128 slots when they divide S,
else one block of S, which skips nothing) and any B (`tpu_rows_per_step`). See docs/decode_kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from hgpo_jax.models import attention

# Large negative instead of -inf (as in attention.py): exp(-1e30 - m) is exactly 0 for any
# finite m, and an empty part's log-sum-exp stays finite.
_MASKED = -1e30

GPU_BLOCK_K = 64
"""Cache slots per loop iteration of the GPU kernel (a power of two >= 16)."""
GPU_TARGET_PROGRAMS = 512
"""The GPU kernel's default k_splits aims at about this many programs (B x Hkv x k_splits),
a few per SM of an H100/H200 (132 SMs), so that one row alone still fills the GPU."""
GPU_MERGE_MIN_SPLITS = 9
"""A sampling step's splits are merged by `gpu_merge_splits` (one kernel) from this many
on, by XLA below. Read from XLA:GPU's deviceless compile of the 1.5B decode step (jax
0.10.2's CUDA 12 plugin, docs/performance.md): XLA fuses a merge of 2 or 4 splits into one
kernel, of 8 into two, of 24 (one row) into three; the merge kernel writes padded query
rows whose slice is one more kernel unless the o projection's matvec fuses it (one row)."""
TPU_BLOCK_CHOICES = (512, 256, 128)
"""Cache slots per copy of the TPU kernel: the largest of these dividing S."""
TPU_ROWS_PER_STEP = 8
"""Rows per grid step of the TPU kernel (at most; `tpu_rows_per_step`). A Pallas TPU grid
step has a fixed cost whether or not it computes; one step per (row, block) made 8,064
steps per decode step of the 1.5B paper setting on a v5e-8 chip, one per 8 rows makes 112,
with the rows' blocks copied by the kernel's own loop."""


# ---------------------------------------------------------------------------------------
# Shared pieces: valid ranges, query layout, the new tokens' part, the merge (2)
# ---------------------------------------------------------------------------------------
def cache_bounds(cache_start_b, cache_index, batch: int, length: int):
  """int32 (start_b, end_b), each [B]: row b reads the cache slots [start_b[b], end_b[b]),
  clipped to [0, S]; start == end when the range is empty."""
  end_b = jnp.broadcast_to(jnp.reshape(jnp.asarray(cache_index, jnp.int32), (-1,)), (batch,))
  end_b = jnp.clip(end_b, 0, length)
  start_b = jnp.minimum(jnp.clip(jnp.asarray(cache_start_b, jnp.int32), 0, length), end_b)
  return start_b, end_b


def valid_block_range(start, end, block: int):
  """[first, stop) of the blocks of `block` slots that hold any slot of [start, end);
  first == stop when the range is empty. Used by both kernels (and their tests). Slots are
  >= 0, so truncating division is floor division (and lowers on Mosaic without a sign op)."""
  first = lax.div(start, block)
  stop = jnp.where(end > start, lax.div(end + (block - 1), block), first)
  return first, stop


def _query_rows(q_bthd, num_kv_heads: int, rows: int, new_kv=None):
  """[B, T, H, Dh] -> [B, Hkv, rows, Dh]: row r = t * G + g holds query head kv * G + g of
  token t; the rows from T * G on are zero padding, except that with new_kv (the one new
  token's key and value [B, Hkv, 1, Dh] each) the last two rows hold them: the GPU kernel
  takes them from there, so the step's query, key and value reach it as one operand,
  written by one XLA kernel (the padded rows' outputs are never read)."""
  b, t, h, d = q_bthd.shape
  g = h // num_kv_heads
  q = q_bthd.reshape(b, t, num_kv_heads, g, d).transpose(0, 2, 1, 3, 4).reshape(
      b, num_kv_heads, t * g, d)
  if new_kv is None:
    return jnp.pad(q, ((0, 0), (0, 0), (0, rows - t * g), (0, 0)))
  k_new, v_new = new_kv
  if rows < t * g + 2 or k_new.dtype != q.dtype or v_new.dtype != q.dtype:
    raise ValueError(f"_query_rows: {rows} rows cannot hold {t * g} query rows and the new "
                     f"key and value, or their dtypes {k_new.dtype}/{v_new.dtype} differ from "
                     f"the query's {q.dtype}.")
  pad = jnp.zeros((b, num_kv_heads, rows - t * g - 2, d), q.dtype)
  return jnp.concatenate([q, pad, k_new, v_new], axis=2)


def _new_token_part(q_bthd, k_bthd, v_bthd, seg_bt, scale):
  """The new tokens over themselves by rule (1): (o f32[B, Hkv, T * G, Dh] normalised,
  lse f32[B, Hkv, T * G])."""
  b, t, h, d = q_bthd.shape
  hkv = k_bthd.shape[2]
  q_bktgd = q_bthd.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 1, 3, 4)
  s = jnp.einsum("bktgd,bukd->bktgu", q_bktgd, k_bthd,
                 preferred_element_type=jnp.float32) * scale
  mask = attention.segment_mask(seg_bt, seg_bt, True)[:, None, :, None, :]  # [B,1,T,1,U]
  s = jnp.where(mask, s, _MASKED)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  o = jnp.einsum("bktgu,bukd->bktgd", p.astype(v_bthd.dtype), v_bthd,
                 preferred_element_type=jnp.float32) / l
  lse = (m + jnp.log(l))[..., 0]
  return o.reshape(b, hkv, t * (h // hkv), d), lse.reshape(b, hkv, t * (h // hkv))


def merge_parts(o_parts, lse_parts):
  """Equation (2): o f32[P, ..., Dh] and lse f32[P, ...] of P parts -> o f32[..., Dh]."""
  m = jnp.max(lse_parts, axis=0)
  w = jnp.exp(lse_parts - m[None])
  return jnp.sum(w[..., None] * o_parts, axis=0) / jnp.sum(w, axis=0)[..., None]


def _fold_new_token(q, k_new, v_new, m, l, acc, scale):
  """One more slot, the new token's key k_new and value v_new [1, Dh], in an online softmax
  (FlashAttention's recurrence) over the queries q [R, Dh]: its state m, l [R] or [R, 1]
  (running max, sum) and acc [R, Dh] (f32). The score is the XLA form's q . k product
  (products of the activations' dtype exact in f32, summed in f32); the probability is
  rounded to that dtype before it multiplies the value, as the cache blocks' are."""
  f32 = jnp.float32
  column = m.ndim == 2
  s = jnp.sum(q.astype(f32) * k_new.astype(f32), axis=1, keepdims=column) * scale
  m_new = jnp.maximum(m, s)
  alpha = jnp.exp(m - m_new)
  p = jnp.exp(s - m_new)
  l = alpha * l + p
  if not column:
    alpha, p = alpha[:, None], p[:, None]
  acc = alpha * acc + p.astype(q.dtype).astype(f32) * v_new.astype(f32)
  return m_new, l, acc


def _finish_folded(q_bthd, num_kv_heads, o, lse):
  """The parts of a T = 1 step whose kernel folded the new token in (o [P, B, Hkv, >= G,
  Dh], lse [P, B, Hkv, >= G]), merged by (2) when P > 1; [B, 1, H, Dh] in q's dtype."""
  b, t, h, d = q_bthd.shape
  g = h // num_kv_heads
  out = o[0, :, :, :g] if o.shape[0] == 1 else merge_parts(o[:, :, :, :g], lse[:, :, :, :g])
  return out.reshape(b, 1, h, d).astype(q_bthd.dtype)


def _new_kv(k_bthd, v_bthd):
  """The one new token's key and value [B, 1, Hkv, Dh] -> [B, Hkv, 1, Dh] each."""
  return k_bthd.transpose(0, 2, 1, 3), v_bthd.transpose(0, 2, 1, 3)


def _finish(q_bthd, k_bthd, v_bthd, segment_ids_bt, cache_o, cache_lse, scale):
  """Merge the cache part(s) (o [P, B, Hkv, >= T*G, Dh], lse [P, B, Hkv, >= T*G]) with the
  new tokens' part; [B, T, H, Dh] in q's dtype."""
  b, t, h, d = q_bthd.shape
  hkv = k_bthd.shape[2]
  n = t * (h // hkv)
  seg_bt = jnp.asarray(segment_ids_bt).astype(jnp.int32)
  new_o, new_lse = _new_token_part(q_bthd, k_bthd, v_bthd, seg_bt, scale)
  o = merge_parts(jnp.concatenate([cache_o[:, :, :, :n], new_o[None]], axis=0),
                  jnp.concatenate([cache_lse[:, :, :, :n], new_lse[None]], axis=0))
  out = o.reshape(b, hkv, t, h // hkv, d).transpose(0, 2, 1, 3, 4).reshape(b, t, h, d)
  return out.astype(q_bthd.dtype)


def _stacked_cache(q_bthd, k_bthd, v_bthd, k_cache, v_cache, layer, name):
  """Both caches as [L, B, Hkv, S, Dh] and the layer to read as int32[1]: with layer None a
  one-layer cache [B, Hkv, S, Dh] gets a unit L axis (a free reshape), else the caches are
  the stacked [L, B, Hkv, S, Dh] of all layers and `layer` (an int, may be traced) names one.
  """
  if layer is None:
    k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
  b, t, h, d = q_bthd.shape
  hkv = k_bthd.shape[2]
  if (k_bthd.shape != (b, t, hkv, d) or v_bthd.shape != k_bthd.shape or h % hkv
      or k_cache.ndim != 5 or k_cache.shape[1:3] != (b, hkv) or k_cache.shape[4] != d
      or v_cache.shape != k_cache.shape):
    raise ValueError(f"{name}: q {q_bthd.shape}, new k/v {k_bthd.shape}/{v_bthd.shape} and "
                     f"cache {k_cache.shape}/{v_cache.shape} are not [B, T, H, Dh], "
                     "[B, T, Hkv, Dh] and [B, Hkv, S, Dh] (or [L, B, Hkv, S, Dh] with layer=) "
                     "with H a multiple of Hkv.")
  return k_cache, v_cache, jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))


def _platform_interpret(interpret, platforms):
  """interpret=None: interpret mode unless the target platform is one of `platforms`."""
  if interpret is not None:
    return interpret
  return attention.target_platform(attention.context_target()) not in platforms


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


# ---------------------------------------------------------------------------------------
# GPU: split-K flash decoding on the Triton backend
# ---------------------------------------------------------------------------------------
def _gpu_kernel(q_ref, k_ref, v_ref, start_ref, end_ref, layer_ref, *refs, scale, block_k,
                blocks_per_split, precision, fold_new, count_blocks):
  """One (row, kv head, split): q_ref [R, Dh] the query rows; k_ref/v_ref [L, S, Dh] are
  pointers to every layer's cache of the row and head (nothing is loaded until the loop);
  with fold_new, q_ref's last two rows are the new token's key and value (`_query_rows`),
  which split 0 folds in after its blocks; o_ref [R, Dh] <- the split's normalised output,
  lse_ref [R] <- its log-sum-exp, and with count_blocks a ref [R] <- how many blocks the
  loop loaded."""
  o_ref, lse_ref, *count_ref = refs
  split = pl.program_id(2)
  start, end, layer = start_ref[()], end_ref[()], layer_ref[0]
  first, stop = valid_block_range(start, end, block_k)
  lo = jnp.maximum(first, split * blocks_per_split)
  hi = jnp.minimum(stop, (split + 1) * blocks_per_split)
  q = q_ref[...]
  rows = q.shape[0]

  def body(i, carry):
    m, l, acc = carry
    slot = i * block_k + jnp.arange(block_k)
    valid = (slot >= start) & (slot < end)
    # Masked loads: the invalid slots of a boundary block are not fetched.
    k = plgpu.load(k_ref.at[layer, pl.ds(i * block_k, block_k), :], mask=valid[:, None],
                   other=0).astype(q.dtype)
    v = plgpu.load(v_ref.at[layer, pl.ds(i * block_k, block_k), :], mask=valid[:, None],
                   other=0).astype(q.dtype)
    s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                        preferred_element_type=jnp.float32) * scale
    s = jnp.where(valid[None, :], s, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.exp(s - m_new[:, None])
    alpha = jnp.exp(m - m_new)  # rescales what earlier blocks summed under the old maximum
    l = alpha * l + jnp.sum(p, axis=1)
    acc = alpha[:, None] * acc + lax.dot_general(
        p.astype(q.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32)
    return m_new, l, acc

  init = (jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32),
          jnp.zeros(q.shape, jnp.float32))
  m, l, acc = lax.fori_loop(lo, jnp.maximum(hi, lo), body, init)
  if fold_new:  # split 0 only: the others keep their state (a select, no branch)
    folded = _fold_new_token(q, q_ref[pl.ds(rows - 2, 1), :], q_ref[pl.ds(rows - 1, 1), :],
                             m, l, acc, scale)
    first_split = split == 0
    m, l, acc = (jnp.where(first_split, new, old) for new, old in zip(folded, (m, l, acc)))
  nonempty = l > 0
  o_ref[...] = (acc / jnp.where(nonempty, l, 1.0)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(nonempty, m + jnp.log(jnp.where(nonempty, l, 1.0)), _MASKED)
  if count_blocks:
    count_ref[0][...] = jnp.full((rows,), jnp.maximum(hi - lo, 0), jnp.int32)


def gpu_layout(batch: int, num_kv_heads: int, length: int, block_k: int = GPU_BLOCK_K,
               k_splits: int | None = None):
  """(block_k, blocks_per_split, k_splits) of the GPU kernel for a cache of `length` slots:
  k_splits=None aims at `GPU_TARGET_PROGRAMS` programs; trailing empty splits dropped."""
  if length % 16:
    raise ValueError(f"decode_attention_gpu: cache length S={length} is not a multiple of 16 "
                     "(Triton blocks have power-of-two sides); allocate the cache in 16s.")
  block_k = min(block_k, _next_power_of_two(length))
  while length % block_k:
    block_k //= 2
  num_blocks = length // block_k
  if k_splits is None:
    k_splits = -(-GPU_TARGET_PROGRAMS // (batch * num_kv_heads))
  k_splits = max(1, min(k_splits, num_blocks))
  blocks_per_split = -(-num_blocks // k_splits)
  return block_k, blocks_per_split, -(-num_blocks // blocks_per_split)


def gpu_cache_part(q_bthd, k_cache_lbksd, v_cache_lbksd, start_b, end_b, layer_1, *, scale,
                   block_k=GPU_BLOCK_K, k_splits=None, num_warps=4, num_stages=2,
                   interpret=False, count_blocks=False, new_kv=None):
  """The GPU kernel's cache part over layer layer_1[0] of [L, B, Hkv, S, Dh] caches:
  (o f32[k_splits, B, Hkv, R, Dh], lse f32[k_splits, B, Hkv, R]) and, with count_blocks,
  int32[B, Hkv, k_splits]: the blocks each program loaded. new_kv: None, or the one new
  token's (key, value) [B, Hkv, 1, Dh] each (T = 1), folded into split 0; they travel in
  the query operand's last two rows (`_query_rows`)."""
  b, t, h, d = q_bthd.shape
  num_layers, _, hkv, length, _ = k_cache_lbksd.shape
  if d & (d - 1) or d < 16:
    raise ValueError(f"decode_attention_gpu: head_dim={d} is not a power of two >= 16 "
                     "(Triton tensor sides); use decode_attention (xla) for this model.")
  block_k, blocks_per_split, k_splits = gpu_layout(b, hkv, length, block_k, k_splits)
  if new_kv is not None and t != 1:
    raise ValueError(f"decode_attention_gpu: new_kv folds one new token in, not T={t}.")
  # tl.dot needs >= 16 rows; with new_kv two of them carry the new key and value
  rows = max(16, _next_power_of_two(t * (h // hkv) + (2 if new_kv is not None else 0)))
  q = _query_rows(q_bthd, hkv, rows, new_kv)
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32
  kernel = functools.partial(_gpu_kernel, scale=scale, block_k=block_k,
                             blocks_per_split=blocks_per_split, precision=precision,
                             fold_new=new_kv is not None, count_blocks=count_blocks)
  row_spec = pl.BlockSpec((None, None, rows, d), lambda i, j, s: (i, j, 0, 0))
  cache_spec = pl.BlockSpec((num_layers, None, None, length, d),
                            lambda i, j, s: (0, i, j, 0, 0))
  bound_spec = pl.BlockSpec((None,), lambda i, j, s: (i,))
  layer_spec = pl.BlockSpec((1,), lambda i, j, s: (0,))
  in_specs = [row_spec, cache_spec, cache_spec, bound_spec, bound_spec, layer_spec]
  operands = [q, k_cache_lbksd, v_cache_lbksd, start_b, end_b, layer_1]
  out_shape = [jax.ShapeDtypeStruct((b, hkv, k_splits, rows, d), jnp.float32),
               jax.ShapeDtypeStruct((b, hkv, k_splits, rows), jnp.float32)]
  out_specs = [pl.BlockSpec((None, None, None, rows, d), lambda i, j, s: (i, j, s, 0, 0)),
               pl.BlockSpec((None, None, None, rows), lambda i, j, s: (i, j, s, 0))]
  if count_blocks:
    out_shape.append(jax.ShapeDtypeStruct((b, hkv, k_splits, rows), jnp.int32))
    out_specs.append(out_specs[-1])
  outs = pl.pallas_call(
      kernel, grid=(b, hkv, k_splits), in_specs=in_specs,
      out_specs=out_specs, out_shape=out_shape,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret, name="decode_attention_gpu",
  )(*operands)
  o, lse = outs[0].transpose(2, 0, 1, 3, 4), outs[1].transpose(2, 0, 1, 3)
  return (o, lse, outs[2][..., 0]) if count_blocks else (o, lse)


def _gpu_merge_kernel(o_ref, lse_ref, out_ref, *, splits):
  """One (row, kv head): o_ref [P, R, Dh] and lse_ref [P, R], the P splits' normalised
  outputs and log-sum-exps -> out_ref [R, Dh] by (2), in two passes over the splits (their
  maximum, then the weighted sums), each loading one split's [R, Dh] tile."""
  m = lax.fori_loop(1, splits, lambda p, m: jnp.maximum(m, lse_ref[p]), lse_ref[0])

  def body(p, carry):
    l, acc = carry
    w = jnp.exp(lse_ref[p] - m)
    return l + w, acc + w[:, None] * o_ref[p]

  w0 = jnp.exp(lse_ref[0] - m)
  l, acc = lax.fori_loop(1, splits, body, (w0, w0[:, None] * o_ref[0]))
  out_ref[...] = (acc / l[:, None]).astype(out_ref.dtype)


def gpu_merge_splits(o, lse, dtype, *, num_warps=4, interpret=False):
  """The GPU kernel's splits (o f32[P, B, Hkv, R, Dh], lse f32[P, B, Hkv, R], as
  `gpu_cache_part` returns them) merged by (2) in one kernel: [B, Hkv, R, Dh] in `dtype`.
  Every row's merge must have a nonempty split (a sampling step's: split 0 holds the new
  token), else it divides 0 by 0."""
  splits, b, hkv, rows, d = o.shape
  o, lse = o.transpose(1, 2, 0, 3, 4), lse.transpose(1, 2, 0, 3)  # undoes gpu_cache_part's
  return pl.pallas_call(
      functools.partial(_gpu_merge_kernel, splits=splits), grid=(b, hkv),
      in_specs=[pl.BlockSpec((None, None, splits, rows, d), lambda i, j: (i, j, 0, 0, 0)),
                pl.BlockSpec((None, None, splits, rows), lambda i, j: (i, j, 0, 0))],
      out_specs=pl.BlockSpec((None, None, rows, d), lambda i, j: (i, j, 0, 0)),
      out_shape=jax.ShapeDtypeStruct((b, hkv, rows, d), dtype),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret, name="decode_merge_gpu",
  )(o, lse)


def decode_attention_gpu(q_bthd, k_bthd, v_bthd, segment_ids_bt, k_cache_bksd, v_cache_bksd,
                         *, cache_start_b, cache_index, scale: float | None = None,
                         layer=None, block_k: int = GPU_BLOCK_K, k_splits: int | None = None,
                         interpret=None) -> jax.Array:
  """`attention.decode_attention` by split-K flash decoding on GPU (module docstring).

  Args (as `attention.decode_attention`, plus):
    layer: None, or the layer to read (int32 scalar, may be traced) when the caches are
      all layers' [L, B, Hkv, S, Dh]: the kernel then reads that layer in place, where a
      sliced [B, Hkv, S, Dh] operand may cost XLA a copy of the layer's cache.
    block_k: cache slots per loop iteration (a power of two >= 16; lowered to divide S).
    k_splits: programs per (row, kv head); None: about GPU_TARGET_PROGRAMS programs.
    interpret: Pallas interpret mode; None: on unless the target platform is a GPU.
  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  k_cache, v_cache, layer_1 = _stacked_cache(q_bthd, k_bthd, v_bthd, k_cache_bksd,
                                             v_cache_bksd, layer, "decode_attention_gpu")
  scale = q_bthd.shape[3] ** -0.5 if scale is None else scale
  start_b, end_b = cache_bounds(cache_start_b, cache_index, q_bthd.shape[0], k_cache.shape[3])
  one_new = q_bthd.shape[1] == 1
  interpret = _platform_interpret(interpret, ("gpu", "cuda", "rocm"))
  o, lse = gpu_cache_part(q_bthd, k_cache, v_cache, start_b, end_b, layer_1, scale=scale,
                          block_k=block_k, k_splits=k_splits, interpret=interpret,
                          new_kv=_new_kv(k_bthd, v_bthd) if one_new else None)
  if one_new and o.shape[0] >= GPU_MERGE_MIN_SPLITS:  # the splits merged by a second kernel
    b, _, h, d = q_bthd.shape
    hkv = k_bthd.shape[2]
    out = gpu_merge_splits(o, lse, q_bthd.dtype, interpret=interpret)
    return out[:, :, :h // hkv].reshape(b, 1, h, d)
  if one_new:
    return _finish_folded(q_bthd, k_bthd.shape[2], o, lse)
  return _finish(q_bthd, k_bthd, v_bthd, segment_ids_bt, o, lse, scale)


# ---------------------------------------------------------------------------------------
# TPU: Mosaic kernel with scalar-prefetched valid ranges
# ---------------------------------------------------------------------------------------
def tpu_block(length: int) -> int:
  """Cache slots per copy: the largest of TPU_BLOCK_CHOICES dividing S, else S."""
  return next((blk for blk in TPU_BLOCK_CHOICES if length % blk == 0), length)


def tpu_rows_per_step(batch: int) -> int:
  """Rows per grid step of the TPU kernel: the largest divisor of B up to TPU_ROWS_PER_STEP."""
  return next(n for n in range(min(TPU_ROWS_PER_STEP, batch), 0, -1) if batch % n == 0)


def tpu_next_block(row, block, valid_blocks, rows: int):
  """The copy after (row, block) in the TPU kernel's order: the row's next valid block, else
  the first valid block of the next row (of `rows`) with any; row == rows when none is
  left. valid_blocks(r): row r's valid blocks [first, stop) (`valid_block_range`); row = -1
  gives the first copy of all."""
  def next_row(_):
    def empty(r):
      first, stop = valid_blocks(jnp.minimum(r, rows - 1))
      return (r < rows) & (first >= stop)
    r = lax.while_loop(empty, lambda r: r + 1, row + 1)
    return r, valid_blocks(jnp.minimum(r, rows - 1))[0]
  more = (row >= 0) & (block + 1 < valid_blocks(jnp.maximum(row, 0))[1])
  return lax.cond(more, lambda _: (row, block + 1), next_row, None)


def _tpu_kernel(start_ref, end_ref, layer_ref, q_ref, k_hbm, v_hbm, *refs, scale, block,
                precision, fold_new):
  """One grid step: the cache part of `rows` rows (q_ref [rows, Hkv, R, Dh]), all kv heads.

  k_hbm, v_hbm: the whole [L, B, Hkv, S, Dh] caches, left in HBM; the kernel copies each
  row's valid blocks [Hkv, block, Dh] into a two-slot VMEM buffer itself, in the order of
  `tpu_next_block`, the next copy in flight while the current block is computed. With
  fold_new, refs start with the new token's key and value [rows, Hkv, 1, Dh], folded in
  after the cache. The online softmax state m_sc/l_sc [rows, Hkv, R, 1], acc_sc [rows,
  Hkv, R, Dh] (f32) lives in VMEM scratch; the step ends by writing o_ref [rows, Hkv, R, Dh]
  and lse_ref [rows, Hkv, R, 1] of every row (an empty row: o = 0, lse = -1e30, unless the
  new token is folded in).
  """
  if fold_new:
    k_new_ref, v_new_ref, *refs = refs
  o_ref, lse_ref, k_buf, v_buf, sems, m_sc, l_sc, acc_sc = refs
  rows, hkv = q_ref.shape[0], q_ref.shape[1]
  row0 = pl.program_id(0) * rows
  layer = layer_ref[0]
  bounds = lambda r: (start_ref[row0 + r], end_ref[row0 + r])  # noqa: E731
  valid_blocks = lambda r: valid_block_range(*bounds(r), block)  # noqa: E731

  def copies(r, j, slot):
    # (one block of S slots, whatever its alignment, starts at 0: a static offset)
    offset = 0 if block == k_hbm.shape[3] else pl.multiple_of(j * block, block)
    src = lambda cache: cache.at[layer, row0 + r, :, pl.ds(offset, block), :]  # noqa: E731
    return (pltpu.make_async_copy(src(k_hbm), k_buf.at[slot], sems.at[0, slot]),
            pltpu.make_async_copy(src(v_hbm), v_buf.at[slot], sems.at[1, slot]))

  m_sc[...] = jnp.full(m_sc.shape, _MASKED, jnp.float32)
  l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def attend(r, j, slot):
    start, end = bounds(r)
    for h in range(hkv):  # kv heads: a static loop of 2-D products
      q = q_ref[r, h]
      k = k_buf[slot, h].astype(q.dtype)
      v = v_buf[slot, h].astype(q.dtype)
      s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                          preferred_element_type=jnp.float32) * scale  # [R, block]
      slot_s = j * block + lax.broadcasted_iota(jnp.int32, s.shape, 1)
      s = jnp.where((slot_s >= start) & (slot_s < end), s, _MASKED)
      # Invalid slots of a boundary block hold whatever the cache holds there (stale or
      # not yet written): zero their values so that 0 x garbage cannot reach the output.
      slot_v = j * block + lax.broadcasted_iota(jnp.int32, v.shape, 0)
      v = jnp.where((slot_v >= start) & (slot_v < end), v, jnp.zeros_like(v))
      m_prev = m_sc[r, h]
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      p = jnp.exp(s - m_new)
      alpha = jnp.exp(m_prev - m_new)
      l_sc[r, h] = alpha * l_sc[r, h] + jnp.sum(p, axis=1, keepdims=True)
      acc_sc[r, h] = alpha * acc_sc[r, h] + lax.dot_general(
          p.astype(q.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
          preferred_element_type=jnp.float32)
      m_sc[r, h] = m_new

  def step(carry):
    r, j, slot = carry
    for copy in copies(r, j, slot):
      copy.wait()
    r_next, j_next = tpu_next_block(r, j, valid_blocks, rows)

    @pl.when(r_next < rows)
    def _prefetch():
      for copy in copies(r_next, j_next, 1 - slot):
        copy.start()

    attend(r, j, slot)
    return r_next, j_next, 1 - slot

  r0, j0 = tpu_next_block(jnp.int32(-1), jnp.int32(0), valid_blocks, rows)

  @pl.when(r0 < rows)
  def _first():
    for copy in copies(r0, j0, 0):
      copy.start()

  lax.while_loop(lambda carry: carry[0] < rows, step, (r0, j0, jnp.int32(0)))

  for r in range(rows):
    if fold_new:
      for h in range(hkv):
        m_sc[r, h], l_sc[r, h], acc_sc[r, h] = _fold_new_token(
            q_ref[r, h], k_new_ref[r, h], v_new_ref[r, h], m_sc[r, h], l_sc[r, h],
            acc_sc[r, h], scale)
    l = l_sc[r]
    nonempty = l > 0
    safe_l = jnp.where(nonempty, l, 1.0)
    o_ref[r] = acc_sc[r] / safe_l
    lse_ref[r] = jnp.where(nonempty, m_sc[r] + jnp.log(safe_l), _MASKED)


def tpu_cache_part(q_bthd, k_cache_lbksd, v_cache_lbksd, start_b, end_b, layer_1, *, scale,
                   block: int | None = None, rows_per_step: int | None = None,
                   interpret=False, new_kv=None):
  """The TPU kernel's cache part over layer layer_1[0] of [L, B, Hkv, S, Dh] caches:
  (o f32[1, B, Hkv, R, Dh], lse f32[1, B, Hkv, R]). Grid (B / rows_per_step,): one step
  runs `rows_per_step` rows, copying each row's valid blocks of `block` slots of every kv
  head (`_tpu_kernel`). new_kv: None, or the one new token's (key, value) [B, Hkv, 1, Dh]
  each (T = 1), folded in."""
  b, t, h, d = q_bthd.shape
  _, _, hkv, length, _ = k_cache_lbksd.shape
  block = tpu_block(length) if block is None else block
  if length % block:
    raise ValueError(f"decode_attention_tpu: block={block} does not divide S={length}.")
  rows_per_step = tpu_rows_per_step(b) if rows_per_step is None else rows_per_step
  if b % rows_per_step:
    raise ValueError(f"decode_attention_tpu: rows_per_step={rows_per_step} does not divide "
                     f"B={b}.")
  sublanes = 16 if q_bthd.dtype == jnp.bfloat16 else 8
  rows = -(-t * (h // hkv) // sublanes) * sublanes
  q = _query_rows(q_bthd, hkv, rows)
  precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # f32 as f32
  group_map = lambda g, *prefetch_refs: (g, 0, 0, 0)  # noqa: E731
  in_specs = [pl.BlockSpec((rows_per_step, hkv, rows, d), group_map),
              pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)]
  operands = [start_b, end_b, layer_1, q, k_cache_lbksd, v_cache_lbksd]
  if new_kv is not None:
    if t != 1:
      raise ValueError(f"decode_attention_tpu: new_kv folds one new token in, not T={t}.")
    in_specs += [pl.BlockSpec((rows_per_step, hkv, 1, d), group_map)] * 2
    operands += list(new_kv)
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3, grid=(b // rows_per_step,), in_specs=in_specs,
      out_specs=[pl.BlockSpec((rows_per_step, hkv, rows, d), group_map),
                 pl.BlockSpec((rows_per_step, hkv, rows, 1), group_map)],
      scratch_shapes=[pltpu.VMEM((2, hkv, block, d), k_cache_lbksd.dtype),
                      pltpu.VMEM((2, hkv, block, d), v_cache_lbksd.dtype),
                      pltpu.SemaphoreType.DMA((2, 2)),
                      pltpu.VMEM((rows_per_step, hkv, rows, 1), jnp.float32),
                      pltpu.VMEM((rows_per_step, hkv, rows, 1), jnp.float32),
                      pltpu.VMEM((rows_per_step, hkv, rows, d), jnp.float32)])
  o, lse = pl.pallas_call(
      functools.partial(_tpu_kernel, scale=scale, block=block, precision=precision,
                        fold_new=new_kv is not None),
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, hkv, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, rows, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret, name="decode_attention_tpu",
  )(*operands)
  return o[None], lse[None, ..., 0]


def decode_attention_tpu(q_bthd, k_bthd, v_bthd, segment_ids_bt, k_cache_bksd, v_cache_bksd,
                         *, cache_start_b, cache_index, scale: float | None = None,
                         layer=None, block: int | None = None,
                         rows_per_step: int | None = None, interpret=None) -> jax.Array:
  """`attention.decode_attention` by a Pallas TPU kernel that DMAs only valid blocks.

  Args (as `attention.decode_attention`, plus):
    layer: None, or the layer to read (int32 scalar, may be traced) when the caches are
      all layers' [L, B, Hkv, S, Dh] (as `decode_attention_gpu`).
    block: cache slots per copy (must divide S); None: `tpu_block(S)`.
    rows_per_step: rows per grid step (must divide B); None: `tpu_rows_per_step(B)`.
    interpret: Pallas interpret mode (True or a `pltpu.InterpretParams`); None: on unless
      the target platform is a TPU.
  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  k_cache, v_cache, layer_1 = _stacked_cache(q_bthd, k_bthd, v_bthd, k_cache_bksd,
                                             v_cache_bksd, layer, "decode_attention_tpu")
  scale = q_bthd.shape[3] ** -0.5 if scale is None else scale
  start_b, end_b = cache_bounds(cache_start_b, cache_index, q_bthd.shape[0], k_cache.shape[3])
  one_new = q_bthd.shape[1] == 1
  o, lse = tpu_cache_part(q_bthd, k_cache, v_cache, start_b, end_b, layer_1, scale=scale,
                          block=block, rows_per_step=rows_per_step,
                          interpret=_platform_interpret(interpret, ("tpu",)),
                          new_kv=_new_kv(k_bthd, v_bthd) if one_new else None)
  if one_new:
    return _finish_folded(q_bthd, k_bthd.shape[2], o, lse)
  return _finish(q_bthd, k_bthd, v_bthd, segment_ids_bt, o, lse, scale)


# The decoder selects these by name (`ModelConfig.decode_attention_impl`,
# `attention.decode_attention(impl=...)`); importing this module registers them.
attention.register_decode_kernel("pallas_gpu", decode_attention_gpu)
attention.register_decode_kernel("pallas_tpu", decode_attention_tpu)

# What each kernel reads, by its `pallas_call` name (the last op_name scope of its custom
# call in the compiled HLO): of each stacked [L, B, Hkv, S, Dh] cache operand, one layer's
# valid slots of each row, copied whole in blocks of `block(S)` slots (1: masked loads of
# exactly the valid slots); every other operand (queries, bounds, layer index) whole. Cost
# accounting (`hgpo_jax.sampling.decode_traffic.kernel_reads`) credits these kernels with
# these reads instead of their whole operands.
CACHE_READS_BLOCK = {
    "decode_attention_gpu": lambda length: 1,
    "decode_attention_tpu": tpu_block,
}
