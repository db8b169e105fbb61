"""The decoder-only transformer of the Llama / Qwen2 family in Flax NNX, with a KV cache.

Block (pre-norm, as in Llama and Qwen2):
  h = x + Wo · Attn(RoPE(Wq·RMSNorm(x) [+bq]), RoPE(Wk·RMSNorm(x) [+bk]), Wv·RMSNorm(x) [+bv])
  y = h + Wdown · (silu(Wgate·RMSNorm(h)) ⊙ Wup·RMSNorm(h))
Grouped-query attention: query head h reads key/value head h // (H / Hkv), as in
Hugging Face `repeat_kv`. Layer parameters are stacked on a leading "layers" axis and the
blocks run under `lax.scan`, so a 30-layer model compiles one block.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (names such as
"embed", "heads", "mlp", "vocab"); `hgpo_jax.models.sharding` maps them to mesh axes.
Softmax, RMSNorm statistics, RoPE and logits are computed in float32 whatever `cfg.dtype`.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hgpo_jax.models.config import ModelConfig

# Large negative instead of -inf: a fully masked row (a left-pad query) then gets a
# uniform, finite softmax instead of NaNs that would poison gradients through `where`.
_MASKED = -1e30


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values of the tokens seen so far.

  Attributes:
    k: keys after RoPE, [L, B, S, Hkv, Dh] in cfg.dtype.
    v: values, [L, B, S, Hkv, Dh] in cfg.dtype.
  """
  k: jax.Array
  v: jax.Array


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  """An all-zero cache for `batch` rows of `length` positions, in cfg.dtype."""
  shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
  return KVCache(k=jnp.zeros(shape, cfg.compute_dtype), v=jnp.zeros(shape, cfg.compute_dtype))


def causal_mask(input_mask_bt: jax.Array) -> jax.Array:
  """bool[B, T, T]: query t may read key s iff s <= t and key s is a real (non-pad) token.

  Args:
    input_mask_bt: bool/int[B, T], 1 for real tokens, 0 for padding (left or right).
  """
  t = input_mask_bt.shape[1]
  causal_tt = jnp.tril(jnp.ones((t, t), dtype=bool))
  return causal_tt[None, :, :] & input_mask_bt.astype(bool)[:, None, :]


