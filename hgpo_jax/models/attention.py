"""Attention: the one place the decoder computes softmax(q kᵀ · scale) v.

Two entry points, both in the kernel layout of `jax.nn.dot_product_attention`
(queries [B, T, H, Dh], keys and values [B, S, Hkv, Dh], H a multiple of Hkv: grouped-query
attention, query head h reads kv head h // (H / Hkv)):

  `attention(q, k, v, segment_ids, causal=, impl=)`: self-attention of T tokens (training,
    log-probs, critic, prefill). Which keys a query reads is given by int segment ids
    [B, T], never by a dense mask: query t reads key s iff
        segment_ids[t] == segment_ids[s]   and (causal) s <= t.                      (1)
    Ids >= 1 are sequences (several per row when rows are packed), 0 is padding, which
    forms a segment of its own: real tokens never read padding, and a padding query reads
    padding (its output is garbage the callers never score). This is exactly the
    `SegmentIds` semantics of the TPU splash kernel, and with (1) every query reads at
    least itself, so no softmax row is empty. A bool input mask [B, T] is a valid
    segment-id array (one sequence per row, left and/or right padding).
  `decode_attention(q, k, v, segment_ids, k_cache, v_cache, cache_start, cache_index)`:
    T new tokens (T = 1 when sampling) over a KV cache [B, Hkv, S, Dh] whose row b holds
    its earlier tokens in slots [cache_start[b], cache_index) (per-row valid ranges; left
    padding lies before cache_start), plus the new tokens themselves by rule (1).

Implementations (`impl`, `IMPLEMENTATIONS`):
  xla      the readable reference: scores [B, H, T, S] in f32, masked softmax, PV; bf16
           activations take `attention_bf16` (hand-written backward with bf16 operands,
           the CPU-tuned path), and `query_chunk` > 0 runs queries in chunks that read keys
           up to the chunk's end only (causal block skipping). Memory O(T²) per layer.
  chunked  online softmax over key blocks of `block_kv` (Rabe & Staats 2021, arXiv
           2112.05682; FlashAttention's recurrence) in plain JAX with a custom VJP that
           recomputes each block's probabilities from the saved log-sum-exp: forward and
           backward memory O(T · block_kv), residuals O(T).
  splash   the Pallas TPU kernel `jax.experimental.pallas.ops.tpu.splash_attention`
           (causal `MultiHeadMask`, `SegmentIds`, T padded to a multiple of 128, blocks of
           up to 512), vmapped over rows under `jax.shard_map` over the batch and head axes
           of the mesh in context (`jax.set_mesh` around a lowering, or `traced_on` as the
           Learner's, critic's and sampler's jits do; none: one unsharded call); interpret
           mode off TPU (CPU tests).
  cudnn    `jax.nn.dot_product_attention(implementation="cudnn")` (GPU, bf16/fp16 only);
           segments enter as its boolean `mask` [B, 1, T, T] (the public API has no segment
           ids), which cuDNN's fused kernel adds as a bias: no [B, H, T, T] probabilities.
`decode_attention(..., impl=)` dispatches by name through `DECODE_KERNELS` ("xla": one
query row per step reads the cache once, as MaxText and tunix decode); another module adds
a kernel with `register_decode_kernel`. "auto" is "pallas_gpu" on GPUs (measured faster
on an H200) and "xla" elsewhere (`resolve_decode_impl`).

`resolve_impl("auto", mesh, length=T)` picks by the platform of the target mesh's devices
(tpu: splash, gpu: cudnn, cpu and others: xla below `CPU_CHUNKED_MIN_LENGTH` tokens,
chunked from there), so a CPU host compiling for TPU topology devices picks splash; the
local backend is never consulted when a mesh is given. On CPU, chunked is the long-sequence
default for memory, not speed: it needs a fraction of xla's peak temporaries at a time
cost (`python -m launch.benchmarks.attention_memory`, `python -m
launch.benchmarks.attention_speed`; the figures: docs/performance.md, "Figures cited by the
code").
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec as P

from hgpo_jax.models.attention_names import STACKED_DECODE_IMPLEMENTATIONS
from hgpo_jax.models.attention_names import (CHOICES, DECODE_CHOICES,  # noqa: F401
                                             DECODE_IMPLEMENTATIONS, IMPLEMENTATIONS)
from hgpo_jax.models.axes import logical_to_spec
from hgpo_jax.models.platform import target_platform  # noqa: F401

_AUTO_BY_PLATFORM = {"tpu": "splash", "gpu": "cudnn"}
"""'auto' on these platforms (`platform.target_platform`: "gpu" also for devices that
report "cuda"); every other platform (cpu) gets 'xla', or 'chunked' from
`CPU_CHUNKED_MIN_LENGTH` tokens."""

_DECODE_AUTO_BY_PLATFORM: dict[str, str] = {"gpu": "pallas_gpu"}
"""`decode_attention` 'auto' on these platforms; every other platform gets 'xla'. GPU:
the split-K kernel over each row's valid slots, measured on an H200 (jax 0.11.2, the 1.5B
model, prompts up to 1024, 512 new tokens): 9.23 -> 5.18 ms per decode step at 128 rows,
4.50 -> 4.84 ms at one row (docs/performance.md, "Measured on an H200"); it needs a
power-of-two head_dim (else 'xla'). TPU keeps 'xla' until `pallas_tpu` is measured on a
chip."""

CPU_CHUNKED_MIN_LENGTH = 4096
"""'auto' off TPU/GPU takes 'chunked' for sequences of at least this many tokens (the
papers' 4096 + 512): O(T) memory instead of xla's O(T²) scores, at a time cost
(module docstring); shorter sequences keep 'xla', the faster path there."""

# Large negative instead of -inf: exp(-1e30 - m) is exactly 0 for any finite row maximum
# m, and a where() over it has finite gradients on both branches.
_MASKED = -1e30

SPLASH_BLOCK = 128
"""Splash's sequence and block granularity (its kernels reject other block sizes)."""


# ---------------------------------------------------------------------------------------
# Implementation choice
# ---------------------------------------------------------------------------------------
def resolve_impl(name: str, mesh_or_devices, dtype=None, length: int | None = None) -> str:
  """The implementation that `name` means on the target devices.

  Args:
    name: "auto" or one of IMPLEMENTATIONS (returned unchanged).
    mesh_or_devices: the mesh the program is compiled for (Mesh, AbstractMesh or a list
      of devices); read only for "auto".
    dtype: the activations' dtype, if known: cuDNN's fused kernel takes bf16/fp16 only,
      so "auto" on a GPU with float32 activations is "xla" rather than an error.
    length: the sequence length T, if known: off TPU/GPU, "auto" is "chunked" from
      `CPU_CHUNKED_MIN_LENGTH` tokens; unknown (None) there, "auto" stays "auto" (the
      attention call resolves it from its own T).
  """
  if name not in CHOICES:
    raise ValueError(f"attention_impl={name!r}: use one of {CHOICES}.")
  if name != "auto":
    return name
  platform = target_platform(mesh_or_devices)
  if platform not in _AUTO_BY_PLATFORM:
    if length is None:
      return "auto"
    return "chunked" if length >= CPU_CHUNKED_MIN_LENGTH else "xla"
  impl = _AUTO_BY_PLATFORM[platform]
  if impl == "cudnn" and dtype is not None and jnp.dtype(dtype) not in (
      jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return "xla"
  return impl


def resolve_decode_impl(name: str, mesh_or_devices, head_dim: int | None = None) -> str:
  """The decode-attention implementation `name` means on the target devices ("auto":
  by their platform, `_DECODE_AUTO_BY_PLATFORM`, else "xla"; "xla" also where the
  platform's kernel cannot take `head_dim`: `pallas_gpu` needs a power of two)."""
  if name not in DECODE_CHOICES:
    raise ValueError(f"decode_attention_impl={name!r}: use one of {DECODE_CHOICES}.")
  if name != "auto":
    return name
  impl = _DECODE_AUTO_BY_PLATFORM.get(target_platform(mesh_or_devices), "xla")
  if impl == "pallas_gpu" and head_dim is not None and head_dim & (head_dim - 1):
    return "xla"
  return impl


def context_target():
  """The compile target when none is passed: the mesh set by `jax.set_mesh` (also inside a
  trace), else this process's devices."""
  mesh = jax.sharding.get_abstract_mesh()
  return jax.devices() if mesh.empty else mesh


def traced_on(mesh, fn):
  """`fn` traced with `mesh` as the abstract mesh in context, for `jax.jit(traced_on(mesh,
  f), ...)`: inside the trace 'auto' resolves against it and splash shard_maps over it
  (`jax.set_mesh` itself may not be entered inside jit). mesh None: `fn` itself."""
  if mesh is None:
    return fn

  @functools.wraps(fn)
  def on_mesh(*args, **kwargs):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return fn(*args, **kwargs)
  return on_mesh


# ---------------------------------------------------------------------------------------
# Masks (internal: callers pass segment ids, never masks)
# ---------------------------------------------------------------------------------------
def segment_mask(q_segment_ids_bt, kv_segment_ids_bs, causal: bool, q_offset=0) -> jax.Array:
  """bool[B, T, S] of rule (1): same segment and (causal) key slot s <= q_offset + t."""
  mask_bts = q_segment_ids_bt[:, :, None] == kv_segment_ids_bs[:, None, :]
  if causal:
    t, s = q_segment_ids_bt.shape[1], kv_segment_ids_bs.shape[1]
    mask_bts = mask_bts & (jnp.arange(s)[None, None, :]
                           <= q_offset + jnp.arange(t)[None, :, None])
  return mask_bts


def _as_segment_ids(segment_ids_bt) -> jax.Array:
  """int32 ids from int or bool [B, T] (a bool input mask: 1 real, 0 padding)."""
  return jnp.asarray(segment_ids_bt).astype(jnp.int32)


# ---------------------------------------------------------------------------------------
# xla: the reference, with the CPU-tuned bf16 backward
# ---------------------------------------------------------------------------------------
def wide_probabilities(dtype, target=None) -> bool:
  """Whether `_softmax_attention` keeps its float32 probabilities for the value product of
  bf16 activations (the values widened into it) instead of rounding them to bf16: on TPU
  targets (`target`, default `context_target()`). There the bf16 copy was a materialised
  [B, Hkv, G, T, S] that XLA:TPU laid out against its reductions: the 1.5B paper setting's
  decode step with bf16 compute took 7.19 ms where float32 compute took 5.33, and 5.09
  with wide probabilities (docs/performance.md, "The papers' precision by default on
  accelerators"). Elsewhere the bf16 form (the field's kernels also round P to bf16 before
  P V): XLA:GPU would write a float32 copy of the cache's values for the product (the h100-1
  decode step read 23.8 GB instead of 17.9), and CPU numbers stay as they were."""
  return (jnp.dtype(dtype) == jnp.bfloat16
          and target_platform(context_target() if target is None else target) == "tpu")


def _softmax_attention(q_btkgd, parts, scale: float):
  """Grouped-query attention of T queries over one or more key/value parts.

  Args:
    q_btkgd: queries [B, T, Hkv, G, Dh] (G = H / Hkv query heads per kv head).
    parts: [(keys [B, Hkv, S_i, Dh], values [B, Hkv, S_i, Dh], mask bool[B, T, S_i])]; the
      softmax runs over the keys of all parts together.
  Returns:
    [B, Hkv, G, T, Dh] in q's dtype.
  """
  dt = q_btkgd.dtype
  if len(parts) == 1 and dt == jnp.bfloat16:
    keys, values, mask = parts[0]
    return attention_bf16(q_btkgd, keys, values, mask, scale)
  scores = [jnp.where(mask[:, None, None, :, :],
                      jnp.einsum("btkgd,bksd->bkgts", q_btkgd, keys,
                                 preferred_element_type=jnp.float32) * scale,
                      _MASKED)
            for keys, _, mask in parts]
  probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
  if not wide_probabilities(dt):
    probs = probs.astype(dt)
  attn_bkgtd, offset = 0, 0
  for keys, values, _ in parts:
    n = keys.shape[2]
    attn_bkgtd = attn_bkgtd + jnp.einsum(
        "bkgts,bksd->bkgtd", probs[..., offset:offset + n], values.astype(probs.dtype),
        preferred_element_type=jnp.float32).astype(dt)
    offset += n
  return attn_bkgtd


def _attention_probs(q_btkgd, k_bksd, mask_bts, scale):
  """f32 softmax probabilities [B, Hkv, G, T, S] (masked keys get exactly 0)."""
  scores = jnp.einsum("btkgd,bksd->bkgts", q_btkgd, k_bksd, preferred_element_type=jnp.float32)
  scores = jnp.where(mask_bts[:, None, None, :, :], scores * scale, _MASKED)
  return jax.nn.softmax(scores, axis=-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def attention_bf16(q_btkgd, k_bksd, v_bksd, mask_bts, scale: float):
  """softmax(q kᵀ · scale, masked) v for one key/value part, with a hand-written backward
  pass whose four products take bf16 operands (summed in f32).

  The same function as `_softmax_attention`'s plain path (scores, softmax and its gradient
  in f32); JAX's own backward of that path hands the products f32 cotangents, and an f32
  operand makes XLA:CPU run the product in f32 (measured: docs/performance.md "Benchmarks",
  iteration row). Operands of any float dtype; the output has q's dtype.

  Backward (g = dL/d out):  dV = Pᵀ g ;  dP = g Vᵀ ;  dS = P ⊙ (dP - rowsum(dP ⊙ P)) ;
  dQ = scale · dS K ;  dK = scale · dSᵀ Q.
  """
  return _attention_bf16_fwd(q_btkgd, k_bksd, v_bksd, mask_bts, scale)[0]


def _attention_bf16_fwd(q_btkgd, k_bksd, v_bksd, mask_bts, scale):
  dt = q_btkgd.dtype
  probs = _attention_probs(q_btkgd, k_bksd, mask_bts, scale)
  out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(dt), v_bksd,
                   preferred_element_type=jnp.float32)
  return out.astype(dt), (q_btkgd, k_bksd, v_bksd, mask_bts, probs)


def _attention_bf16_bwd(scale, res, g_bkgtd):
  q_btkgd, k_bksd, v_bksd, mask_bts, probs = res
  dt = q_btkgd.dtype
  g_bkgtd = g_bkgtd.astype(dt)
  dv = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(dt), g_bkgtd,
                  preferred_element_type=jnp.float32)
  dp = jnp.einsum("bkgtd,bksd->bkgts", g_bkgtd, v_bksd, preferred_element_type=jnp.float32)
  ds = (probs * (dp - jnp.sum(dp * probs, axis=-1, keepdims=True)) * scale).astype(dt)
  # (the product in [B, Hkv, G, T, Dh] order, then transposed: XLA:CPU has no kernel for
  # a bf16 x bf16 -> f32 product written straight into the q layout)
  dq = jnp.einsum("bkgts,bksd->bkgtd", ds, k_bksd,
                  preferred_element_type=jnp.float32).transpose(0, 3, 1, 2, 4)
  dk = jnp.einsum("bkgts,btkgd->bksd", ds, q_btkgd, preferred_element_type=jnp.float32)
  return dq.astype(dt), dk.astype(k_bksd.dtype), dv.astype(v_bksd.dtype), None


attention_bf16.defvjp(_attention_bf16_fwd, _attention_bf16_bwd)


def _grouped(q_bthd, num_kv_heads: int):
  """[B, T, H, Dh] -> [B, T, Hkv, G, Dh] (a free reshape: head h = kv head h // G)."""
  b, t, h, d = q_bthd.shape
  return q_bthd.reshape(b, t, num_kv_heads, h // num_kv_heads, d)


def _ungrouped(out_bkgtd):
  """[B, Hkv, G, T, Dh] -> [B, T, H, Dh]."""
  b, k, g, t, d = out_bkgtd.shape
  return out_bkgtd.transpose(0, 3, 1, 2, 4).reshape(b, t, k * g, d)


def _xla(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale, query_chunk):
  q_btkgd = _grouped(q_bthd, k_bshd.shape[2])
  k_bksd = k_bshd.transpose(0, 2, 1, 3)
  v_bksd = v_bshd.transpose(0, 2, 1, 3)
  t = q_bthd.shape[1]
  if causal and 0 < query_chunk < t:
    # Causal block skipping: queries [s, e) read keys [0, e) only (the rest is masked),
    # so n chunks score ~(n + 1) / 2n of the T x T square.
    chunks = []
    for s in range(0, t, query_chunk):
      e = min(s + query_chunk, t)
      mask = segment_mask(seg_bt[:, s:e], seg_bt[:, :e], True, q_offset=s)
      chunks.append(_softmax_attention(q_btkgd[:, s:e],
                                        [(k_bksd[:, :, :e], v_bksd[:, :, :e], mask)], scale))
    return _ungrouped(jnp.concatenate(chunks, axis=3))
  mask = segment_mask(seg_bt, seg_bt, causal)
  return _ungrouped(_softmax_attention(q_btkgd, [(k_bksd, v_bksd, mask)], scale))


# ---------------------------------------------------------------------------------------
# chunked: online softmax over key blocks, recomputing backward
# ---------------------------------------------------------------------------------------
def _block_scores(q_bkgtd, k_bksd, q_seg_bt, kv_seg_bs, start, causal, scale):
  """Masked f32 scores [B, Hkv, G, T, Bk] of one key block starting at slot `start`, and
  its mask [B, 1, 1, T, Bk]."""
  s = jnp.einsum("bkgtd,bksd->bkgts", q_bkgtd, k_bksd, preferred_element_type=jnp.float32)
  mask = q_seg_bt[:, :, None] == kv_seg_bs[:, None, :]
  if causal:
    t, bk = q_seg_bt.shape[1], kv_seg_bs.shape[1]
    mask = mask & (start + jnp.arange(bk)[None, None, :] <= jnp.arange(t)[None, :, None])
  mask = mask[:, None, None]
  return jnp.where(mask, s * scale, _MASKED), mask


def _chunked_forward(q_bkgtd, k_nbksd, v_nbksd, q_seg_bt, kv_seg_nbs, causal, scale):
  """(out [B, Hkv, G, T, Dh] in q's dtype, log-sum-exp f32[B, Hkv, G, T])."""
  b, k, g, t, d = q_bkgtd.shape
  block = k_nbksd.shape[3]
  starts = jnp.arange(k_nbksd.shape[0]) * block

  def body(carry, xs):
    m, l, acc = carry
    k_bksd, v_bksd, seg_bs, start = xs
    s, mask = _block_scores(q_bkgtd, k_bksd, q_seg_bt, seg_bs, start, causal, scale)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)  # rescales what earlier blocks summed under the old maximum
    l = alpha * l + jnp.sum(p, axis=-1)
    acc = alpha[..., None] * acc + jnp.einsum("bkgts,bksd->bkgtd", p.astype(v_bksd.dtype), v_bksd,
                                              preferred_element_type=jnp.float32)
    return (m_new, l, acc), None

  init = (jnp.full((b, k, g, t), _MASKED, jnp.float32), jnp.zeros((b, k, g, t), jnp.float32),
          jnp.zeros((b, k, g, t, d), jnp.float32))
  (m, l, acc), _ = jax.lax.scan(body, init, (k_nbksd, v_nbksd, kv_seg_nbs, starts))
  l = jnp.where(l > 0, l, 1.0)  # unreachable under rule (1); keeps a bad input finite
  return (acc / l[..., None]).astype(q_bkgtd.dtype), m + jnp.log(l)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _chunked_core(q_bkgtd, k_nbksd, v_nbksd, q_seg_bt, kv_seg_nbs, causal, scale):
  return _chunked_forward(q_bkgtd, k_nbksd, v_nbksd, q_seg_bt, kv_seg_nbs, causal, scale)[0]


def _chunked_core_fwd(q_bkgtd, k_nbksd, v_nbksd, q_seg_bt, kv_seg_nbs, causal, scale):
  out, lse = _chunked_forward(q_bkgtd, k_nbksd, v_nbksd, q_seg_bt, kv_seg_nbs, causal, scale)
  return out, (q_bkgtd, k_nbksd, v_nbksd, q_seg_bt, kv_seg_nbs, out, lse)


def _chunked_core_bwd(causal, scale, res, g_bkgtd):
  """Per key block: P = exp(S - lse); dV = Pᵀ g; dP = g Vᵀ; dS = P ⊙ (dP - Δ) · scale with
  Δ = rowsum(g ⊙ out); dQ += dS K; dK = dSᵀ Q (FlashAttention-2, Alg. 2)."""
  q_bkgtd, k_nbksd, v_nbksd, q_seg_bt, kv_seg_nbs, out, lse = res
  dt = q_bkgtd.dtype
  g_bkgtd = g_bkgtd.astype(dt)
  delta = jnp.sum(g_bkgtd.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  block = k_nbksd.shape[3]
  starts = jnp.arange(k_nbksd.shape[0]) * block

  def body(dq, xs):
    k_bksd, v_bksd, seg_bs, start = xs
    s, mask = _block_scores(q_bkgtd, k_bksd, q_seg_bt, seg_bs, start, causal, scale)
    p = jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)
    dv = jnp.einsum("bkgts,bkgtd->bksd", p.astype(dt), g_bkgtd,
                    preferred_element_type=jnp.float32)
    dp = jnp.einsum("bkgtd,bksd->bkgts", g_bkgtd, v_bksd, preferred_element_type=jnp.float32)
    ds = (p * (dp - delta[..., None]) * scale).astype(dt)
    dq = dq + jnp.einsum("bkgts,bksd->bkgtd", ds, k_bksd, preferred_element_type=jnp.float32)
    dk = jnp.einsum("bkgts,bkgtd->bksd", ds, q_bkgtd, preferred_element_type=jnp.float32)
    return dq, (dk.astype(k_bksd.dtype), dv.astype(v_bksd.dtype))

  dq, (dk, dv) = jax.lax.scan(body, jnp.zeros(q_bkgtd.shape, jnp.float32),
                              (k_nbksd, v_nbksd, kv_seg_nbs, starts))
  return dq.astype(dt), dk, dv, None, None


_chunked_core.defvjp(_chunked_core_fwd, _chunked_core_bwd)


def _chunked(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale, block_kv):
  b, t, h, d = q_bthd.shape
  hkv = k_bshd.shape[2]
  block = min(block_kv, t)
  n = -(-t // block)
  pad = n * block - t
  # Padded key slots get segment -1, which no query has (ids are >= 0): never read.
  kv_seg_bs = jnp.pad(seg_bt, ((0, 0), (0, pad)), constant_values=-1)
  to_blocks = lambda x_bshd: jnp.pad(x_bshd, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(
      b, n, block, hkv, d).transpose(1, 0, 3, 2, 4)  # [N, B, Hkv, Bk, Dh]
  q_bkgtd = _grouped(q_bthd, hkv).transpose(0, 2, 3, 1, 4)
  out_bkgtd = _chunked_core(q_bkgtd, to_blocks(k_bshd), to_blocks(v_bshd), seg_bt,
                            kv_seg_bs.reshape(b, n, block).transpose(1, 0, 2), causal, scale)
  return _ungrouped(out_bkgtd)


# ---------------------------------------------------------------------------------------
# splash: the Pallas TPU kernel under shard_map
# ---------------------------------------------------------------------------------------
def splash_block(length: int) -> int:
  """Block size of a (padded) sequence: the largest of 512, 256, 128 dividing it."""
  return next(b for b in (512, 256, SPLASH_BLOCK) if length % b == 0)


def _splash_local(q_bhtd, k_bhsd, v_bhsd, seg_bt, *, causal: bool, interpret: bool):
  """The kernel on one device's rows and heads: q [B, H, T, Dh], k/v [B, Hkv, T, Dh]."""
  h, t = q_bhtd.shape[1], q_bhtd.shape[2]
  head_mask = splash_mask.CausalMask((t, t)) if causal else splash_mask.FullMask((t, t))
  block = splash_block(t)
  sizes = splash_lib.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                                block_q_dkv=block, block_kv_dkv=block,
                                block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
  kernel = splash_lib.make_splash_mha(splash_mask.MultiHeadMask([head_mask] * h),
                                      block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                      interpret=interpret)
  one_row = lambda q, k, v, s: kernel(q, k, v, segment_ids=splash_lib.SegmentIds(q=s, kv=s))
  return jax.vmap(one_row)(q_bhtd, k_bhsd, v_bhsd, seg_bt)


def splash_specs(mesh, batch: int, heads: int, kv_heads: int):
  """(rows spec, heads spec) of the splash shard_map: rows over the mesh's batch axes,
  heads over its head axis when both H and Hkv divide evenly (else heads replicated)."""
  rows = logical_to_spec(("batch",), mesh, shape=(batch,))[0]
  head = logical_to_spec(("heads",), mesh, shape=(heads,))[0]
  kv_head = logical_to_spec(("kv_heads",), mesh, shape=(kv_heads,))[0]
  return rows, (head if head == kv_head else None)


def _splash(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale, mesh):
  b, t, h, _ = q_bthd.shape
  hkv = k_bshd.shape[2]
  mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh
  target = jax.devices() if mesh.empty else mesh
  interpret = target_platform(target) != "tpu"
  seg_bt, q_bthd, k_bshd, v_bshd = pad_to_length(padded_length("splash", t), seg_bt, q_bthd,
                                                 k_bshd, v_bshd)
  # The kernel takes no scale: fold it into q (in f32, then back to q's dtype).
  q_bhtd = (q_bthd.astype(jnp.float32) * scale).astype(q_bthd.dtype).transpose(0, 2, 1, 3)
  k_bhsd = k_bshd.transpose(0, 2, 1, 3)
  v_bhsd = v_bshd.transpose(0, 2, 1, 3)
  local = functools.partial(_splash_local, causal=causal, interpret=interpret)
  if mesh.empty:
    out_bhtd = local(q_bhtd, k_bhsd, v_bhsd, seg_bt)
  else:
    rows, heads = splash_specs(mesh, b, h, hkv)
    qkv_spec = P(rows, heads, None, None)
    out_bhtd = jax.shard_map(local, mesh=mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec, P(rows)),
                             out_specs=qkv_spec, check_vma=False)(q_bhtd, k_bhsd, v_bhsd, seg_bt)
  return out_bhtd[:, :, :t].transpose(0, 2, 1, 3)


# ---------------------------------------------------------------------------------------
# Padding to the length a kernel takes
# ---------------------------------------------------------------------------------------
PAD_SEGMENT = -1
"""Segment of the positions `pad_to_length` appends: one of their own, so no real query
reads them (they come after every real position, and in another segment) and each reads at
least itself (no empty softmax row)."""


def padded_length(impl: str, length: int) -> int:
  """The sequence length `impl` computes on: splash rounds T up to a multiple of
  `SPLASH_BLOCK` (its only granularity), cudnn up to an even length (its fused kernel
  refuses odd ones in training: seen on an H100 with jax 0.11.2), the others take T.

  Each call pads to it (`pad_to_length`) and slices its output back; a caller that runs
  many calls over one sequence (the decoder's layer stack) pads its input once instead,
  so no layer pads again (`Decoder._hidden`)."""
  if impl == "splash":
    return -(-length // SPLASH_BLOCK) * SPLASH_BLOCK
  if impl == "cudnn":
    return length + length % 2
  return length


def pad_to_length(length: int, seg_bt, *xs_bt):
  """(segment ids, *xs) with positions T..length-1 appended: zeros in every x [B, T, ...],
  `PAD_SEGMENT` in the segment ids. Exact for the first T positions of causal or
  segment-masked attention, gradients included (the appended ones are read by nobody
  else); nothing is appended when T == length."""
  pad = length - seg_bt.shape[1]
  if pad < 0:
    raise ValueError(f"pad_to_length: length {length} is shorter than T={seg_bt.shape[1]}.")
  if pad == 0:
    return (seg_bt, *xs_bt)
  widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  seg = jnp.concatenate([seg_bt, jnp.full((seg_bt.shape[0], pad), PAD_SEGMENT, seg_bt.dtype)],
                        axis=1)
  return (seg, *(widen(x) for x in xs_bt))


# ---------------------------------------------------------------------------------------
# cudnn
# ---------------------------------------------------------------------------------------
def _cudnn(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale):
  if q_bthd.dtype not in (jnp.bfloat16, jnp.float16):
    raise ValueError(f"attention_impl='cudnn' needs bfloat16/float16 activations, got "
                     f"{q_bthd.dtype}: set model.compute_dtype=bfloat16, or use "
                     "attention_impl='xla' or 'chunked'.")
  # cuDNN's fused kernel with a mask (passed as a bias) refuses an odd sequence length in
  # training (jax._src.cudnn.fused_attention_stablehlo.check_is_flash_attention; seen on
  # an H100 with jax 0.11.2): pad to an even length, slice back.
  t = q_bthd.shape[1]
  seg_bt, q_bthd, k_bshd, v_bshd = pad_to_length(padded_length("cudnn", t), seg_bt, q_bthd,
                                                 k_bshd, v_bshd)
  mask_b1ts = (seg_bt[:, :, None] == seg_bt[:, None, :])[:, None]
  out = jax.nn.dot_product_attention(q_bthd, k_bshd, v_bshd, mask=mask_b1ts, scale=scale,
                                     is_causal=causal, implementation="cudnn")
  return out[:, :t]


# ---------------------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------------------
def attention(q_bthd, k_bshd, v_bshd, segment_ids_bt, *, causal: bool = True,
              impl: str = "xla", scale: float | None = None, query_chunk: int = 0,
              block_kv: int = 512, mesh=None) -> jax.Array:
  """Self-attention of T tokens by rule (1) of the module docstring.

  Args:
    q_bthd: queries after RoPE, [B, T, H, Dh].
    k_bshd, v_bshd: keys after RoPE and values, [B, T, Hkv, Dh] (H % Hkv == 0).
    segment_ids_bt: int or bool [B, T]: segment of each token (0 = padding).
    causal: key s is read by query t only if s <= t.
    impl: one of IMPLEMENTATIONS, or "auto" (resolved against `mesh` or the context).
    scale: logit scale, default Dh^-1/2.
    query_chunk: xla only: causal block skipping in chunks of this many queries (0: off).
    block_kv: chunked only: keys per block.
    mesh: splash only: the mesh to shard_map over; None: the `jax.set_mesh` context mesh
      (none set: one unsharded kernel call).
  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  b, t, h, d = q_bthd.shape
  if k_bshd.shape[:2] != (b, t) or v_bshd.shape != k_bshd.shape or h % k_bshd.shape[2]:
    raise ValueError(f"attention: q {q_bthd.shape} and k/v {k_bshd.shape}/{v_bshd.shape} are "
                     "not [B, T, H, Dh] and [B, T, Hkv, Dh] with H a multiple of Hkv.")
  impl = resolve_impl(impl, context_target() if mesh is None else mesh, length=t)
  scale = d ** -0.5 if scale is None else scale
  seg_bt = _as_segment_ids(segment_ids_bt)
  if impl == "xla":
    return _xla(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale, query_chunk)
  if impl == "chunked":
    return _chunked(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale, block_kv)
  if impl == "splash":
    return _splash(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale, mesh)
  return _cudnn(q_bthd, k_bshd, v_bshd, seg_bt, causal, scale)


def decode_attention(q_bthd, k_bthd, v_bthd, segment_ids_bt, k_cache_bksd, v_cache_bksd, *,
                     cache_start_b, cache_index, scale: float | None = None,
                     impl: str = "xla", layer=None) -> jax.Array:
  """T new tokens over a KV cache (per-row valid slots) and over themselves.

  Query t of row b reads cache slots [cache_start_b[b], cache_index[b]) and new token t'
  by rule (1) (same segment, t' <= t). The new tokens' keys are not in the cache yet (the
  caller writes them to [cache_index, cache_index + T) afterwards), so stale slots there
  are never read.

  Args:
    q_bthd: queries [B, T, H, Dh]; k_bthd, v_bthd: the new keys/values [B, T, Hkv, Dh].
    segment_ids_bt: int or bool [B, T] of the new tokens.
    k_cache_bksd, v_cache_bksd: one layer's cache [B, Hkv, S, Dh] (cast to q's dtype).
    cache_start_b: int32[B] first valid slot per row (left padding lies before it).
    cache_index: int32 scalar (may be traced), or int32[B] per row (a slotted cache whose
      rows decode at their own offsets): slots >= it are not read from the cache.
    scale: logit scale, default Dh^-1/2.
    impl: a key of `DECODE_KERNELS`, or "auto" (`resolve_decode_impl` against the
      context).
    layer: None; or the layer to read (int32, may be traced) when the caches are all
      layers' [L, B, Hkv, S, Dh]: a kernel of `STACKED_DECODE_IMPLEMENTATIONS` reads it in
      place, the others get that layer's slice.
  Returns:
    [B, T, H, Dh] in q's dtype.
  """
  impl = resolve_decode_impl(impl, context_target(), head_dim=q_bthd.shape[-1])
  if impl not in DECODE_KERNELS:
    raise ValueError(f"decode_attention impl={impl!r} has no registered kernel; registered: "
                     f"{tuple(DECODE_KERNELS)}.")
  if layer is not None and impl not in STACKED_DECODE_IMPLEMENTATIONS:
    k_cache_bksd, v_cache_bksd = (jax.lax.dynamic_index_in_dim(c, layer, keepdims=False)
                                  for c in (k_cache_bksd, v_cache_bksd))
    layer = None
  kernel = DECODE_KERNELS[impl]
  if layer is None:
    call = lambda q, k, v, seg, kc, vc, start, index: kernel(
        q, k, v, seg, kc, vc, cache_start_b=start, cache_index=index, scale=scale)
    operands = (q_bthd, k_bthd, v_bthd, segment_ids_bt, k_cache_bksd, v_cache_bksd,
                cache_start_b, cache_index)
  else:
    call = lambda q, k, v, seg, kc, vc, start, index, lay: kernel(
        q, k, v, seg, kc, vc, cache_start_b=start, cache_index=index, scale=scale, layer=lay)
    operands = (q_bthd, k_bthd, v_bthd, segment_ids_bt, k_cache_bksd, v_cache_bksd,
                cache_start_b, cache_index, layer)
  mesh = jax.sharding.get_abstract_mesh()
  if impl == "xla" or mesh.empty:
    return call(*operands)
  return _decode_shard_map(call, operands, mesh)


def _decode_shard_map(call, operands, mesh):
  """A Pallas decode kernel under `jax.shard_map` over the mesh in context: each device runs
  it on its own rows (the batch axes) and kv heads (the head axis, when H and Hkv both
  divide over it, as `splash_specs`); the cache keeps the layout of `kv_cache`'s shardings
  ([L,] B, Hkv, S, Dh), so the kernel reads it where it lies."""
  q_bthd, k_cache = operands[0], operands[4]
  b, _, h, _ = q_bthd.shape
  hkv = operands[1].shape[2]
  rows, heads = splash_specs(mesh, b, h, hkv)
  stacked = k_cache.ndim == 5
  cache_spec = P(None, rows, heads, None, None) if stacked else P(rows, heads, None, None)
  token_spec = P(rows, None, heads, None)
  index = operands[7]
  specs = (token_spec, token_spec, token_spec, P(rows, None), cache_spec, cache_spec, P(rows),
           P() if jnp.ndim(index) == 0 else P(rows)) + ((P(),) if len(operands) == 9 else ())
  return jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=token_spec,
                       check_vma=False)(*operands)


def _decode_xla(q_bthd, k_bthd, v_bthd, segment_ids_bt, k_cache_bksd, v_cache_bksd, *,
                cache_start_b, cache_index, scale: float | None = None) -> jax.Array:
  """The "xla" decode kernel: masked softmax over the cache slots and the new tokens."""
  dt = q_bthd.dtype
  b, t, _, d = q_bthd.shape
  scale = d ** -0.5 if scale is None else scale
  seg_bt = _as_segment_ids(segment_ids_bt)
  slot_s = jnp.arange(k_cache_bksd.shape[2])
  end_b1 = jnp.reshape(cache_index, (-1, 1))  # [1, 1] (one index) or [B, 1] (per row)
  cached_bs = (slot_s[None, :] >= cache_start_b[:, None]) & (slot_s[None, :] < end_b1)
  cached_bts = jnp.broadcast_to(cached_bs[:, None, :], (b, t, slot_s.shape[0]))
  parts = [(k_cache_bksd.astype(dt), v_cache_bksd.astype(dt), cached_bts),
           (k_bthd.transpose(0, 2, 1, 3), v_bthd.transpose(0, 2, 1, 3),
            segment_mask(seg_bt, seg_bt, True))]
  return _ungrouped(_softmax_attention(_grouped(q_bthd, k_bthd.shape[2]), parts, scale))


DECODE_KERNELS: dict[str, Callable[..., jax.Array]] = {"xla": _decode_xla}
"""Decode-attention kernels by name, each with the signature of `decode_attention` (less
`impl`): (q, k, v, segment_ids, k_cache, v_cache, *, cache_start_b, cache_index, scale)."""


def register_decode_kernel(name: str, kernel: Callable[..., jax.Array]) -> None:
  """Adds `kernel` to `DECODE_KERNELS` as `name` (a name of
  `attention_names.DECODE_IMPLEMENTATIONS`, so configs may select it)."""
  if name not in DECODE_IMPLEMENTATIONS:
    raise ValueError(f"register_decode_kernel: {name!r} is not one of "
                     f"attention_names.DECODE_IMPLEMENTATIONS {DECODE_IMPLEMENTATIONS}; add it "
                     "there first.")
  DECODE_KERNELS[name] = kernel


def segment_ids_from_lengths(lengths_b, length: int, *, left_padded: bool = True):
  """int32[B, length] of one sequence per row: 1 on its `lengths_b[b]` tokens (at the end
  of the row when left-padded, at the start otherwise), 0 on padding."""
  slot_t = jnp.arange(length)[None, :]
  lengths = jnp.asarray(lengths_b)[:, None]
  real = slot_t >= length - lengths if left_padded else slot_t < lengths
  return real.astype(jnp.int32)

