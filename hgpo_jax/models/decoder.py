"""The decoder-only transformer of the Llama / Qwen2 / Qwen3 family in Flax NNX, with a KV
cache.

Block (pre-norm, as in Llama, Qwen2 and Qwen3):
  h = x + Wo · Attn(RoPE(N_q(Wq·RMSNorm(x) [+bq])), RoPE(N_k(Wk·RMSNorm(x) [+bk])),
                    Wv·RMSNorm(x) [+bv])
  y = h + Wdown · (silu(Wgate·RMSNorm(h)) ⊙ Wup·RMSNorm(h))
Grouped-query attention: query head h reads key/value head h // (H / Hkv), as in
Hugging Face `repeat_kv`. Qwen2 adds the q/k/v biases; Qwen3 the per-head RMSNorms N_q,
N_k over head_dim (identity elsewhere). RoPE and its scalings live in
`hgpo_jax.models.rope`. Layer parameters are stacked on a leading "layers" axis and the
blocks run under `lax.scan`, so a 30-layer model compiles one block.

Every parameter is an `nnx.Param` carrying `logical_axes` metadata (names such as
"embed", "heads", "mlp", "vocab"); `hgpo_jax.models.sharding` maps them to mesh axes.
Softmax, RMSNorm statistics, RoPE and logits are computed in float32 whatever `cfg.dtype`.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hgpo_jax.models import attention
from hgpo_jax.models import axes
from hgpo_jax.models import lora
from hgpo_jax.models import platform
from hgpo_jax.models import rope
from hgpo_jax.models import decode_kernels  # noqa: F401  (registers the pallas_* decode kernels)
from hgpo_jax.models import kv_cache
from hgpo_jax.models.config import ModelConfig
from hgpo_jax.models.kv_cache import (KVCache, cache_shape, init_cache, scatter_rows,  # noqa: F401
                                      write_rows)
from hgpo_jax.models.primitives import project, rms_norm


class Mode(enum.Enum):
  """What a `Decoder` call does with a KV cache."""
  FORWARD = "forward"  # no cache: training, log-probs, critic
  PREFILL = "prefill"  # write the T new keys/values into an empty cache (not read)
  DECODE = "decode"  # read the filled cache, write the new keys/values after it


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
  down [L, D, F]; q_norm, k_norm [L, Dh] (only with cfg.qk_norm). Projections keep the
  checkpoints' [out, in] order, so loading needs no transposes; `_project` applies them as
  x @ Wᵀ.
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
    if cfg.qk_norm:
      self.q_norm = _param(rngs, (n, dh), None, dt, ("layers", "head_dim"))
      self.k_norm = _param(rngs, (n, dh), None, dt, ("layers", "head_dim"))
    self.mlp_norm = _param(rngs, (n, d), None, dt, ("layers", "norm"))
    self.gate = _param(rngs, (n, f, d), d ** -0.5, dt, ("layers", "mlp", "embed"))
    self.up = _param(rngs, (n, f, d), d ** -0.5, dt, ("layers", "mlp", "embed"))
    self.down = _param(rngs, (n, d, f), f ** -0.5, dt, ("layers", "embed", "mlp"))
    for name in cfg.lora.names:  # LoRA adapters beside their base weight (`models.lora`)
      a, b = lora.adapter_params(getattr(self, name), name, cfg.lora.rank, rngs.params(),
                                 cfg.lora.first_layer(n))
      setattr(self, f"{name}_lora_a", a)
      setattr(self, f"{name}_lora_b", b)
    # the parameters this config made, by name (biases only with cfg.qkv_bias, q/k norms
    # only with cfg.qk_norm, adapters only with cfg.lora)
    self.names = ("attn_norm", "q", "k", "v", "o", "mlp_norm", "gate", "up", "down",
                  *(("q_bias", "k_bias", "v_bias") if cfg.qkv_bias else ()),
                  *(("q_norm", "k_norm") if cfg.qk_norm else ()),
                  *(f"{n}{s}" for n in cfg.lora.names for s in lora.SUFFIXES))

  def stacked(self) -> dict[str, jax.Array]:
    """name -> stacked array [L, ...] of every parameter (the `xs` of the layer scan)."""
    return {name: getattr(self, name)[...] for name in self.names}

  def unstacked(self) -> None:
    """None: the layers are stacked (`DecodeWeights.unstacked` holds them per layer)."""
    return None


class DecodeWeights(nnx.Module):
  """The layer weights a generate call's decode loop reads, built once per call by
  `Decoder.for_decoding` in place of its `DecoderLayers`: the projections (and biases)
  cast to the compute dtype; on GPU and TPU targets (`per_layer_decode_weights`) each
  layer's gate and up as one gate_up [2, F, D] (when F is whole on each device), its q, k
  and v (and their biases) as one qkv [H + 2 Hkv, Dh, D] (when the heads are), and every
  layer's weights as arrays of their own (`unstacked`). The names are those given:
  `stacked()` returns exactly them (a `DecoderLayers` holds the unfused ones).

  Args:
    weights: name -> stacked array [L, ...] (the `_block` names: fused or not).
    per_layer: keep each layer's weights as arrays of their own.
  """

  def __init__(self, weights: dict[str, jax.Array], per_layer: bool):
    n = next(iter(weights.values())).shape[0]
    if per_layer:
      self.layers = nnx.List([nnx.Dict({k: nnx.Param(w[i]) for k, w in weights.items()})
                              for i in range(n)])
    else:
      self.layers = nnx.List([nnx.Dict({k: nnx.Param(w) for k, w in weights.items()})])
    self.per_layer = per_layer

  def stacked(self) -> dict[str, jax.Array]:
    """name -> stacked array [L, ...] (the `xs` of the layer scan). Per-layer weights are
    stacked again here: a copy, which a prefill's layer scan pays once per call."""
    per_layer = self.unstacked()
    if per_layer is not None:
      return {n: jnp.stack([p[n] for p in per_layer]) for n in per_layer[0]}
    return {n: w[...] for n, w in self.layers[0].items()}

  def unstacked(self) -> list[dict[str, jax.Array]] | None:
    """Each layer's weights as their own arrays (GPU and TPU targets), else None."""
    if not self.per_layer:
      return None
    return [{n: w[...] for n, w in layer.items()} for layer in self.layers]


