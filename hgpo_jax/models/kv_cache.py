"""The KV cache of the decoder: its type, shape, allocation and shardings."""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from hgpo_jax.models import axes
from hgpo_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Per-layer keys and values of the tokens seen so far.

  Attributes:
    k: keys after RoPE, [L, B, Hkv, S, Dh] in the cache's dtype (`init_cache`).
    v: values, [L, B, Hkv, S, Dh] in the cache's dtype.
  Positions are the second-to-last axis, so a layer's keys are [B, Hkv, S, Dh] with
  (batch, kv head) leading: both attention products read them as batched matmuls
  without a transposed copy of the cache.
  """
  k: jax.Array
  v: jax.Array


def cache_shape(cfg: ModelConfig, batch: int, length: int) -> tuple[int, ...]:
  """Shape of KVCache.k and .v: [L, B, Hkv, S, Dh]."""
  return (cfg.num_layers, batch, cfg.num_kv_heads, length, cfg.head_dim)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None) -> KVCache:
  """An all-zero cache for `batch` rows of `length` positions, in `dtype` (default: the
  compute dtype). Keys and values are cast to it when written and back to the compute
  dtype when read (`Decoder.decode_hidden`, `attention.decode_attention`)."""
  shape = cache_shape(cfg, batch, length)
  dtype = cfg.compute_dtype if dtype is None else dtype
  return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def cache_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch: int, length: int,
                    rules=axes.DEFAULT_RULES) -> KVCache:
  """KVCache of NamedShardings for a cache of `batch` rows and `length` positions."""
  shape = cache_shape(cfg, batch, length)
  sharding = NamedSharding(mesh, axes.logical_to_spec(axes.CACHE_AXES, mesh, rules, shape))
  return KVCache(k=sharding, v=sharding)
