"""The decoder's numeric primitives: RMSNorm and the projections x @ Wᵀ (with the
mixed-precision bf16 product and its custom backward) that its blocks and LoRA adapters
apply."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x_btd: jax.Array, scale_d: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) · scale, statistics in f32."""
  x = x_btd.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (x * scale_d.astype(jnp.float32)).astype(x_btd.dtype)


def project(x_bti, w_oi):
  """x @ W^T for a weight stored [out..., in]: output [B, T, out...] in x's dtype.

  Written as a 2-D `x @ w.T` on purpose: XLA:CPU then fuses the per-layer weight slice
  into the dot, several times faster than multi-axis einsums for a SmolLM2 decode step
  (docs/performance.md, "Figures cited by the code"). A bfloat16 `x` takes the
  mixed-precision product `matmul_bf16` (the weight is cast inside it)."""
  out_shape = w_oi.shape[:-1]
  w_2d = w_oi.reshape(-1, w_oi.shape[-1])
  if x_bti.dtype == jnp.bfloat16:
    out = matmul_bf16(x_bti, w_2d)
  else:
    out = x_bti @ w_2d.astype(x_bti.dtype).T
  return out.reshape(*x_bti.shape[:-1], *out_shape)


@jax.custom_vjp
def matmul_bf16(x_bti, w_oi):
  """bf16[B, T, in] @ W[out, in]^T -> bf16[B, T, out], every product bf16 x bf16 summed in
  f32, the forward and both backward products alike; W's gradient comes back in W's
  dtype (f32 master weights get an f32 gradient, summed over all tokens in f32).

  Why: XLA:CPU runs a bf16 x bf16 dot with an f32 result on the AVX512-BF16 kernels
  (~2.3x its f32 dot on the reference machine), but a dot with a bf16 result, or one
  operand in f32, at f32 speed or below; JAX's own transpose of the forward would hand
  the backward an f32 cotangent (docs/performance.md "Benchmarks", iteration row)."""
  return _matmul_bf16_fwd(x_bti, w_oi)[0]


def dot_f32(a, b, contract: tuple[int, int]):
  """`a` . `b` contracting axis contract[0] of a with contract[1] of b, summed into f32.

  `lax.dot_general` on purpose: `jnp.matmul(..., preferred_element_type=f32)` converts bf16
  operands to f32 first (an f32 dot, half the speed on XLA:CPU)."""
  return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                             preferred_element_type=jnp.float32)


def _matmul_bf16_fwd(x_bti, w_oi):
  out = dot_f32(x_bti, w_oi.astype(jnp.bfloat16), (2, 1)).astype(jnp.bfloat16)
  return out, (x_bti, w_oi)


def _matmul_bf16_bwd(res, g_bto):
  x_bti, w_oi = res
  g_bto = g_bto.astype(jnp.bfloat16)
  dx_bti = dot_f32(g_bto, w_oi.astype(jnp.bfloat16), (2, 0))
  g_no = g_bto.reshape(-1, g_bto.shape[-1])
  x_ni = x_bti.reshape(-1, x_bti.shape[-1])
  dw_oi = dot_f32(g_no, x_ni, (0, 0))
  return dx_bti.astype(x_bti.dtype), dw_oi.astype(w_oi.dtype)


matmul_bf16.defvjp(_matmul_bf16_fwd, _matmul_bf16_bwd)