def _adapted(cfg: ModelConfig, p: dict, name: str, x_bti, w_oi=None):
  """`project` of x by the layer weight `name` (or `w_oi`, its 2-D view), plus its LoRA
  adapters' s · (x A) B when the layer holds them (`models.lora`; PEFT's order: the
  low-rank product, then the scale), in x's dtype."""
  out = project(x_bti, p[name] if w_oi is None else w_oi)
  if f"{name}_lora_a" not in p:
    return out
  a, b = p[f"{name}_lora_a"], p[f"{name}_lora_b"]
  r = a.shape[-1]
  low_btr = project(x_bti, a.reshape(-1, r).T)
  delta = project(low_btr, b.reshape(r, -1).T) * jnp.asarray(cfg.lora.scale, low_btr.dtype)
  return out + delta.reshape(out.shape)


def _block(cfg: ModelConfig, impl: str, p: dict, x_btd, cos_btk, sin_btk, segment_ids_bt,
           cached=None, cache_index=None, cache_start_b=None, decode_impl: str = "xla",
           layer=None, seq: "SequenceParallel | None" = None, rope_by_product: bool = False):
  """One decoder block. p holds one layer's parameters (no leading L axis).

  Without a cache the block attends over its own T keys (`attention.attention` with
  `impl`, segment ids [B, T]). With one, `cached` = (k, v) of this layer, [B, Hkv, S, Dh],
  read only: the T new positions attend over the cache slots [cache_start_b, cache_index)
  of their row and over their own new keys (`attention.decode_attention`; with `layer`,
  `cached` holds all layers' caches [L, B, Hkv, S, Dh] and the block reads that one). The caller
  writes the new keys/values into the cache afterwards (see `Decoder.decode_hidden`).
  With `seq` (`sequence_parallel`) the residual stream, its norms and its adds are split
  over the sequence between the products (the same sums); `rope_by_product`:
  `rope.apply_rope`'s rotate_by_product.
  Returns (x_btd, (k, v) of the new positions, each [B, Hkv, T, Dh]).
  """
  dt = cfg.compute_dtype
  b, t, _ = x_btd.shape
  w = lambda name: p[name].astype(dt)
  seq = SequenceParallel.OFF if seq is None else seq
  x_btd = seq.stream(x_btd)
  h_btd = seq.whole(rms_norm(x_btd, p["attn_norm"], cfg.rms_eps))
  if "qkv" in p:  # one product with the three weights (`Decoder.for_decoding` on GPUs)
    qkv_bthk = project(h_btd, p["qkv"])
    if cfg.qkv_bias:
      qkv_bthk = qkv_bthk + w("qkv_bias")
    q_bthk, k_bthk, v_bthk = jnp.split(
        qkv_bthk, (cfg.num_heads, cfg.num_heads + cfg.num_kv_heads), axis=2)
  else:
    q_bthk = _adapted(cfg, p, "q", h_btd)
    k_bthk = _adapted(cfg, p, "k", h_btd)
    v_bthk = _adapted(cfg, p, "v", h_btd)
    if cfg.qkv_bias:
      q_bthk, k_bthk, v_bthk = q_bthk + w("q_bias"), k_bthk + w("k_bias"), v_bthk + w("v_bias")
  if cfg.qk_norm:  # Qwen3: each head normed over head_dim before RoPE
    q_bthk = rms_norm(q_bthk, p["q_norm"], cfg.rms_eps)
    k_bthk = rms_norm(k_bthk, p["k_norm"], cfg.rms_eps)
  q_bthk = rope.apply_rope(q_bthk, cos_btk, sin_btk, cfg.rope_layout, rope_by_product)
  k_bthk = rope.apply_rope(k_bthk, cos_btk, sin_btk, cfg.rope_layout, rope_by_product)
  scale = cfg.head_dim ** -0.5
  if cached is None:
    attn_bthk = attention.attention(q_bthk, k_bthk, v_bthk, segment_ids_bt, causal=True,
                                    impl=impl, scale=scale, query_chunk=cfg.attn_query_chunk)
  else:
    attn_bthk = attention.decode_attention(q_bthk, k_bthk, v_bthk, segment_ids_bt, *cached,
                                           cache_start_b=cache_start_b,
                                           cache_index=cache_index, scale=scale,
                                           impl=decode_impl, layer=layer)
  x_btd = seq.stream(x_btd + seq.stream(
      _adapted(cfg, p, "o", attn_bthk.reshape(b, t, -1), p["o"].reshape(cfg.hidden_dim, -1))))
  h_btd = seq.whole(rms_norm(x_btd, p["mlp_norm"], cfg.rms_eps))
  if "gate_up" in p:  # one product with both weights (`Decoder.for_decoding`)
    # [2, F, D] as [2F, D]: the gate and the up halves of the last axis. Taken as [..., 2, F]
    # and indexed on its size-2 axis, each bf16 half was a [..., 1, F] slice that XLA:TPU
    # tiled (2, 128): 101M cycles per prefill layer of the 1.5B on a v6e (docs/performance.md,
    # "The papers' precision by default on accelerators").
    both_bt2f = project(h_btd, p["gate_up"].reshape(-1, p["gate_up"].shape[-1]))
    f = both_bt2f.shape[-1] // 2
    gated_btf = jax.nn.silu(both_bt2f[..., :f]) * both_bt2f[..., f:]
  else:
    gated_btf = jax.nn.silu(_adapted(cfg, p, "gate", h_btd)) * _adapted(cfg, p, "up", h_btd)
  x_btd = seq.stream(x_btd + seq.stream(_adapted(cfg, p, "down", seq.inner(gated_btf))))
  return x_btd, (k_bthk.transpose(0, 2, 1, 3), v_bthk.transpose(0, 2, 1, 3))