def rope_angles(positions_bt: jax.Array, head_dim: int, theta: float):
  """(cos, sin), each f32[B, T, Dh/2], of the RoPE angles pos · θ^(-2i/Dh).

  The inverse frequencies are a trace-time numpy constant, so nothing is rebuilt per call.
  """
  inv_freq = (1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
  angles_btk = positions_bt.astype(jnp.float32)[..., None] * inv_freq.astype(np.float32)
  return jnp.cos(angles_btk), jnp.sin(angles_btk)


def apply_rope(x_bthd: jax.Array, cos_btk: jax.Array, sin_btk: jax.Array, layout: str) -> jax.Array:
  """Rotates pairs of x[B, T, H, Dh] by the RoPE angles (RoFormer eq. 34).

  layout "half" pairs (i, i + Dh/2) (HF rotate_half); "interleaved" pairs (2i, 2i+1) (GGML
  "normal" RoPE, which the llama.cpp converter's q/k row permutation makes equivalent).
  """
  x = x_bthd.astype(jnp.float32)
  cos, sin = cos_btk[:, :, None, :], sin_btk[:, :, None, :]
  if layout == "half":
    x1, x2 = jnp.split(x, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  elif layout == "interleaved":
    pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)
  else:
    raise ValueError(f"Unknown rope_layout {layout!r}.")
  return out.astype(x_bthd.dtype)


def rms_norm(x_btd: jax.Array, scale_d: jax.Array, eps: float) -> jax.Array:
  """RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x²) + eps) · scale, statistics in f32."""
  x = x_btd.astype(jnp.float32)
  x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  return (x * scale_d.astype(jnp.float32)).astype(x_btd.dtype)


def _param(rngs: nnx.Rngs, shape, std: float | None, dtype, axes) -> nnx.Param:
  """A Param of N(0, std²) (std None: ones) with its logical axis names as metadata."""
  if std is None:
    value = jnp.ones(shape, dtype)
  else:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
  return nnx.Param(value, logical_axes=axes)


class DecoderLayers(nnx.Module):
  """The parameters of all L blocks, stacked on a leading "layers" axis.

  Shapes: attn_norm/mlp_norm [L, D]; q [L, H, Dh, D]; k, v [L, Hkv, Dh, D]; o [L, D, H, Dh];
  q_bias [L, H, Dh], k_bias/v_bias [L, Hkv, Dh] (only with cfg.qkv_bias); gate, up [L, F, D];
  down [L, D, F]. Projections keep the checkpoints' [out, in] order, so loading needs no
  transposes; `_project` applies them as x @ Wᵀ.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    n, d, h, kv, dh, f = (cfg.num_layers, cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads,
                          cfg.head_dim, cfg.mlp_dim)
    dt = cfg.weight_dtype
    self.attn_norm = _param(rngs, (n, d), None, dt, ("layers", "norm"))
    self.q = _param(rngs, (n, h, dh, d), d ** -0.5, dt, ("layers", "heads", "head_dim", "embed"))
    self.k = _param(rngs, (n, kv, dh, d), d ** -0.5, dt, ("layers", "kv_heads", "head_dim", "embed"))
    self.v = _param(rngs, (n, kv, dh, d), d ** -0.5, dt, ("layers", "kv_heads", "head_dim", "embed"))
    self.o = _param(rngs, (n, d, h, dh), (h * dh) ** -0.5, dt, ("layers", "embed", "heads", "head_dim"))
    if cfg.qkv_bias:
      self.q_bias = _param(rngs, (n, h, dh), 0.02, dt, ("layers", "heads", "head_dim"))
      self.k_bias = _param(rngs, (n, kv, dh), 0.02, dt, ("layers", "kv_heads", "head_dim"))
      self.v_bias = _param(rngs, (n, kv, dh), 0.02, dt, ("layers", "kv_heads", "head_dim"))
    self.mlp_norm = _param(rngs, (n, d), None, dt, ("layers", "norm"))
    self.gate = _param(rngs, (n, f, d), d ** -0.5, dt, ("layers", "mlp", "embed"))
    self.up = _param(rngs, (n, f, d), d ** -0.5, dt, ("layers", "mlp", "embed"))
    self.down = _param(rngs, (n, d, f), f ** -0.5, dt, ("layers", "embed", "mlp"))

  def stacked(self) -> dict[str, jax.Array]:
    """name -> stacked array [L, ...] of every parameter (the `xs` of the layer scan)."""
    names = ["attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down"]
    if hasattr(self, "q_bias"):
      names += ["q_bias", "k_bias", "v_bias"]
    return {name: getattr(self, name)[...] for name in names}


def _project(x_bti, w_oi):
  """x @ W^T for a weight stored [out..., in]: output [B, T, out...].

  Written as a 2-D `x @ w.T` on purpose: XLA:CPU then fuses the per-layer weight slice
  into the dot. A batch-1 SmolLM2 decode step took 80 ms this way against 180-360 ms
  with multi-axis einsums (same machine, side by side)."""
  out_shape = w_oi.shape[:-1]
  w_2d = w_oi.reshape(-1, w_oi.shape[-1])
  return (x_bti @ w_2d.T).reshape(*x_bti.shape[:-1], *out_shape)


def _block(cfg: ModelConfig, p: dict, x_btd, cos_btk, sin_btk, mask_bts, cache=None, layer=None,
           cache_index=None):
  """One decoder block. p holds one layer's parameters (no leading L axis).

  Without cache the block attends over its own T keys. With one, `cache` = (k, v) of the
  whole model ([L, B, S, Hkv, Dh]): the block writes its T new keys/values at
  [layer, :, cache_index : cache_index + T] and attends over that layer's S keys. Only
  the new positions are written, in place (the cache is a loop carry), so a decode step
  moves T positions instead of copying the cache (see `Decoder.hidden`).
  Returns (x_btd, cache).
  """
  dt = cfg.compute_dtype
  b, t, _ = x_btd.shape
  w = lambda name: p[name].astype(dt)
  h_btd = rms_norm(x_btd, p["attn_norm"], cfg.rms_eps)
  q_bthk = _project(h_btd, w("q"))
  k_bthk = _project(h_btd, w("k"))
  v_bthk = _project(h_btd, w("v"))
  if cfg.qkv_bias:
    q_bthk, k_bthk, v_bthk = q_bthk + w("q_bias"), k_bthk + w("k_bias"), v_bthk + w("v_bias")
  q_bthk = apply_rope(q_bthk, cos_btk, sin_btk, cfg.rope_layout)
  k_bthk = apply_rope(k_bthk, cos_btk, sin_btk, cfg.rope_layout)
  if cache is None:
    keys, values = k_bthk, v_bthk
  else:
    k_lbshd, v_lbshd = cache
    zero = jnp.zeros((), jnp.int32)
    start = (layer, zero, cache_index, zero, zero)
    k_lbshd = jax.lax.dynamic_update_slice(k_lbshd, k_bthk[None].astype(k_lbshd.dtype), start)
    v_lbshd = jax.lax.dynamic_update_slice(v_lbshd, v_bthk[None].astype(v_lbshd.dtype), start)
    keys = jax.lax.dynamic_index_in_dim(k_lbshd, layer, 0, keepdims=False).astype(dt)
    values = jax.lax.dynamic_index_in_dim(v_lbshd, layer, 0, keepdims=False).astype(dt)
    cache = (k_lbshd, v_lbshd)
  groups = cfg.num_heads // cfg.num_kv_heads
  q_btkgd = q_bthk.reshape(b, t, cfg.num_kv_heads, groups, cfg.head_dim)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_btkgd, keys, preferred_element_type=jnp.float32)
  scores = scores * (cfg.head_dim ** -0.5)
  scores = jnp.where(mask_bts[:, None, None, :, :], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(dt)
  attn_bthk = jnp.einsum("bkgts,bskd->btkgd", probs, values).reshape(b, t, cfg.num_heads, cfg.head_dim)
  x_btd = x_btd + _project(attn_bthk.reshape(b, t, -1), w("o").reshape(cfg.hidden_dim, -1))
  h_btd = rms_norm(x_btd, p["mlp_norm"], cfg.rms_eps)
  gated_btf = jax.nn.silu(_project(h_btd, w("gate"))) * _project(h_btd, w("up"))
  x_btd = x_btd + _project(gated_btf, w("down"))
  return x_btd, cache


class Decoder(nnx.Module):
  """Llama / Qwen2 decoder: embedding, L pre-norm blocks, final RMSNorm, output layer.

  Parameters: embed [V, D] ("vocab", "embed"); layers (DecoderLayers); final_norm [D];
  lm_head [V, D] ("vocab", "embed") only when not cfg.tie_embeddings.
  """

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    dt = cfg.weight_dtype
    self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_dim), 0.02, dt, ("vocab", "embed"))
    self.layers = DecoderLayers(cfg, rngs=rngs)
    self.final_norm = _param(rngs, (cfg.hidden_dim,), None, dt, ("norm",))
    if not cfg.tie_embeddings:
      self.lm_head = _param(rngs, (cfg.vocab_size, cfg.hidden_dim), cfg.hidden_dim ** -0.5, dt,
                            ("vocab", "embed"))

  def hidden(self, tokens_bt, positions_bt, attn_mask_bts, cache: KVCache | None = None,
             cache_index=None):
    """Final-normed hidden states [B, T, D] (cfg.dtype) and the updated cache (or None).

    Args:
      tokens_bt: int32[B, T] token ids.
      positions_bt: int32[B, T] RoPE positions (left-padded rows start later).
      attn_mask_bts: bool[B, T, S]; S == T without cache, S == cache length with one.
      cache: optional KVCache of length S; the T new keys/values go to
        [cache_index, cache_index + T) in every row.
      cache_index: int32 scalar (may be traced); required with a cache.
    """
    cfg = self.cfg
    if cache is not None and cache_index is None:
      raise ValueError("Decoder: a cache was given without cache_index (where to write the new "
                       "keys/values).")
    x_btd = jnp.take(self.embed[...], tokens_bt, axis=0).astype(cfg.compute_dtype)
    cos_btk, sin_btk = rope_angles(positions_bt, cfg.head_dim, cfg.rope_theta)
    mask_bts = attn_mask_bts.astype(bool)
    layer_params = self.layers.stacked()

    remat = jax.checkpoint if cfg.remat else (lambda f: f)
    if cache is None:
      @remat
      def step(x, p):
        x, _ = _block(cfg, p, x, cos_btk, sin_btk, mask_bts)
        return x, None
      x_btd, _ = jax.lax.scan(step, x_btd, layer_params)
      new_cache = None
    else:
      index = jnp.asarray(cache_index, jnp.int32)

      # The whole cache is a carry of the layer loop and each layer writes only its new
      # positions into it. (Scanning over the cache as xs/ys made XLA build a fresh
      # [L, B, S, Hkv, Dh] output and copy it, about four full passes over the cache per
      # decode step.)
      @remat
      def step(carry, xs):
        x, k_lbshd, v_lbshd = carry
        p, layer = xs
        x, (k_lbshd, v_lbshd) = _block(cfg, p, x, cos_btk, sin_btk, mask_bts,
                                       (k_lbshd, v_lbshd), layer, index)
        return (x, k_lbshd, v_lbshd), None
      layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
      (x_btd, k, v), _ = jax.lax.scan(step, (x_btd, cache.k, cache.v), (layer_params, layers))
      new_cache = KVCache(k=k, v=v)
    return rms_norm(x_btd, self.final_norm[...], cfg.rms_eps), new_cache

  def logits(self, hidden_btd) -> jax.Array:
    """f32[B, T, V] next-token logits from final-normed hidden states (tied or untied)."""
    dt = self.cfg.compute_dtype
    out_vd = self.embed if self.cfg.tie_embeddings else self.lm_head
    return jnp.einsum("btd,vd->btv", hidden_btd.astype(dt), out_vd[...].astype(dt),
                      preferred_element_type=jnp.float32)

  def __call__(self, tokens_bt, positions_bt, attn_mask_bts, cache: KVCache | None = None,
               cache_index=None):
    """(logits f32[B, T, V], updated cache or None); arguments as in `hidden`."""
    hidden_btd, cache = self.hidden(tokens_bt, positions_bt, attn_mask_bts, cache, cache_index)
    return self.logits(hidden_btd), cache
