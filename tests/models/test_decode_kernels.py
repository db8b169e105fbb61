"""The Pallas decode-attention kernels (hgpo_jax/models/decode_kernels.py) against the
readable XLA form `attention.decode_attention`, in interpret mode on CPU: grouped-query
ratios 1, 2, 6, 14 and 16, rows with empty, full, partial and one-slot valid ranges, per-row and
scalar cache_index, f32 and bf16; and that the kernels skip invalid blocks for real (the
GPU kernel's own count of the blocks it loaded, the TPU interpreter's record of the DMAs
the pipeline issued, NaNs planted outside the valid ranges); lowering for Mosaic (compiled
by XLA:TPU from libtpu) and for Triton."""

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from hgpo_jax.models import attention, decode_kernels

S, BLOCK = 64, 16  # 4 cache blocks per row
# (start, end) per row: full, empty, crossing block boundaries, one aligned block, one slot
PER_ROW = ((0, 64), (20, 20), (5, 40), (16, 32), (63, 64))
# with one scalar cache_index = 40: partial, empty (start 40), crossing, aligned, one slot
SCALAR_INDEX = 40
SCALAR_STARTS = (0, 40, 5, 16, 39)


def _inputs(heads, kv_heads, dtype, t=1, dim=16, seed=0):
  rng = np.random.default_rng(seed)
  b = len(PER_ROW)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
  q, k, v = normal(b, t, heads, dim), normal(b, t, kv_heads, dim), normal(b, t, kv_heads, dim)
  k_cache, v_cache = normal(b, kv_heads, S, dim), normal(b, kv_heads, S, dim)
  return q, k, v, k_cache, v_cache


def _bounds(index_kind):
  if index_kind == "per_row":
    return (jnp.asarray([s for s, _ in PER_ROW], jnp.int32),
            jnp.asarray([e for _, e in PER_ROW], jnp.int32))
  return jnp.asarray(SCALAR_STARTS, jnp.int32), jnp.int32(SCALAR_INDEX)


def _tolerance(dtype, want) -> float:
  """Four units in the last place of the largest output in `dtype`: both sides round their
  probabilities and outputs to the activations' dtype, in a different order (the kernels
  per block, the XLA form once). Measured: at most three units (f32, T = 3), one (bf16)."""
  ulp = float(jnp.finfo(dtype).eps) * 2.0 ** np.floor(np.log2(np.max(np.abs(want))))
  return 4 * ulp


def _kernels(interpret=None):
  """Both kernels; interpret=None: each runs compiled on its own platform (JAX_PLATFORMS=cuda
  or tpu; docs/decode_kernels.md) and in interpret mode elsewhere (CPU: both)."""
  return {
      "gpu": functools.partial(decode_kernels.decode_attention_gpu, block_k=BLOCK,
                               interpret=interpret),
      "tpu": functools.partial(decode_kernels.decode_attention_tpu, block=BLOCK,
                               interpret=interpret),
  }


def _run(fn, q, k, v, seg, k_cache, v_cache, starts, index):
  # (full f32 products on every platform: XLA:GPU's default would take TF32 for f32)
  with jax.default_matmul_precision("highest"):
    return jax.jit(lambda *a: fn(*a[:6], cache_start_b=a[6], cache_index=a[7]))(
        q, k, v, seg, k_cache, v_cache, starts, index)


# Every GQA ratio with both dtypes and both kinds of cache_index (each pair of the three
# factors covered; the full product doubles the test time for no new code path).
MATCH_CASES = [("per_row", 2, 2, jnp.float32), ("scalar", 2, 2, jnp.bfloat16),
               ("scalar", 4, 2, jnp.float32), ("per_row", 4, 2, jnp.bfloat16),
               ("per_row", 12, 2, jnp.float32), ("scalar", 12, 2, jnp.bfloat16),
               ("per_row", 12, 2, jnp.bfloat16),
               # the GPU kernel's query block carries the new key and value in its last two
               # rows: G = 14 fills all 16, G = 16 needs 32
               ("scalar", 14, 1, jnp.bfloat16), ("per_row", 16, 1, jnp.float32)]