def _unrolled(step, x, stacked: dict):
  """`jax.lax.scan(step, x, stacked)` as a Python loop over the stack's layers: the same
  carry and stacked outputs. Under `jax.grad` a scan saves each layer's residuals by
  writing them into stacked arrays (on XLA:CPU a copy per residual per layer); the loop
  keeps them as buffers of their own, at the cost of one compiled block per layer."""
  ys = []
  for i in range(next(iter(stacked.values())).shape[0]):
    x, y = step(x, {n: w[i] for n, w in stacked.items()})
    ys.append(y)
  return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)


class SequenceParallel:
  """Where a full-sequence block's activations live on a tensor-parallel mesh (Megatron-LM's
  sequence parallelism, Korthikanti et al., arXiv:2205.05198, section 4.2.2): the residual
  stream, its RMSNorms and its adds split over the sequence by the "tensor" axis
  (`stream`), the normed input of a projection gathered whole (`whole`), the MLP's
  intermediate split over its features (`inner`). The all-reduce of each tensor-parallel
  product's partial sums becomes a reduce-scatter and the gather an all-gather (the same
  bytes), and every device norms and adds only its share of the positions instead of
  all of them twice. The sums are of the same partial products and a norm or an add is
  per position, but XLA may block the products over the split differently: the values
  agree with the unsplit block's to float round-off. `OFF` constrains nothing."""

  OFF: "SequenceParallel"

  def __init__(self, stream=None, whole=None, inner=None):
    self._specs = (stream, whole, inner)

  @staticmethod
  def _constrain(x, sharding):
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)

  def stream(self, x_btd):
    return self._constrain(x_btd, self._specs[0])

  def whole(self, h_btd):
    return self._constrain(h_btd, self._specs[1])

  def inner(self, x_btf):
    return self._constrain(x_btf, self._specs[2])


SequenceParallel.OFF = SequenceParallel()


def sequence_parallel(cfg: ModelConfig, target, shape_btd) -> SequenceParallel:
  """The full-sequence blocks' `SequenceParallel` for activations [B, T, D] under the
  abstract mesh in context: split over "tensor" when the target devices are accelerators,
  the mesh splits the heads and the MLP over a "tensor" axis of size > 1, and T is a
  multiple of its size; else `OFF` (CPU programs unchanged). XLA:TPU's estimate of the
  1.5B paper rollout on a v5e-8 (bf16 compute, `generate`): 149.6 -> 145.3 s, each
  prefill layer's two norms and two residual adds on half the positions; the update
  304.5 -> 274.4 s (docs/performance.md, "Sequence-parallel full-sequence blocks")."""
  mesh = jax.sharding.get_abstract_mesh()
  if (mesh.empty or platform.target_platform(target) not in ("gpu", "tpu")
      or mesh.shape.get("tensor", 1) == 1):
    return SequenceParallel.OFF
  tensor = mesh.shape["tensor"]
  heads = axes.logical_to_spec(("embed", "heads", "head_dim"), mesh,
                               shape=(cfg.hidden_dim, cfg.num_heads, cfg.head_dim))
  mlp = axes.logical_to_spec(("embed", "mlp"), mesh, shape=(cfg.hidden_dim, cfg.mlp_dim))
  if shape_btd[1] % tensor or heads[1] != "tensor" or mlp[1] != "tensor":
    return SequenceParallel.OFF
  rows = axes.logical_to_spec(("batch", "length", "embed"), mesh, shape=shape_btd)[0]
  rows = tuple(a for a in _spec_axes(rows) if a != "tensor") or None
  spec = lambda *dims: jax.sharding.NamedSharding(  # noqa: E731
      mesh, jax.sharding.PartitionSpec(rows, *dims))
  return SequenceParallel(spec("tensor", None), spec(None, None), spec(None, "tensor"))


