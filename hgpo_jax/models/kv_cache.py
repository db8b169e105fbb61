"""The KV cache of the decoder: its type, shape, allocation, shardings and row writes."""

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


def write_rows(cache_lbksd, new_lbktd, rows_b, slots_b, valid_b=None):
  """`cache_lbksd` [L, R, Hkv, S, Dh] with new_lbktd[:, i] [L, Hkv, T, Dh] written at row
  rows_b[i], slots [slots_b[i], slots_b[i] + T), for each i with valid_b[i] (all when None);
  a write that would pass the cache's end is skipped (never clamped onto a row's past).

  One in-place dynamic-update-slice per i, in a loop: XLA:TPU turned the equivalent
  scatter (row and slot indices on two dims) into copies of the whole cache.
  """
  t = new_lbktd.shape[3]
  fits_b = slots_b + t <= cache_lbksd.shape[3]
  keep_b = fits_b if valid_b is None else fits_b & valid_b
  rows_b = jnp.clip(rows_b, 0, cache_lbksd.shape[1] - 1)
  slots_b = jnp.clip(slots_b, 0, cache_lbksd.shape[3] - t)
  new_lbktd = new_lbktd.astype(cache_lbksd.dtype)

  def one(i, cache):
    start = (0, rows_b[i], 0, slots_b[i], 0)
    size = (cache.shape[0], 1, cache.shape[2], t, cache.shape[4])
    new = jax.lax.dynamic_slice_in_dim(new_lbktd, i, 1, axis=1)
    old = jax.lax.dynamic_slice(cache, start, size)
    return jax.lax.dynamic_update_slice(cache, jnp.where(keep_b[i], new, old), start)

  return jax.lax.fori_loop(0, new_lbktd.shape[1], one, cache_lbksd)


def scatter_rows(cache_lbksd, new_lbktd, slots_b):
  """`cache_lbksd` [L, B, Hkv, S, Dh] with row b's new_lbktd[:, b] [L, Hkv, T, Dh] at
  slots [slots_b[b], slots_b[b] + T) of the same row, as one scatter; slots past the
  cache's end are dropped. On XLA:CPU `write_rows`' loop of row writes copies the whole
  cache in every iteration (0.21 s per write of a SmolLM2-135M cache of 16 rows x 416
  slots against 0.035 s for the scatter, 2-core Xeon); XLA:TPU turned the scatter into
  copies instead (`write_rows`), so the decoder picks by the target's platform."""
  t = new_lbktd.shape[3]
  rows_b = jnp.arange(cache_lbksd.shape[1])
  slots_bt = slots_b[:, None] + jnp.arange(t)[None, :]
  values_btlkd = new_lbktd.astype(cache_lbksd.dtype).transpose(1, 3, 0, 2, 4)
  return cache_lbksd.at[:, rows_b[:, None], :, slots_bt, :].set(values_btlkd, mode="drop")


def layered(cache: KVCache) -> KVCache:
  """`cache` with each layer's keys and values an array of its own, [B, Hkv, S, Dh] (a
  tuple of L per field): the cache a lockstep decode loop carries on CPUs with per-layer
  decode weights (`Sampler(decode_layers="per_layer")`; `Decoder.decode_hidden` reads and
  writes it). XLA:CPU copies a layer's slice of a stacked [L, ...] cache out before the
  attention products read it, in every layer of every decode step; an array of its own is
  read in place."""
  return KVCache(k=tuple(cache.k[i] for i in range(cache.k.shape[0])),
                 v=tuple(cache.v[i] for i in range(cache.v.shape[0])))


def is_layered(cache: KVCache) -> bool:
  """Whether `cache` is in the per-layer form of `layered`."""
  return isinstance(cache.k, tuple)
