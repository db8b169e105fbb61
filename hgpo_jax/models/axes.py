"""Logical axis names -> mesh axes: the rule table that places parameters, activations and
the KV cache, and `logical_to_spec`, which applies it. Imports no model code.

Parameters carry logical axis names (`logical_axes` metadata on each `nnx.Param`, e.g.
("layers", "embed", "heads", "head_dim")). A rule table maps each logical name to a mesh
axis, a tuple of mesh axes, or None (replicated), in the style of MaxText's
`logical_axis_rules`. The mesh has three axes:
  data:   pure data parallelism (batch only);
  fsdp:   batch and parameters (ZeRO-3 style: "embed" dims of weights are split);
  tensor: Megatron-style tensor parallelism (heads, mlp, vocab).
A dimension whose size is not divisible by its mesh axes is replicated instead (e.g.
SmolLM2's 9 heads on tensor=2), so every preset shards on every mesh.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

DEFAULT_RULES: tuple[tuple[str, str | tuple | None], ...] = (
    ("batch", ("data", "fsdp")),  # fsdp shards the batch too: each fsdp shard sees its own rows
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
    ("norm", None),
    ("length", None),
)

# Logical axes of KVCache.k / KVCache.v: [L, B, Hkv, S, Dh].
CACHE_AXES = ("layers", "batch", "kv_heads", "length", "head_dim")


def logical_to_spec(logical_axes, mesh, rules=DEFAULT_RULES, shape=None) -> PartitionSpec:
  """The PartitionSpec of a value with these logical axis names.

  Mesh axes that the mesh lacks or that an earlier dimension already uses are dropped;
  with `shape`, a dimension not divisible by the product of its mesh axis sizes is
  replicated.
  """
  table = dict(rules)
  used = set()
  spec = []
  for dim, name in enumerate(logical_axes):
    target = table.get(name)
    axes = () if target is None else ((target,) if isinstance(target, str) else tuple(target))
    axes = tuple(a for a in axes if a in mesh.shape and a not in used)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if shape is not None and shape[dim] % size:
      axes = ()
    used.update(axes)
    spec.append(None if not axes else (axes[0] if len(axes) == 1 else axes))
  return PartitionSpec(*spec)