def decode_layer_unroll(cfg: ModelConfig, target) -> int:
  """Layers one iteration of a decode step's layer loop runs: all of them when the target
  devices are accelerators (GPUs, TPUs), else 1 (a `lax.scan` over the stacked layers; CPU
  programs unchanged). The cost is compile time (the step's layers compiled one by one).
  Why, on each platform (docs/performance.md, "Decode on accelerators"):
  - GPU: with the layer index a loop variable XLA:GPU copies each layer's weight slices
    and cache slices out of the stacked arrays in every step before its matmuls read them;
    with the loop unrolled the slices are static and most are read in place (the XLA:GPU
    decode-traffic proxy of the 1.5B paper setting on an H100: 15.7 -> 9.9 GB per step).
  - TPU: a scanned layer is a loop iteration of some 34 ops, a third of them per-layer
    bookkeeping (the layer's slice of each small parameter, the new keys' and values'
    stacking, the kernel's bounds) that XLA:TPU costs at about a microsecond each; unrolled,
    the static slices fuse into their consumers and the bounds are computed once. XLA:TPU's
    estimate of the 1.5B paper step on a v5e-8: 4.71 -> 4.50 ms (`pallas_tpu`), 6.54 ->
    6.22 ms (`xla`); compile time 16 -> 49 s on a 2-core host. MaxText decodes from
    unscanned layers for the same reason (`scan_layers=false` in its decode scripts)."""
  return (cfg.num_layers if platform.target_platform(target) in ("gpu", "tpu") else 1)


def write_row_slots(cache_lbksd, new_lbktd, slots_b):
  """`cache_lbksd` with row b's new keys or values at slots [slots_b[b], slots_b[b] + T)
  of the same row: one scatter on CPU targets (`kv_cache.scatter_rows`), else a loop of row
  writes (`kv_cache.write_rows`; a write that would pass the cache's end is skipped)."""
  if platform.target_platform(attention.context_target()) == "cpu":
    return scatter_rows(cache_lbksd, new_lbktd, slots_b)
  return write_rows(cache_lbksd, new_lbktd, jnp.arange(slots_b.shape[0]), slots_b)


def per_layer_decode_weights(cfg: ModelConfig, target) -> bool:
  """Whether `Decoder.for_decoding` gives each layer's weights their own arrays, stacks
  each layer's gate and up projections into one gate_up [2, F, D] and concatenates its q,
  k and v into one qkv [H + 2 Hkv, Dh, D] (each where the mesh does not split them): on
  GPU and TPU targets, once per generate call. CPU programs are unchanged. Why:
  - GPU: a decode step's matmuls go to cuBLAS, which reads an operand only as a whole
    buffer, so XLA:GPU copies each layer's slice of a stacked [L, ...] weight before its
    matmul in every step (the unrolled loop's static slices too), and it merges gate and
    up into one matmul by copying both slices side by side: for the 1.5B model 3,086 MB
    of gate/up copies and 526 MB of q/o copies per step, read and written (the XLA:GPU
    proxy), the largest kernels of a one-row decode step on an H200 (1.17 + 0.58 of
    4.8 ms, docs/performance.md). One qkv product where XLA:GPU made two at one row:
    536 -> 508 kernels per decode step in the deviceless proxy.
  - TPU: with slices of stacked weights XLA:TPU copies some layers' q/o slices into a new
    layout in every step and its matmuls read the rest from HBM as they go; with arrays of
    their own it prefetches each layer's weights into on-chip memory (async copies and
    slices) while the layers before it compute. XLA:TPU's estimate of the 1.5B paper step
    on a v5e-8 (`pallas_tpu`): 4.48 -> 4.28 ms with float32 compute, 4.34 -> 3.51 ms with
    bfloat16 (docs/performance.md, "Per-layer decode weights on TPU")."""
  del cfg
  return platform.target_platform(target) in ("gpu", "tpu")


# Layer parameters a decode step casts to the compute dtype before use (`_block`, `_project`)
_CAST_FOR_DECODING = ("q", "k", "v", "o", "gate", "up", "down", "q_bias", "k_bias", "v_bias")


