"""Memory traffic of one decode step of the sampler's compiled program, against what it needs.

A decode step of a small model at a large batch is bound by memory bandwidth: it must read
every weight once and every row's valid keys and values once; nothing else is necessary
(docs/performance.md, "Decode on accelerators"). `step_cost` reads a compiled generate
program (any backend: XLA:TPU for a topology, XLA:CPU, XLA:GPU) and returns, per device:

* `traffic`: the bytes one iteration of its decode loop reads and writes, from the HLO
  (`hlo.hlo_memory_traffic` via `hlo.loop_iteration`: loops inside the step, the
  decoder's layer loop included, weighted by their trip counts; XLA's own
  `cost_analysis()` counts the layer loop's body once);
* `cycles`: XLA:TPU's cost-model cycles of that iteration (0 on other backends);

and `necessary_bytes` the step's floor for the sampler's mesh, per device:

* weights: each parameter's shard as laid out on the device, once, in the dtype its
  matmuls read: the compute dtype where it is narrower than the parameter's (the sampler
  casts them once per call, `Decoder.for_decoding`; the norms' small scales are counted
  so too), else the parameter's, except float32 on TPU, which XLA:TPU's default precision
  multiplies in one bfloat16 pass (the compiled decode loop carries bf16 copies of the
  layers' weights, converted once per call). A weight split over fsdp needs no gathered
  copy in device memory: the v5e-8 program gathers each layer's slices into on-chip
  memory, and gathering the (small) activations instead is always possible, so a
  gathered copy written to device memory per step (the tied embedding's, until
  `Decoder.decode_logits` gathered the rows instead) is
  traffic above this floor;
* KV: the device's share of the cache (its rows, its kv heads), keys and values, at the
  mean valid length of a decode step: a row of prompt l reads l + j + 1 slots at step j
  (its own new key included), so l + (N + 1) / 2 on average over N steps, with l the
  mean prompt length given (the plan's default: 3/4 of the prompt bucket, the mean of
  the accelerator benchmark's prompt lengths, uniform in [P/2, P]).

A decode attention kernel (`models/decode_kernels.py`) is a custom call that takes all
layers' caches [L, B, Hkv, S, Dh] as operands and reads, of each, one layer's valid slots
of each row. Booked in full, its operands would count the whole cache once per layer (the
pallas_tpu plan of the paper setting read 26x its necessary bytes that way).
`kernel_reads(valid_slots)` credits it with what it reads instead, as each kernel declares
it in `decode_kernels.CACHE_READS_BLOCK` (by the name of its `pallas_call`, which the
custom call's op_name ends with): one layer's share of each cache operand at the rows' mean
valid length, rounded to the blocks the kernel copies whole, block - 1 slots more per row
on average ((block - 1) / 2 at each end of its valid range): exactly for
`decode_attention_gpu` (block 1: masked loads in its boundary blocks), in blocks of
`tpu_block(S)` slots for `decode_attention_tpu`. `StepCost.kernel_bytes` keeps those
credited bytes apart, because XLA:TPU's cost model leaves a custom call's time out of its
cycles: the plan adds them at the chip's datasheet bandwidth.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np

from hgpo_jax.cost import hlo
from hgpo_jax.models import sharding as sharding_lib


@dataclasses.dataclass(frozen=True)
class StepCost:
  """One decode step of a compiled generate program, per device."""
  traffic: float  # bytes the HLO reads and writes in one decode-loop iteration
  cycles: float  # XLA:TPU's cost-model cycles of that iteration (0 elsewhere)
  kernel_bytes: float = 0.0  # of `traffic`: the decode attention kernels' credited reads
  launches: float = 0.0  # device ops of one decode step (`hlo.hlo_launches`; GPU: kernels)


@dataclasses.dataclass(frozen=True)
class Necessary:
  """The bytes one decode step must move, per device (module doc)."""
  weights: float
  kv: float
  valid_slots: float = 0.0  # a row's mean valid cache slots over the decode steps
  cache: float = 0.0  # the KV cache of the call's rows as allocated (every slot), per device

  @property
  def total(self) -> float:
    return self.weights + self.kv


# The `pallas_call` name of a Pallas kernel's custom call: the last scope of its op_name.
_PALLAS_NAME = re.compile(r'op_name="[^"]*?(\w+)/pallas_call"')


def kernel_reads(valid_slots: float):
  """A `hlo.hlo_memory_traffic` `custom_reads` rule: the bytes a decode attention kernel
  reads of each operand when a row holds `valid_slots` valid slots on average, as the
  kernel declares them (`decode_kernels.CACHE_READS_BLOCK`, by `pallas_call` name; module
  doc); None for any other custom call (booked in full)."""
  from hgpo_jax.models import decode_kernels

  def reads(rest: str, operand_shapes: list[str]):
    kernel = _PALLAS_NAME.search(rest)
    block = decode_kernels.CACHE_READS_BLOCK.get(kernel.group(1)) if kernel else None
    if block is None:
      return None
    out = []
    for shape in operand_shapes:
      full = hlo.array_bytes(shape)
      dims = hlo.array_dims(shape)
      if dims is None or len(dims) != 5:  # queries, bounds, layer index: read whole
        out.append(full)
        continue
      layers, length = dims[0], dims[3]  # all layers' cache [L, B, Hkv, S, Dh]
      slots = valid_slots + block(length) - 1
      out.append(full / layers * min(1.0, slots / length))
    return out

  return reads


def step_cost(hlo_text: str, unknown_trip_count, steps_per_iteration: int = 1,
              valid_slots: float | None = None) -> StepCost:
  """Traffic, XLA:TPU cycles and device ops of one decode step: one iteration of the
  program's decode loop (its outermost loop without a fixed trip count; `unknown_trip_count`
  as the registry's `Program.unknown_trip_count`, whose inner weights are kept) divided by the
  decode steps that iteration runs (`Program.steps_per_iteration`: a lockstep decode in
  chunks of K steps, the GPU default, runs K per iteration). With `valid_slots` (a row's
  mean valid slots, `Necessary.valid_slots`) the decode attention kernels are credited
  with the valid blocks they read (`kernel_reads`), else their operands count in full."""
  k = max(1, int(steps_per_iteration))
  rule = kernel_reads(valid_slots) if valid_slots is not None else None

  def traffic(custom_reads):
    return hlo.loop_iteration(
        lambda text, weights: hlo.hlo_memory_traffic(text, weights, custom_reads),
        hlo_text, unknown_trip_count) / k

  total = traffic(rule)
  kernels = 0.0
  if rule is not None:
    no_reads = lambda rest, shapes: (None if rule(rest, shapes) is None
                                     else [0.0] * len(shapes))
    kernels = total - traffic(no_reads)
  return StepCost(
      traffic=total, kernel_bytes=kernels,
      cycles=hlo.loop_iteration(hlo.hlo_estimated_cycles, hlo_text, unknown_trip_count) / k,
      launches=hlo.loop_iteration(hlo.hlo_launches, hlo_text, unknown_trip_count) / k)


def _shard_bytes(leaf) -> float:
  """Bytes of the leaf's shard on one device (the whole leaf without a NamedSharding)."""
  sharding = getattr(leaf, "sharding", None)
  shape = (sharding.shard_shape(leaf.shape) if isinstance(sharding, jax.sharding.NamedSharding)
           else leaf.shape)
  return float(np.prod(shape, dtype=np.int64)) * leaf.dtype.itemsize


