"""Device mesh and the placement of model parameters by their logical axis names.

The rule table and `logical_to_spec` live in `hgpo_jax.models.axes` (no model code), the
KV cache's shardings in `hgpo_jax.models.kv_cache`; both are re-exported here.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hgpo_jax.models.axes import (CACHE_AXES, DEFAULT_RULES, MESH_AXES,  # noqa: F401
                                  logical_to_spec)
from hgpo_jax.models.kv_cache import cache_shardings  # noqa: F401


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