def _spec_axes(entry) -> tuple:
  """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


class Decoder(nnx.Module):
  """Llama / Qwen2 / Qwen3 decoder: embedding, L pre-norm blocks, final RMSNorm, output layer.

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

  def hidden(self, tokens_bt, positions_bt, segment_ids_bt):
    """Forward (training, log-probs, critic): final-normed hidden states [B, T, D]
    (cfg.dtype) of T tokens attending causally within their segments, and None (no cache).

    Args:
      tokens_bt: int32[B, T] token ids.
      positions_bt: int32[B, T] RoPE positions (left-padded rows start later; packed
        segments restart at 0).
      segment_ids_bt: int or bool [B, T]: the segment of each token, 0 on padding (a bool
        input mask is one segment per row; `attention` module docstring).
    Attention runs as `cfg.attention_impl` resolved against the mesh in context
    (`jax.set_mesh`, `attention.traced_on`), else this process's devices
    (`attention.resolve_impl`).
    """
    return self._hidden(Mode.FORWARD, tokens_bt, positions_bt, segment_ids_bt)

  def prefill(self, tokens_bt, positions_bt, segment_ids_bt, cache: KVCache):
    """Prefill of an empty cache: (hidden [B, T, D], `cache` with the T new keys/values
    in slots [0, T) of every row). The new positions attend to each other only (the cache
    is not read); arguments as in `hidden`."""
    return self._hidden(Mode.PREFILL, tokens_bt, positions_bt, segment_ids_bt, cache, 0)

  def decode_hidden(self, tokens_bt, positions_bt, cache: KVCache, cache_index,
                    segment_ids_bt=None):
    """Decode of T new tokens over a filled cache: (hidden [B, T, D], the cache with their
    keys/values at [cache_index, cache_index + T) of each row).

    Row b's earlier tokens are read from the slots [cache_index - positions_bt[b, 0],
    cache_index): a row holds its tokens contiguously, the first at position 0 (left
    padding before it is never read). `cache_index` is an int32 scalar (may be traced),
    or an int32[B] giving each row its own index (a slotted cache whose rows decode at
    their own offsets, `hgpo_jax.sampling.engine.slotted_decode`); a row's new
    keys/values that would pass the cache's end are not written (`kv_cache.write_rows`).
    `segment_ids_bt` defaults to one segment (all ones). The attention over the cache is
    `cfg.decode_attention_impl` (`attention.decode_attention`).
    """
    if segment_ids_bt is None:
      segment_ids_bt = jnp.ones_like(positions_bt)
    return self._hidden(Mode.DECODE, tokens_bt, positions_bt, segment_ids_bt, cache,
                        cache_index)

  def _hidden(self, mode: "Mode", tokens_bt, positions_bt, segment_ids_bt,
              cache: KVCache | None = None, cache_index=None):
    """The layer stack in `mode` (`hidden`, `prefill`, `decode_hidden`)."""
    cfg = self.cfg
    if jnp.ndim(segment_ids_bt) != 2:
      raise ValueError(f"Decoder: segment_ids_bt must be [B, T] segment ids (or an input mask), "
                       f"got shape {jnp.shape(segment_ids_bt)}; dense attention masks are gone "
                       "(hgpo_jax.models.attention).")
    impl = attention.resolve_impl(cfg.attention_impl, attention.context_target(),
                                  length=tokens_bt.shape[1])
    decode_impl = attention.resolve_decode_impl(cfg.decode_attention_impl,
                                                attention.context_target(),
                                                head_dim=cfg.head_dim)
    seg_bt = jnp.asarray(segment_ids_bt).astype(jnp.int32)
    block = functools.partial(
        _block, rope_by_product=rope.rope_rotation_by_product(attention.context_target()))
    t = tokens_bt.shape[1]
    if mode is not Mode.DECODE:
      # The length the attention kernel computes on (splash: a multiple of 128, cudnn: even),
      # reached once here rather than by a pad and a slice of q, k and v in every layer; the
      # appended positions are read by no real one and sliced off after the stack.
      seg_bt, tokens_bt, positions_bt = attention.pad_to_length(
          attention.padded_length(impl, t), seg_bt, tokens_bt, positions_bt)
    x_btd = jnp.take(self.embed[...], tokens_bt, axis=0).astype(cfg.compute_dtype)
    # The barrier keeps the angles computed once, before the layers: XLA:TPU otherwise sinks
    # their cos/sin into the layer loop and recomputes them in every layer (the values are
    # the same either way).
    cos_btk, sin_btk = jax.lax.optimization_barrier(
        rope.rope_angles(positions_bt, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    per_layer = self.layers.unstacked() if mode is Mode.DECODE else None
    layer_params = self.layers.stacked() if per_layer is None else None
    first = cfg.lora.first_layer(cfg.num_layers)
    if first and mode is Mode.DECODE and layer_params is not None:
      # Decode steps of unmerged top-layer adapters (the sampler decodes merged weights,
      # `for_decoding`): zero adapters below them, so one layer loop reads every layer.
      layer_params = {n: jnp.concatenate([jnp.zeros((first, *w.shape[1:]), w.dtype), w])
                      if lora.is_adapter(n) else w for n, w in layer_params.items()}

    remat = jax.checkpoint if cfg.remat else (lambda f: f)
    # A prefill's cache holds nothing the new positions may read: they attend to each
    # other only, and the layer loop only returns their keys/values (T x T, not T x S).
    fresh = mode is Mode.PREFILL
    if mode is not Mode.DECODE:

      # A prefill's stacked keys/values leave the layer loop already in the cache's dtype
      # (a bf16 cache under f32 compute then never holds an f32 copy of all layers).
      kv_dtype = cache.k.dtype if fresh else None

      seq = sequence_parallel(cfg, attention.context_target(), x_btd.shape)

      @remat
      def step(x, p):
        x, (k, v) = block(cfg, impl, p, x, cos_btk, sin_btk, seg_bt, seq=seq)
        return x, (k, v) if kv_dtype is None else (k.astype(kv_dtype), v.astype(kv_dtype))
      # The adapted layers (`ModelConfig.adapted_layers`): one scan, or a Python loop whose
      # backward keeps each layer's residuals as buffers of their own.
      adapted_loop = _unrolled if cfg.adapted_layers == "unrolled" else jax.lax.scan
      if first:
        # Adapters on the top layers only (`LoraConfig.top_layers`): the frozen layers below
        # run as a scan of their own, and no gradient flows back into them.
        adapters = {n for n in layer_params if lora.is_adapter(n)}
        below = {n: w[:first] for n, w in layer_params.items() if n not in adapters}
        above = {n: w if n in adapters else w[first:] for n, w in layer_params.items()}
        x_btd, (k_below, v_below) = jax.lax.scan(step, x_btd, below)
        x_btd, (k_above, v_above) = adapted_loop(step, jax.lax.stop_gradient(x_btd), above)
        k_lbkth = jnp.concatenate([k_below, k_above])
        v_lbkth = jnp.concatenate([v_below, v_above])
      else:
        loop = adapted_loop if cfg.lora.rank else jax.lax.scan
        x_btd, (k_lbkth, v_lbkth) = loop(step, x_btd, layer_params)
      x_btd, k_lbkth, v_lbkth = x_btd[:, :t], k_lbkth[:, :, :, :t], v_lbkth[:, :, :, :t]
      new_cache = None
      if fresh:
        zero = jnp.zeros((), jnp.int32)
        new_cache = KVCache(
            k=jax.lax.dynamic_update_slice(cache.k, k_lbkth.astype(cache.k.dtype), (zero,) * 5),
            v=jax.lax.dynamic_update_slice(cache.v, v_lbkth.astype(cache.v.dtype), (zero,) * 5))
    else:
      index = jnp.asarray(cache_index, jnp.int32)
      start_b = index - positions_bt[:, 0].astype(jnp.int32)
      unroll = decode_layer_unroll(cfg, attention.context_target())

      # The layer loop reads the cache (as scan inputs) and returns only the new
      # positions' keys/values; one in-place write per step follows. A loop that also
      # wrote into the cache it reads made XLA copy the whole cache in every layer
      # (measured: ~20x the attention's own time at batch 32).
      @remat
      def step(x, xs):
        p, k_bksd, v_bksd = xs
        x, (k, v) = block(cfg, impl, p, x, cos_btk, sin_btk, seg_bt, (k_bksd, v_bksd), index,
                          start_b, decode_impl)
        return x, (k.astype(cache.k.dtype), v.astype(cache.v.dtype))
      stacked_impl = decode_impl in attention.STACKED_DECODE_IMPLEMENTATIONS
      if kv_cache.is_layered(cache):
        # One array per layer of the cache (`kv_cache.layered`) over per-layer weights: each
        # layer reads its own arrays in place and writes its new slot into them.
        if per_layer is None:
          raise ValueError("Decoder.decode_hidden: a per-layer cache (kv_cache.layered) needs "
                           "per-layer decode weights (for_decoding).")
        zero = jnp.zeros((), jnp.int32)
        if index.ndim == 0:
          put = lambda full, new: jax.lax.dynamic_update_slice(  # noqa: E731
              full, new.astype(full.dtype), (zero, zero, index, zero))
        else:  # row b's T new slots [index[b], index[b] + T) (jump-forward decoding)
          put = lambda full, new: write_row_slots(full[None], new[None], index)[0]  # noqa: E731
        new_k, new_v = [], []
        for i, p in enumerate(per_layer):
          x_btd, (k, v) = block(cfg, impl, p, x_btd, cos_btk, sin_btk, seg_bt,
                                (cache.k[i], cache.v[i]), index, start_b, decode_impl)
          new_k.append(put(cache.k[i], k))
          new_v.append(put(cache.v[i], v))
        return (rms_norm(x_btd, self.final_norm[...], cfg.rms_eps),
                KVCache(k=tuple(new_k), v=tuple(new_v)))
      if per_layer is not None:
        # Each layer's weights are arrays of their own (`for_decoding` on accelerators): a
        # Python loop over them, the unrolled scan below without slicing stacked weights.
        news = []
        for i, p in enumerate(per_layer):
          cached = (cache.k, cache.v) if stacked_impl else (cache.k[i], cache.v[i])
          x_btd, (k, v) = block(cfg, impl, p, x_btd, cos_btk, sin_btk, seg_bt, cached, index,
                                start_b, decode_impl,
                                layer=jnp.int32(i) if stacked_impl else None)
          news.append((k.astype(cache.k.dtype), v.astype(cache.v.dtype)))
        k_lbkth = jnp.stack([k for k, _ in news])
        v_lbkth = jnp.stack([v for _, v in news])
      elif stacked_impl:
        # These kernels read layer l of the whole cache in place (a slice as a scan input
        # would be copied before the kernel's custom call, in every layer and step).
        @remat
        def stacked_step(x, xs):
          p, layer = xs
          x, (k, v) = block(cfg, impl, p, x, cos_btk, sin_btk, seg_bt, (cache.k, cache.v),
                            index, start_b, decode_impl, layer=layer)
          return x, (k.astype(cache.k.dtype), v.astype(cache.v.dtype))
        layers = jnp.arange(cache.k.shape[0], dtype=jnp.int32)
        x_btd, (k_lbkth, v_lbkth) = jax.lax.scan(stacked_step, x_btd, (layer_params, layers),
                                                 unroll=unroll)
      else:
        x_btd, (k_lbkth, v_lbkth) = jax.lax.scan(step, x_btd, (layer_params, cache.k, cache.v),
                                                 unroll=unroll)
      if index.ndim == 0:
        zero = jnp.zeros((), jnp.int32)
        start = (zero, zero, zero, index, zero)
        k = jax.lax.dynamic_update_slice(cache.k, k_lbkth.astype(cache.k.dtype), start)
        v = jax.lax.dynamic_update_slice(cache.v, v_lbkth.astype(cache.v.dtype), start)
      else:  # row b's T new slots [index[b], index[b] + T)
        k, v = (write_row_slots(full, new, index) for full, new in
                ((cache.k, k_lbkth), (cache.v, v_lbkth)))
      new_cache = KVCache(k=k, v=v)
    return rms_norm(x_btd, self.final_norm[...], cfg.rms_eps), new_cache

  def logits(self, hidden_btd) -> jax.Array:
    """f32[B, T, V] next-token logits from final-normed hidden states (tied or untied)."""
    dt = self.cfg.compute_dtype
    out_vd = self.embed if self.cfg.tie_embeddings else self.lm_head
    return jnp.einsum("btd,vd->btv", hidden_btd.astype(dt), out_vd[...].astype(dt),
                      preferred_element_type=jnp.float32)

  def decode_logits(self, hidden_btd) -> jax.Array:
    """`logits` of a decode step (few rows x few tokens) on the mesh in context, computed
    where the output layer lies: when its D axis is split over a mesh axis that also splits
    the rows (fsdp), the rows' hidden states are gathered and split over D instead, each
    device multiplies its [V, D] shard, and the partial logits are summed back onto the
    rows' devices. Left to itself XLA gathers the [V, D] shard over that axis in every step
    (the tied 1.5B embedding: 350 MB per chip per step on a v5e-8, docs/performance.md),
    where the hidden states are kilobytes. Without a mesh, or an output layer whose D is
    not split: `logits`. The sums over D halves differ from one sum only in float
    round-off."""
    mesh = jax.sharding.get_abstract_mesh()
    out_vd = self.embed if self.cfg.tie_embeddings else self.lm_head
    if mesh.empty:
      return self.logits(hidden_btd)
    w_spec = axes.logical_to_spec(("vocab", "embed"), mesh, shape=out_vd.shape)
    d_axes = _spec_axes(w_spec[1])
    if int(np.prod([mesh.shape[a] for a in d_axes])) == 1:
      return self.logits(hidden_btd)
    out_spec = axes.logical_to_spec(("batch", "length", "vocab"), mesh,
                                    shape=hidden_btd.shape[:2] + (out_vd.shape[0],))
    rows = tuple(a for a in _spec_axes(out_spec[0]) if a not in d_axes)
    hidden_btd = jax.lax.with_sharding_constraint(
        hidden_btd, jax.sharding.NamedSharding(
            mesh, jax.sharding.PartitionSpec(rows or None, None, w_spec[1])))
    return jax.lax.with_sharding_constraint(
        self.logits(hidden_btd), jax.sharding.NamedSharding(mesh, out_spec))

  def for_decoding(self, per_layer: bool | None = None) -> "Decoder":
    """This decoder with the weights its products read cast to the compute dtype, for a
    decode loop: cast once per call before the loop, where each step would convert them
    again (XLA:GPU converts each layer's slice inside the loop, in every step; XLA:TPU
    hoists the layers' casts but not the output layer's). Cast: the output layer (the
    embedding; lm_head when untied) and the layers' projections and biases, each of which
    every step casts to the compute dtype anyway, so the values, and the samples, are
    unchanged; the norms' scales (read in float32) keep theirs. Only a narrowing cast
    (float32 parameters under bfloat16 compute). On GPU and TPU targets
    (`per_layer_decode_weights`) each layer's gate and up weights become one gate_up
    [2, F, D] that the decode step multiplies once (`_block`; when F is not split over the
    mesh), its q, k and v (and their biases) one qkv [H + 2 Hkv, Dh, D] (when the heads are
    not split), and every layer's weights become arrays of their own, which the decode
    step's unrolled layer loop reads in place. The layers' weights are one `DecodeWeights`
    built here, in place of the `DecoderLayers`. Itself when there is nothing to do (and
    for a view it made). With LoRA adapters: those of `merged` (the adapters merged into
    the weights once per call). `per_layer=True` gives every layer's weights arrays of
    their own on any platform (`Sampler(decode_layers="per_layer")`), fused as above only
    on GPU and TPU targets; None: by the platform, as above."""
    if self.cfg.lora.rank:
      return self.merged().for_decoding(per_layer)
    if isinstance(self.layers, DecodeWeights):
      return self
    dt = jnp.dtype(self.cfg.compute_dtype)
    narrows = lambda x: x.dtype != dt and dt.itemsize < x.dtype.itemsize  # noqa: E731
    top = [n for n in (("embed",) if self.cfg.tie_embeddings else ("embed", "lm_head"))
           if narrows(getattr(self, n)[...])]
    weights = self.layers.stacked()
    layer = [n for n, w in weights.items() if n in _CAST_FOR_DECODING and narrows(w)]
    fuse = per_layer is None or platform.target_platform(attention.context_target()) in (
        "gpu", "tpu")
    if per_layer is None:
      per_layer = per_layer_decode_weights(self.cfg, attention.context_target())
    if not top and not layer and not per_layer:
      return self
    graphdef, state = nnx.split(self)
    for n in top:
      state[n] = state[n].replace(state[n][...].astype(dt))
    view = nnx.merge(graphdef, state)
    weights = {n: w.astype(dt) if n in layer else w for n, w in weights.items()}
    if per_layer and fuse:
      if self._f_unsplit():
        weights["gate_up"] = jnp.stack([weights.pop("gate"), weights.pop("up")], axis=1)
      if self._heads_unsplit():
        parts = [("q", "k", "v")] + ([("q_bias", "k_bias", "v_bias")] if self.cfg.qkv_bias
                                     else [])
        for names, fused in zip(parts, ("qkv", "qkv_bias")):
          weights[fused] = jnp.concatenate([weights.pop(n) for n in names], axis=1)
    view.layers = DecodeWeights(weights, per_layer)
    return view

  def merged(self) -> "Decoder":
    """This decoder without its LoRA adapters, each adapted weight W + s · (A B)ᵀ in the
    compute dtype (`lora.merged_weight`): the forward of the adapted decoder to float
    round-off, with no adapter products. Itself without adapters."""
    if not self.cfg.lora.rank:
      return self
    params = lora.merge_into_base(nnx.to_pure_dict(nnx.state(self, nnx.Param)), self.cfg.lora,
                                  self.cfg.compute_dtype)
    return nnx.merge(base_graphdef(self.cfg), params)

  def _f_unsplit(self) -> bool:
    """Whether the layers' F axis is whole on each device of the mesh in context (a stacked
    [2, F, D] gate_up split over F would need a gate and an up shard side by side on each
    device: not done)."""
    return self._whole_on_each_device("gate", ("layers", "mlp", "embed"))

  def _heads_unsplit(self) -> bool:
    """Whether the layers' query and kv head axes are whole on each device of the mesh in
    context (a [H + 2 Hkv, Dh, D] qkv concatenated over split head axes would need each
    device's query, key and value heads side by side: not done)."""
    return (self._whole_on_each_device("q", ("layers", "heads", "head_dim", "embed"))
            and self._whole_on_each_device("k", ("layers", "kv_heads", "head_dim", "embed")))

  def _whole_on_each_device(self, name: str, logical_axes: tuple) -> bool:
    """Whether axis 1 of the stacked layer weight `name` (logical axes `logical_axes`) is
    split over no mesh axis of the mesh in context (True without a mesh)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
      return True
    spec = axes.logical_to_spec(logical_axes, mesh,
                                shape=getattr(self.layers, name)[...].shape)
    return int(np.prod([mesh.shape[a] for a in _spec_axes(spec[1])])) == 1

  def __call__(self, tokens_bt, positions_bt, segment_ids_bt):
    """Forward: (logits f32[B, T, V], None); arguments as in `hidden`."""
    hidden_btd, _ = self.hidden(tokens_bt, positions_bt, segment_ids_bt)
    return self.logits(hidden_btd), None

  def decode(self, tokens_bt, positions_bt, cache: KVCache, cache_index, segment_ids_bt=None):
    """Decode: (logits f32[B, T, V], updated cache); arguments as in `decode_hidden`."""
    hidden_btd, cache = self.decode_hidden(tokens_bt, positions_bt, cache, cache_index,
                                           segment_ids_bt)
    return self.decode_logits(hidden_btd), cache


def base_graphdef(cfg: ModelConfig):
  """The graph definition (of its `nnx.Param`s) of the decoder of `cfg` without adapters:
  what a LoRA decoder's base params, or its merged params, are merged with."""
  base_cfg = cfg.replace(lora=lora.LoraConfig())
  abstract = nnx.eval_shape(lambda: Decoder(base_cfg, rngs=nnx.Rngs(0)))
  return nnx.split(abstract, nnx.Param)[0]