def necessary_bytes(sampler, rows: int, prompt: int, new_tokens: int,
                    mean_prompt: float | None = None) -> Necessary:
  """The necessary bytes per device of one decode step of `rows` rows in a cache of
  `prompt` + `new_tokens` slots, decoding `new_tokens` tokens on `sampler`'s mesh (module
  doc), the rows' prompts `mean_prompt` tokens long on average (default: 3/4 of `prompt`,
  the mean of lengths uniform in [P/2, P]). `sampler.model` may hold abstract parameters
  (`jax.ShapeDtypeStruct`s with shardings, as the program registry builds it) or arrays."""
  from flax import nnx
  on_tpu = sampler.mesh is not None and sampler.mesh.devices.flat[0].platform == "tpu"
  compute = np.dtype(sampler.cfg.compute_dtype)
  weights = 0.0
  for leaf in jax.tree.leaves(nnx.state(sampler.model, nnx.Param)):
    shard = _shard_bytes(leaf)
    if compute.itemsize < leaf.dtype.itemsize:
      shard *= compute.itemsize / leaf.dtype.itemsize  # cast once per call (`for_decoding`)
    elif on_tpu and leaf.dtype == np.float32:
      shard /= 2  # read as bfloat16 (module doc)
    weights += shard
  cfg = sampler.cfg
  slots = prompt + new_tokens
  valid = (0.75 * prompt if mean_prompt is None else mean_prompt) + (new_tokens + 1) / 2
  shape = (cfg.num_layers, rows, cfg.num_kv_heads, slots, cfg.head_dim)
  if sampler.mesh is None:
    per_device = float(np.prod(shape, dtype=np.int64))
  else:
    cache = sharding_lib.cache_shardings(cfg, sampler.mesh, rows, slots)
    per_device = float(np.prod(cache.k.shard_shape(shape), dtype=np.int64))
  cache = 2 * per_device * np.dtype(sampler.cache_dtype).itemsize
  return Necessary(weights=weights, kv=cache * (valid / slots), valid_slots=valid, cache=cache)