@pytest.mark.parametrize("index_kind,heads,kv_heads,dtype", MATCH_CASES,
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_kernels_match_the_xla_form(index_kind, heads, kv_heads, dtype):
  """T = 1: each kernel's output equals `attention.decode_attention` within a tolerance
  derived from the dtype, on every row (empty and full ranges included)."""
  q, k, v, k_cache, v_cache = _inputs(heads, kv_heads, dtype)
  seg = jnp.ones(q.shape[:2], jnp.int32)
  starts, index = _bounds(index_kind)
  want = np.asarray(_run(attention.decode_attention, q, k, v, seg, k_cache, v_cache, starts,
                         index), np.float32)
  tol = _tolerance(dtype, want)
  for name, fn in _kernels().items():
    got = _run(fn, q, k, v, seg, k_cache, v_cache, starts, index)
    assert got.dtype == q.dtype and got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol, rtol=0,
                               err_msg=name)


@pytest.mark.parametrize("index_kind,heads,kv_heads,dtype", MATCH_CASES[4:],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_gpu_merge_kernel_gives_the_xla_form(index_kind, heads, kv_heads, dtype, monkeypatch):
  """T = 1 with the splits merged by the second GPU kernel (`gpu_merge_splits`, taken
  from GPU_MERGE_MIN_SPLITS splits on; lowered to 2 here so that the 4 splits of these
  rows take it): the output equals the XLA form as the one-kernel path's does."""
  monkeypatch.setattr(decode_kernels, "GPU_MERGE_MIN_SPLITS", 2)
  q, k, v, k_cache, v_cache = _inputs(heads, kv_heads, dtype)
  seg = jnp.ones(q.shape[:2], jnp.int32)
  starts, index = _bounds(index_kind)
  want = np.asarray(_run(attention.decode_attention, q, k, v, seg, k_cache, v_cache, starts,
                         index), np.float32)
  fn = functools.partial(decode_kernels.decode_attention_gpu, block_k=BLOCK, k_splits=4)
  text = jax.jit(lambda *a: fn(*a[:6], cache_start_b=a[6], cache_index=a[7])).trace(
      q, k, v, seg, k_cache, v_cache, starts, index).jaxpr.pretty_print()
  assert text.count("pallas_call") == 2 and "decode_merge_gpu" in text
  got = _run(fn, q, k, v, seg, k_cache, v_cache, starts, index)
  np.testing.assert_allclose(np.asarray(got, np.float32), want,
                             atol=_tolerance(dtype, want), rtol=0)


def test_gpu_merge_kernel_is_equation_2_over_many_splits():
  """`gpu_merge_splits` against the readable `merge_parts` over 24 splits (one row's in
  the 1.5B step), a third of them empty (o = 0, lse = -1e30) and split 0 never; and the
  kernel path taken by default for one row over a 256-slot cache (16 splits >=
  GPU_MERGE_MIN_SPLITS) matches the XLA form."""
  rng = np.random.default_rng(5)
  p, b, hkv, rows, d = 24, 3, 2, 16, 16
  o = rng.standard_normal((p, b, hkv, rows, d)).astype(np.float32)
  lse = (3 * rng.standard_normal((p, b, hkv, rows))).astype(np.float32)
  empty = np.zeros((p, 1, 1, 1), bool)
  empty[1::3] = True
  o, lse = np.where(empty[..., None], 0.0, o), np.where(empty, -1e30, lse)
  got = decode_kernels.gpu_merge_splits(jnp.asarray(o), jnp.asarray(lse), jnp.float32,
                                        interpret=True)
  want = decode_kernels.merge_parts(jnp.asarray(o), jnp.asarray(lse))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  length = 256
  q, k, v, _, _ = _inputs(12, 2, jnp.float32)
  q, k, v = q[:1], k[:1], v[:1]
  k_cache, v_cache = (jnp.asarray(rng.standard_normal((1, 2, length, 16)), jnp.float32)
                      for _ in range(2))
  seg, starts, index = jnp.ones((1, 1), jnp.int32), jnp.asarray([3], jnp.int32), jnp.int32(250)
  fn = functools.partial(decode_kernels.decode_attention_gpu, block_k=BLOCK)
  assert decode_kernels.gpu_layout(1, 2, length, BLOCK)[2] >= decode_kernels.GPU_MERGE_MIN_SPLITS
  want = _run(attention.decode_attention, q, k, v, seg, k_cache, v_cache, starts, index)
  got = _run(fn, q, k, v, seg, k_cache, v_cache, starts, index)
  np.testing.assert_allclose(got, want, atol=_tolerance(jnp.float32, want), rtol=0)


def test_kernels_match_the_xla_form_for_several_new_tokens():
  """T = 3 new tokens in two segments plus a padding token: the new tokens' own part
  (rule (1), merged by log-sum-exp) is exact too."""
  q, k, v, k_cache, v_cache = _inputs(4, 2, jnp.float32, t=3)
  seg = jnp.asarray([[1, 1, 2], [1, 1, 1], [0, 1, 1], [1, 2, 2], [1, 1, 0]], jnp.int32)
  starts, index = _bounds("per_row")
  want = _run(attention.decode_attention, q, k, v, seg, k_cache, v_cache, starts, index)
  for name, fn in _kernels().items():
    got = _run(fn, q, k, v, seg, k_cache, v_cache, starts, index)
    np.testing.assert_allclose(got, want, atol=_tolerance(jnp.float32, want), rtol=0,
                               err_msg=name)


def test_kernels_cast_a_float32_cache_to_bfloat16_activations_as_the_xla_form_does():
  q, k, v, k_cache, v_cache = _inputs(4, 2, jnp.bfloat16)
  k_cache, v_cache = k_cache.astype(jnp.float32) * 1.01, v_cache.astype(jnp.float32) * 0.99
  seg = jnp.ones(q.shape[:2], jnp.int32)
  starts, index = _bounds("per_row")
  want = np.asarray(_run(attention.decode_attention, q, k, v, seg, k_cache, v_cache, starts,
                         index), np.float32)
  for name, fn in _kernels().items():
    got = _run(fn, q, k, v, seg, k_cache, v_cache, starts, index)
    np.testing.assert_allclose(np.asarray(got, np.float32), want,
                               atol=_tolerance(jnp.bfloat16, want), rtol=0, err_msg=name)


def test_nan_in_every_invalid_slot_never_reaches_the_output():
  """NaN keys and values in all slots outside each row's valid range (whole skipped blocks
  and the invalid halves of boundary blocks): the output is finite and identical to the
  output over a clean cache. (The XLA form itself would give NaN: 0 x NaN in P V.)"""
  q, k, v, k_cache, v_cache = _inputs(4, 2, jnp.float32)
  seg = jnp.ones(q.shape[:2], jnp.int32)
  starts, index = _bounds("per_row")
  slot = np.arange(S)
  invalid_bs = np.stack([(slot < s) | (slot >= e) for s, e in PER_ROW])[:, None, :, None]
  poison = lambda x: jnp.where(invalid_bs, jnp.nan, x)
  for name, fn in _kernels().items():
    clean = _run(fn, q, k, v, seg, k_cache, v_cache, starts, index)
    dirty = _run(fn, q, k, v, seg, poison(k_cache), poison(v_cache), starts, index)
    assert np.isfinite(np.asarray(dirty)).all(), name
    np.testing.assert_array_equal(np.asarray(dirty), np.asarray(clean), err_msg=name)


def test_kernels_read_one_layer_of_a_stacked_cache_in_place():
  """layer= (traced) with all layers' caches [L, B, Hkv, S, Dh]: the same output as the
  one-layer call on that layer's slice, bit for bit; NaN in the other layers is never read."""
  q, k, v, k_cache, v_cache = _inputs(12, 2, jnp.bfloat16)
  seg = jnp.ones(q.shape[:2], jnp.int32)
  starts, ends = _bounds("per_row")
  nan = jnp.full_like(k_cache, jnp.nan)
  k_stack, v_stack = jnp.stack([nan, k_cache, nan]), jnp.stack([nan, v_cache, nan])
  for name, fn in _kernels().items():
    one = _run(fn, q, k, v, seg, k_cache, v_cache, starts, ends)
    stacked = jax.jit(lambda k_stack, v_stack, layer: fn(
        q, k, v, seg, k_stack, v_stack, cache_start_b=starts, cache_index=ends, layer=layer))(
            k_stack, v_stack, jnp.int32(1))
    np.testing.assert_array_equal(np.asarray(stacked, np.float32), np.asarray(one, np.float32),
                                  err_msg=name)


def _blocks_holding(start, end, block):
  """The readable count: block ids that hold at least one slot of [start, end)."""
  return sorted({s // block for s in range(start, end)})


def test_gpu_kernel_loads_only_blocks_that_hold_valid_slots():
  """The kernel's own count of the cache blocks each (row, kv head, split) program loaded,
  summed over splits, equals the number of blocks intersecting the row's valid range (0 for
  an empty row), with k_splits = 2 so each split owns 2 of the 4 blocks."""
  q, _, _, k_cache, v_cache = _inputs(4, 2, jnp.float32)
  starts, ends = _bounds("per_row")
  _, _, counts = decode_kernels.gpu_cache_part(
      q, k_cache[None], v_cache[None], starts, ends, jnp.zeros((1,), jnp.int32), scale=0.25,
      block_k=BLOCK, k_splits=2, interpret=True, count_blocks=True)
  assert counts.shape == (len(PER_ROW), 2, 2)
  for b, (s, e) in enumerate(PER_ROW):
    want = _blocks_holding(s, e, BLOCK)
    per_split = [sum(1 for blk in want if blk // 2 == split) for split in range(2)]
    np.testing.assert_array_equal(counts[b], [per_split] * 2, err_msg=f"row {b}")
  assert int(counts.sum()) == 2 * (4 + 0 + 3 + 1 + 1)  # of 2 * 5 * 4 = 40 blocks


@pytest.mark.parametrize("rows_per_step", [5, 2, 1])
def test_tpu_kernel_dmas_only_blocks_that_hold_valid_slots(monkeypatch, rows_per_step):
  """Run in TPU interpret mode, which simulates the kernel's HBM -> VMEM copies, and record
  every copy it starts: each row copies exactly the blocks that intersect its valid range,
  once each, in order, keys and values alike; an empty row copies nothing (the padding
  row included). With 5 rows per
  grid step (one step), 2 (B = 6: a sixth, empty row pads the batch) and 1 (a step per
  row); the output equals the XLA form's."""
  from jax._src.pallas.mosaic.interpret import interpret_pallas_call as interpreter
  original = interpreter.dma_start
  signature = inspect.signature(original)
  if not {"src_id", "src_transforms"} <= set(signature.parameters):
    pytest.skip(f"this JAX's TPU interpreter ({jax.__version__}) does not name the source "
                "of a copy; the hook was written against jax 0.10.2")
  copies = []

  def recording_dma_start(*args, **kwargs):
    bound = signature.bind(*args, **kwargs).arguments
    (indexer,) = bound["src_transforms"]
    layer, row, heads, slots, dims = indexer.indices
    copies.append((int(bound["src_id"]), int(layer), int(row), int(slots.start) // BLOCK,
                   slots.size, heads.size))
    return original(*args, **kwargs)
  monkeypatch.setattr(interpreter, "dma_start", recording_dma_start)
  jax.clear_caches()  # the patched function is bound when the kernel is traced
  q, k, v, k_cache, v_cache = _inputs(4, 2, jnp.float32, seed=1)  # both kv heads per copy
  starts, ends = _bounds("per_row")
  if rows_per_step == 2:
    q, k, v, k_cache, v_cache = (jnp.concatenate([x, x[:1]]) for x in (q, k, v, k_cache, v_cache))
    starts, ends = jnp.append(starts, 7), jnp.append(ends, 7)
  seg = jnp.ones(q.shape[:2], jnp.int32)
  got = decode_kernels.decode_attention_tpu(q, k, v, seg, k_cache, v_cache, cache_start_b=starts,
                                            cache_index=ends, block=BLOCK,
                                            rows_per_step=rows_per_step,
                                            interpret=pltpu.InterpretParams())
  want = attention.decode_attention(q, k, v, seg, k_cache, v_cache, cache_start_b=starts,
                                    cache_index=ends)
  np.testing.assert_allclose(got, want, atol=_tolerance(jnp.float32, want), rtol=0)
  sources = sorted({c[0] for c in copies})
  assert len(sources) == 2  # the key and the value cache
  for source in sources:  # (grid steps may run in any order: rows are compared one by one)
    for b, (s, e) in enumerate(PER_ROW):
      blocks = [blk for src, _, row, blk, _, _ in copies if src == source and row == b]
      assert blocks == _blocks_holding(s, e, BLOCK), (b, blocks)
  assert all(layer == 0 and size == BLOCK and heads == 2 for _, layer, _, _, size, heads in copies)
  assert len(copies) == 2 * (4 + 0 + 3 + 1 + 1)  # of 2 * 5 * 4 = 40 blocks


def test_tpu_copy_order_visits_each_rows_valid_blocks_then_the_next_row():
  """`tpu_next_block` from (-1, 0) to the end: the rows' valid blocks in row order, empty
  rows skipped, leading and trailing ones included."""
  cases = [PER_ROW, ((20, 20),) + PER_ROW + ((3, 3), (9, 9)), ((4, 4), (9, 9))]
  for ranges in cases:
    first = jnp.asarray([decode_kernels.valid_block_range(s, e, BLOCK)[0] for s, e in ranges])
    stop = jnp.asarray([decode_kernels.valid_block_range(s, e, BLOCK)[1] for s, e in ranges])
    order, row, blk = [], jnp.int32(-1), jnp.int32(0)
    while True:
      row, blk = decode_kernels.tpu_next_block(row, blk, lambda r: (first[r], stop[r]),
                                               len(ranges))
      if int(row) == len(ranges):
        break
      order.append((int(row), int(blk)))
    assert order == [(b, x) for b, (s, e) in enumerate(ranges)
                     for x in _blocks_holding(s, e, BLOCK)], ranges


def test_tpu_rows_per_step_do_not_change_a_bit():
  """Each row's arithmetic is the same whichever rows share its grid step: 1, 5 rows per
  step and the default give identical outputs (bf16, per-row ends)."""
  q, k, v, k_cache, v_cache = _inputs(12, 2, jnp.bfloat16, seed=3)
  seg = jnp.ones(q.shape[:2], jnp.int32)
  starts, ends = _bounds("per_row")
  outs = [np.asarray(_run(functools.partial(decode_kernels.decode_attention_tpu, block=BLOCK,
                                            rows_per_step=n), q, k, v, seg, k_cache, v_cache,
                          starts, ends), np.float32) for n in (1, 5, None)]
  assert decode_kernels.tpu_rows_per_step(5) == 5 and decode_kernels.tpu_rows_per_step(32) == 8
  assert decode_kernels.tpu_rows_per_step(12) == 6 and decode_kernels.tpu_rows_per_step(7) == 7
  np.testing.assert_array_equal(outs[0], outs[1])
  np.testing.assert_array_equal(outs[0], outs[2])
  # no block size divides S = 64 by default: one block of S per row, the XLA form's output
  one_block = _run(decode_kernels.decode_attention_tpu, q, k, v, seg, k_cache, v_cache,
                   starts, ends)
  want = np.asarray(_run(attention.decode_attention, q, k, v, seg, k_cache, v_cache, starts,
                         ends), np.float32)
  assert decode_kernels.tpu_block(S) == S
  np.testing.assert_allclose(np.asarray(one_block, np.float32), want,
                             atol=_tolerance(jnp.bfloat16, want), rtol=0)


def test_layout_choices_and_clear_errors():
  assert decode_kernels.gpu_layout(128, 2, 1536) == (64, 12, 2)  # 512 programs, 24 blocks
  assert decode_kernels.gpu_layout(1, 2, 1536) == (64, 1, 24)  # one row: a split per block
  assert decode_kernels.tpu_block(1536) == 512 and decode_kernels.tpu_block(640) == 128
  assert decode_kernels.tpu_block(100) == 100
  q, k, v, k_cache, v_cache = _inputs(4, 2, jnp.float32)
  seg = jnp.ones(q.shape[:2], jnp.int32)
  starts, ends = _bounds("per_row")
  with pytest.raises(ValueError, match="not a multiple of 16"):
    decode_kernels.decode_attention_gpu(q, k, v, seg, k_cache[:, :, :40], v_cache[:, :, :40],
                                        cache_start_b=starts, cache_index=ends, interpret=True)
  with pytest.raises(ValueError, match="power of two"):
    decode_kernels.decode_attention_gpu(q[..., :12], k[..., :12], v[..., :12], seg,
                                        k_cache[..., :12], v_cache[..., :12],
                                        cache_start_b=starts, cache_index=ends, interpret=True)
  with pytest.raises(ValueError, match="rows_per_step=2 does not divide B=5"):
    decode_kernels.decode_attention_tpu(q, k, v, seg, k_cache, v_cache, cache_start_b=starts,
                                        cache_index=ends, rows_per_step=2, interpret=True)
  with pytest.raises(ValueError, match=r"\[B, Hkv, S, Dh\]"):
    decode_kernels.decode_attention_tpu(q, k, v, seg, k_cache[:, :1], v_cache[:, :1],
                                        cache_start_b=starts, cache_index=ends, interpret=True)


def _qwen_like_arguments():
  """ShapeDtypeStructs of one decode step of Qwen2.5-1.5B's attention (12 heads over 2 kv
  heads of 128, bf16) for 8 rows over a 1536-slot cache."""
  b, h, hkv, d, s = 8, 12, 2, 128, 1536
  bf16 = jnp.bfloat16
  shapes = [((b, 1, h, d), bf16), ((b, 1, hkv, d), bf16), ((b, 1, hkv, d), bf16),
            ((b, 1), jnp.int32), ((b, hkv, s, d), bf16), ((b, hkv, s, d), bf16),
            ((b,), jnp.int32), ((b,), jnp.int32)]
  return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]


def test_gpu_kernel_lowers_to_triton_ir_without_a_gpu():
  """Lowering for CUDA from this CPU host emits the kernel as Triton IR inside XLA:GPU's
  Triton custom call. (Compiling it to PTX needs XLA:GPU with a GPU or the CUDA plugin's
  deviceless compiler; see docs/decode_kernels.md.)"""
  fn = lambda *a: decode_kernels.decode_attention_gpu(*a[:6], cache_start_b=a[6],
                                                      cache_index=a[7], interpret=False)
  text = jax.jit(fn).trace(*_qwen_like_arguments()).lower(lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and 'name = "decode_attention_gpu"' in text
  # grid (B, Hkv, k_splits): 8 x 2 x 24 programs, one 64-slot block each
  assert "grid_x = 8 : i32, grid_y = 2 : i32, grid_z = 24 : i32" in text
  # six operands: the 16 query rows per kv head (G = 6 queries, the new key and value in
  # the last two rows: one operand, one XLA kernel writes it), both caches, the bounds and
  # the layer; no separate operand for the new token
  assert ("(tensor<8x2x16x128xbf16>, tensor<1x8x2x1536x128xbf16>, tensor<1x8x2x1536x128xbf16>"
          ", tensor<8xi32>, tensor<8xi32>, tensor<1xi32>) -> (tensor<8x2x24x16x128xf32>") in text
  # all layers' caches with a traced layer: the same kernel reads the stack in place
  args = _qwen_like_arguments()
  stack = jax.ShapeDtypeStruct((28,) + args[4].shape, args[4].dtype)
  layered = lambda *a: decode_kernels.decode_attention_gpu(
      *a[:6], cache_start_b=a[6], cache_index=a[7], layer=a[8], interpret=False)
  text = jax.jit(layered).trace(*args[:4], stack, stack, *args[6:],
                                jax.ShapeDtypeStruct((), jnp.int32)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text and "tensor<28x8x2x1536x128xbf16>" in text
  # one row: 24 splits, merged by the second kernel (GPU_MERGE_MIN_SPLITS)
  one_row = [jax.ShapeDtypeStruct((1,) + a.shape[1:], a.dtype) for a in args]
  text = jax.jit(fn).trace(*one_row).lower(lowering_platforms=("cuda",)).as_text()
  assert 'name = "decode_attention_gpu"' in text and 'name = "decode_merge_gpu"' in text
  assert "grid_x = 1 : i32, grid_y = 2 : i32, grid_z = 24 : i32" in text


@pytest.mark.tpu_compile
def test_tpu_kernel_compiles_for_mosaic_from_a_cpu_host():
  """XLA:TPU (libtpu, no TPU) compiles the kernel for a v5e chip: the Mosaic custom call
  passes Mosaic's own compiler, not interpret mode. Qwen2.5-1.5B's shapes in bf16 and f32;
  S = 100 (one unaligned block of S: its copy must start at a static 0); and the paper
  setting's per-chip step over all layers' caches (32 rows in 4 grid steps, S = 4608)."""
  from hgpo_jax.cost import targets
  reason = targets.libtpu_available()
  if reason is not None:
    pytest.skip(reason)
  device = targets.devices(targets.resolve("v5e-8"))[0]
  sharding = jax.sharding.SingleDeviceSharding(device)
  place = lambda a, shape=None, dtype=None: jax.ShapeDtypeStruct(  # noqa: E731
      a.shape if shape is None else shape, a.dtype if dtype is None else dtype,
      sharding=sharding)
  base = _qwen_like_arguments()
  f32 = [place(a, dtype=jnp.float32 if a.dtype == jnp.bfloat16 else a.dtype) for a in base]
  short = [place(a, shape=a.shape[:2] + (100,) + a.shape[3:]) if a.ndim == 4 and i >= 4
           else place(a) for i, a in enumerate(base)]
  b, s, layers = 32, 4608, 28
  paper = [place(a, shape=(b,) + a.shape[1:2] + ((6,) if i == 0 else (1,) if i < 3 else ())
                 + a.shape[3:]) for i, a in enumerate(base[:4])]
  paper += [place(base[4], shape=(layers, b, 1, s, 128))] * 2
  paper += [place(base[6], shape=(b,))] * 2 + [jax.ShapeDtypeStruct((), jnp.int32,
                                                                    sharding=sharding)]
  fn = lambda *a: decode_kernels.decode_attention_tpu(*a[:6], cache_start_b=a[6],
                                                      cache_index=a[7], interpret=False)
  stacked = lambda *a: decode_kernels.decode_attention_tpu(
      *a[:6], cache_start_b=a[6], cache_index=a[7], layer=a[8], interpret=False)
  for f, args in ((fn, [place(a) for a in base]), (fn, f32), (fn, short), (stacked, paper)):
    lowered = jax.jit(f).lower(*args)
    assert "tpu_custom_call" in lowered.as_text()
    compiled = lowered.compile()
    assert compiled.cost_analysis() is not None


@pytest.mark.tpu_compile
def test_tpu_kernel_reads_a_stacked_cache_in_place_inside_the_layer_loop():
  """In a scan over layers, passing the kernel each layer's slice of the stacked cache (scan
  xs) makes XLA:TPU materialise that slice (a dynamic-slice fusion writing [B, Hkv, S, Dh])
  before the Mosaic call, i.e. a copy of the layer's whole cache per layer and step; the
  kernel's `layer=` over the stacked cache compiles without it. Prints XLA's bytes."""
  from hgpo_jax.cost import targets
  reason = targets.libtpu_available()
  if reason is not None:
    pytest.skip(reason)
  sharding = jax.sharding.SingleDeviceSharding(targets.devices(targets.resolve("v5e-8"))[0])
  q, k, _, seg, k_cache, _, starts, ends = _qwen_like_arguments()
  layers = 4
  stack = jax.ShapeDtypeStruct((layers,) + k_cache.shape, k_cache.dtype)
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
          for a in (q, k, seg, stack, stack, starts, ends)]
  attend = functools.partial(decode_kernels.decode_attention_tpu, interpret=False)

  def sliced(q, k, seg, k_stack, v_stack, starts, ends):
    def step(x, kv):
      return x + attend(x, k, k, seg, *kv, cache_start_b=starts, cache_index=ends), None
    return jax.lax.scan(step, q, (k_stack, v_stack))[0]

  def in_place(q, k, seg, k_stack, v_stack, starts, ends):
    def step(x, layer):
      return x + attend(x, k, k, seg, k_stack, v_stack, cache_start_b=starts,
                        cache_index=ends, layer=layer), None
    return jax.lax.scan(step, q, jnp.arange(layers))[0]

  layer_slice = "bf16[1,%d,%d,%d,%d]" % k_cache.shape
  compiled = {f.__name__: jax.jit(f).lower(*args).compile() for f in (sliced, in_place)}
  texts = {name: c.as_text() for name, c in compiled.items()}
  for name, c in compiled.items():
    print(f"{name}: XLA:TPU bytes accessed {c.cost_analysis()['bytes accessed']:.0f} "
          f"(the Mosaic call not included)")
  assert layer_slice in texts["sliced"]  # the copy this test guards against is real
  assert layer_slice not in texts["in_place"]
