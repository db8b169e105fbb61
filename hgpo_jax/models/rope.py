"""Rotary position embeddings (RoFormer, Su et al., arXiv:2104.09864): the inverse
frequencies of each RoPE scaling, the angles of given positions and the rotation itself.

The scalings are transformers' (`modeling_rope_utils.py`, `ROPE_INIT_FUNCTIONS`): "default"
θ^(-2i/Dh); "linear" (position interpolation, Chen et al., arXiv:2306.15595) divides every
frequency by `factor`; "llama3" (Llama 3.1/3.2) divides the low frequencies by `factor`,
keeps the high ones and blends the band between; "yarn" (Peng et al., arXiv:2309.00071)
blends interpolated and extrapolated frequencies by a ramp over the dimensions and scales
cos and sin by an attention factor. They are computed once per trace on the host, in
float64 numpy, from the config's `rope_scaling` (a hashable tuple).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hgpo_jax.models import platform


def inverse_frequencies(head_dim: int, theta: float,
                        scaling: tuple = ()) -> tuple[np.ndarray, float]:
  """(f32[Dh/2] inverse frequencies, attention factor) of a RoPE scaling
  (`ModelConfig.rope_scaling`; () is the default RoPE, attention factor 1).

  Transcribes transformers' `_compute_linear_scaling_rope_parameters`,
  `_compute_llama3_parameters` and `_compute_yarn_parameters` (YaRN eqs. 17-23: the
  ramp γ over dimensions between the beta_fast and beta_slow rotation counts, and
  √(1/t) = 0.1 ln(s) + 1 as the attention factor unless given)."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  params = dict(scaling)
  kind = params.get("rope_type", "default")
  attention_factor = 1.0
  if kind == "linear":
    inv_freq = inv_freq / params["factor"]
  elif kind == "llama3":
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    inv_freq = np.where(medium, smoothed, scaled)
  elif kind == "yarn":
    inv_freq, attention_factor = _yarn(inv_freq, head_dim, theta, params)
  elif kind != "default":
    raise ValueError(f"RoPE scaling rope_type={kind!r} is not implemented.")
  return inv_freq.astype(np.float32), float(attention_factor)


def _yarn(inv_freq: np.ndarray, dim: int, theta: float, params: dict):
  """YaRN's (inverse frequencies, attention factor) (transformers' `_compute_yarn_parameters`)."""
  factor = params["factor"]

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention_factor = params.get("attention_factor")
  if attention_factor is None:
    if params.get("mscale") and params.get("mscale_all_dim"):
      attention_factor = mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    else:
      attention_factor = mscale(factor)
  beta_fast = params.get("beta_fast") or 32
  beta_slow = params.get("beta_slow") or 1
  original = params["original_max_position_embeddings"]

  def correction_dim(rotations):  # the dimension that turns `rotations` times over `original`
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(beta_fast), correction_dim(beta_slow)
  if params.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # transformers' guard against a zero-width ramp
  ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp  # 1: keep the frequency (high frequencies), 0: interpolate
  return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation, attention_factor


def rope_angles(positions_bt: jax.Array, head_dim: int, theta: float, scaling: tuple = ()):
  """(cos, sin), each f32[B, T, Dh/2], of the RoPE angles pos · inv_freq (`inverse_frequencies`
  of `scaling`), both times the scaling's attention factor (YaRN; 1 otherwise, then not
  multiplied at all).

  The inverse frequencies are a trace-time numpy constant, so nothing is rebuilt per call.
  """
  inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
  angles_btk = positions_bt.astype(jnp.float32)[..., None] * inv_freq
  cos, sin = jnp.cos(angles_btk), jnp.sin(angles_btk)
  if attention_factor != 1.0:
    cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
  return cos, sin


def apply_rope(x_bthd: jax.Array, cos_btk: jax.Array, sin_btk: jax.Array, layout: str,
               rotate_by_product: bool = False) -> jax.Array:
  """Rotates pairs of x[B, T, H, Dh] by the RoPE angles (RoFormer eq. 34).

  layout "half" pairs (i, i + Dh/2) (HF rotate_half); "interleaved" pairs (2i, 2i+1) (GGML
  "normal" RoPE, which the llama.cpp converter's q/k row permutation makes equivalent).
  rotate_by_product (`rope_rotation_by_product`: TPU targets; layout "half"): the halves'
  partners come from one product with the constant signed permutation
  `rope_rotation(Dh)` at full f32 precision, and out = x cos + rot(x) sin over all Dh
  lanes: each lane's products and sum in the halves' form's order, so the same values
  (bit for bit on XLA:CPU; a zero's sign aside), where XLA:TPU otherwise runs the halves
  as 64-lane ops and lays them out again for the attention.
  """
  x = x_bthd.astype(jnp.float32)
  cos, sin = cos_btk[:, :, None, :], sin_btk[:, :, None, :]
  if layout == "half" and rotate_by_product:
    rot_bthd = jnp.einsum("bthd,de->bthe", x, rope_rotation(x.shape[-1]),
                          precision=jax.lax.Precision.HIGHEST)
    both = lambda a: jnp.concatenate([a, a], axis=-1)  # noqa: E731
    out = x * both(cos) + rot_bthd * both(sin)
  elif layout == "half":
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  elif layout == "interleaved":
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
  else:
    raise ValueError(f"Unknown rope_layout {layout!r}.")
  return out.astype(x_bthd.dtype)


def rope_rotation(head_dim: int) -> np.ndarray:
  """f32[Dh, Dh] R with (x @ R) each lane's RoPE partner in the "half" layout, signed as
  `apply_rope` multiplies it by sin: (x @ R)[i] = -x[i + Dh/2], (x @ R)[i + Dh/2] = x[i]."""
  half = head_dim // 2
  first = np.arange(half)
  rot = np.zeros((head_dim, head_dim), np.float32)
  rot[first + half, first] = -1.0
  rot[first, first + half] = 1.0
  return rot


def rope_rotation_by_product(target) -> bool:
  """Whether `apply_rope` takes the halves' partners by a product (`rotate_by_product`): on
  TPU targets. XLA:TPU ran the halves' form as ops on 64 of a tile's 128 lanes and then
  re-laid the queries out for the attention kernel: 0.46M + 0.23M cycles of a 1.5B prefill
  layer, where the product and one full-lane fusion take ~0.19M (docs/performance.md,
  "RoPE by a product on TPU"). Elsewhere the halves' form (CPU programs unchanged)."""
  return platform.target_platform(target) == "tpu"
