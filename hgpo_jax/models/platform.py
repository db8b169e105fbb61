"""The platform programs are compiled for: the target devices', never the local backend's.

A CPU host compiling for TPU topology devices gets TPU programs (attention "auto", the KV
cache dtype, the plan's compiler), so every such choice reads `target_platform`.
"""

from __future__ import annotations

import jax
import numpy as np

_GPU_PLATFORMS = ("cuda", "rocm")
"""Platform names some device objects report for a GPU (topology devices, plugins)."""


def target_platform(mesh_or_devices) -> str:
  """"cpu", "tpu", "gpu" (also for devices that report "cuda" or "rocm"), or another
  backend's name: the platform of a Mesh's, AbstractMesh's or device list's devices (TPU
  topology devices from `jax.experimental.topologies` included)."""
  if isinstance(mesh_or_devices, jax.sharding.AbstractMesh):
    device = mesh_or_devices.abstract_device
    if device is None or device.platform is None:
      raise ValueError("this AbstractMesh names no device platform; pass the concrete Mesh "
                       "(or its devices) to pick a platform-dependent setting ('auto').")
    platform = device.platform
  elif isinstance(mesh_or_devices, jax.sharding.Mesh):
    platform = mesh_or_devices.devices.flat[0].platform
  else:
    devices = list(np.ravel(np.asarray(mesh_or_devices, dtype=object)))
    if not devices:
      raise ValueError("no devices to pick a platform-dependent setting ('auto') against.")
    platform = devices[0].platform
  return "gpu" if platform in _GPU_PLATFORMS else platform
