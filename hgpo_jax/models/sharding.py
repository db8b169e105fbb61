"""Device mesh and the logical-axis -> mesh-axis rules that place model parameters.

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

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hgpo_jax.models.config import ModelConfig
from hgpo_jax.models import decoder
from hgpo_jax.models.decoder import KVCache

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


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> jax.sharding.Mesh:
  """A ("data", "fsdp", "tensor") mesh with Auto axis types over `devices` (default all).

  data=-1 takes all devices left over by fsdp and tensor. Auto (not Explicit, which
  `jax.make_mesh` now defaults to) keeps GSPMD propagation and `with_sharding_constraint`
  working on plain arrays.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices)
  if data == -1:
    if n % (fsdp * tensor):
      raise ValueError(f"make_mesh: {n} devices are not divisible by fsdp*tensor={fsdp * tensor} "
                       "(command line: --config.mesh.fsdp, --config.mesh.tensor).")
    data = n // (fsdp * tensor)
  if data * fsdp * tensor != n:
    raise ValueError(f"make_mesh: data*fsdp*tensor = {data}*{fsdp}*{tensor} = {data * fsdp * tensor} "
                     f"but {n} devices were given; make the product equal the device count "
                     "(command line: --config.mesh.data/fsdp/tensor; -1 = the rest).")
  auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
  return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=auto, devices=devices)


def logical_to_spec(logical_axes, mesh: jax.sharding.Mesh, rules=DEFAULT_RULES,
                    shape=None) -> PartitionSpec:
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


def _is_variable(x) -> bool:
  return isinstance(x, nnx.Variable)


def param_shardings(model_or_state, mesh: jax.sharding.Mesh, rules=DEFAULT_RULES):
  """NamedShardings for `nnx.state(model)` (or for a given State), same tree structure.

  Variables without `logical_axes` metadata (e.g. an optimizer's step count) are
  replicated. Optimizer states (`nnx.state(nnx.Optimizer)`) work too: optax moments
  inherit their parameter's metadata.
  """
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)

  def sharding_of(var):
    axes = var.get_metadata().get("logical_axes")
    spec = logical_to_spec(axes, mesh, rules, var.shape) if axes else PartitionSpec()
    return var.replace(NamedSharding(mesh, spec))

  return jax.tree.map(sharding_of, state, is_leaf=_is_variable)


def shard_model(model, mesh: jax.sharding.Mesh, rules=DEFAULT_RULES):
  """Places the model's parameters on the mesh per `rules` (in place); returns the model."""
  state = nnx.state(model)
  nnx.update(model, jax.device_put(state, param_shardings(state, mesh, rules)))
  return model


def cache_shardings(cfg: ModelConfig, mesh: jax.sharding.Mesh, batch: int, length: int,
                    rules=DEFAULT_RULES) -> KVCache:
  """KVCache of NamedShardings for a cache of `batch` rows and `length` positions."""
  shape = decoder.cache_shape(cfg, batch, length)
  sharding = NamedSharding(mesh, logical_to_spec(CACHE_AXES, mesh, rules, shape))
  return KVCache(k=sharding, v=sharding)
