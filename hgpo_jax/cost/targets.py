"""Compile targets: the devices of a TPU slice on a host without a TPU.

`libtpu` (pinned next to jaxlib in tests/requirements.txt) holds the XLA:TPU compiler, and
`jax.experimental.topologies.get_topology_desc(platform="tpu", topology_name=...)` returns
the devices of a slice (several hosts included) as compile-only devices on a CPU-only host.
A program lowered on a mesh of those devices and compiled (`.lower(...).compile()`) goes
through the real XLA:TPU compiler: its `memory_analysis()` is the TPU's, and a program that
does not fit is refused with `RESOURCE_EXHAUSTED: Ran out of memory on HBM`.

The process must run JAX on the CPU (`JAX_PLATFORMS=cpu`) and skip the TPU metadata query
(`TPU_SKIP_MDS_QUERY=1`): `prepare_environment()` sets both and must run before JAX
initialises its backends (`launch.plan` and tests/conftest.py call it first).

Cloud TPU names map to topology strings as the Cloud TPU docs and MaxText's
`accelerator_to_spec_map.py` do (a v5p-8 / v4-8 is 4 chips: 8 TensorCores in megacore
pairs). `available_hbm(devices)` reads XLA:TPU's own usable HBM per chip from the error of
an oversized probe program (measured with libtpu 0.0.42.1: v5e 15.75 GiB, v6e 31.25 GiB,
v5p 95.74 GiB, v4 30.75 GiB).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Optional

from hgpo_jax.cost import hardware
from hgpo_jax.cost import hlo
from hgpo_jax.cost.hardware import GiB


@dataclasses.dataclass(frozen=True)
class Target:
  """A named slice: `get_topology_desc` arguments and the chip's nominal HBM."""
  name: str
  topology: str
  chip_config: str  # TPU chip config; for GPU targets the name of the target spec
  chips: int
  hbm_gib: float  # nominal HBM per chip (Cloud TPU docs); XLA:TPU's usable figure is lower
  platform: str = "tpu"


# Cloud TPU slice names -> topology strings (chips, not TensorCores, for v4/v5p).
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("v4-8", "v4:2x2x1", "megacore", 4, 32),
    Target("v5e-8", "v5e:2x4", "default", 8, 16),
    Target("v5e-16", "v5e:4x4", "default", 16, 16),
    Target("v5e-32", "v5e:4x8", "default", 32, 16),
    Target("v5p-8", "v5:2x2x1", "megacore", 4, 96),
    Target("v5p-16", "v5:2x2x2", "megacore", 8, 96),
    Target("v6e-8", "v6e:2x4", "default", 8, 32),
    Target("v6e-16", "v6e:4x4", "default", 16, 32),
)}
# GPU targets: deviceless compiles through the CUDA plugin's compile-only topology (no GPU,
# no driver; experimental in JAX 0.10): `get_topology_desc(platform="cuda",
# target_config=<GpuTargetConfig text proto>, topology="slices x hosts x devices")`.
GPU_TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("h100-1", "1x1x1", "h100_sxm", 1, 80, platform="cuda"),  # the decode benchmark's chip
    Target("h100-8", "1x1x8", "h100_sxm", 8, 80, platform="cuda"),
)}
# The device description XLA:GPU compiles for (NVIDIA H100 SXM 80GB: the public datasheet's
# 132 SMs, 1.98 GHz boost clock, 3.35 TB/s HBM3, 50 MiB L2, 227 KiB shared memory per
# block opt-in, compute capability 9.0). No autotuning runs without a GPU, so kernel
# choices, and with them temporaries, can differ from a compile on a real H100.
_GPU_SPECS = {"h100_sxm": """gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84942979072
  shared_memory_per_block_optin: 232448
  cuda_compute_capability {
    major: 9
  }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info {
  major: 8
  minor: 9
  patch: 4
}
device_description_str: "NVIDIA H100 80GB HBM3"
"""}
_NOMINAL_HBM_GIB = {"v4": 32, "v5e": 16, "v5": 96, "v5p": 96, "v6e": 32}
_RAW_TOPOLOGY = re.compile(r"^(v4|v5e|v5p|v5|v6e):\d+(x\d+){1,2}$")


# What libtpu reads of the host it runs on when it starts; on a host without TPU chips it
# finds none and prints errors ("Failed to find host bounds", "unexpected worker hostname
# 'WARNING: could not determine TPU worker hostnames...'", a "Source Location Trace"). A
# one-host, one-worker answer silences them and changes no compile-only topology
# (`get_topology_desc` takes the slice's own shape: same devices, hosts and coordinates).
_NO_TPU_HOST = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_HOST_BOUNDS": "1,1,1"}


def prepare_environment() -> None:
  """CPU JAX + XLA:TPU as a compiler only; call before JAX initialises its backends."""
  from hgpo_jax import runtime
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
  # Several libtpu users in one machine (pytest-xdist workers) must not lock each other out.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
  if not runtime.tpu_chips_present():  # a TPU VM's own settings are left alone
    for name, value in _NO_TPU_HOST.items():
      os.environ.setdefault(name, value)


def libtpu_available() -> Optional[str]:
  """None when the XLA:TPU compiler can be loaded, else the reason it cannot."""
  import importlib.util
  if importlib.util.find_spec("libtpu") is None:
    return "libtpu is not installed (pip install -r tests/requirements.txt pins it with jaxlib)"
  return None


def cuda_plugin_available() -> Optional[str]:
  """None when XLA:GPU can compile without a GPU here, else the reason it cannot."""
  import importlib.util
  if importlib.util.find_spec("jax_cuda12_plugin") is None:
    return ("the CUDA plugin is not installed: pip install 'jax-cuda12-plugin[with-cuda]==0.10.2' "
            "'jax-cuda12-pjrt==0.10.2' (about 5.5 GB of CUDA libraries; no GPU needed)")
  return None


def compiler_available(target: "Target") -> Optional[str]:
  return cuda_plugin_available() if target.platform == "cuda" else libtpu_available()


def resolve(name: str) -> Target:
  """A Cloud TPU name (`v5e-8`) or a raw topology string (`v5e:2x4`, `v5:2x2x1`)."""
  if name in TARGETS:
    return TARGETS[name]
  if name in GPU_TARGETS:
    return GPU_TARGETS[name]
  if _RAW_TOPOLOGY.match(name):
    generation, _, shape = name.partition(":")
    chips = 1
    for d in shape.split("x"):
      chips *= int(d)
    megacore = generation in ("v4", "v5", "v5p")
    topology = name.replace("v5p:", "v5:")
    return Target(name, topology, "megacore" if megacore else "default", chips,
                  _NOMINAL_HBM_GIB[generation])
  raise ValueError(f"unknown target {name!r}; use one of {sorted(TARGETS) + sorted(GPU_TARGETS)} "
                   "or a TPU topology string such as v5e:2x4 or v5p:2x2x1.")


@functools.lru_cache(maxsize=None)
def _topology(topology: str, chip_config: str):
  from jax.experimental import topologies
  kwargs = {} if chip_config == "default" else {"chip_config_name": chip_config}
  return topologies.get_topology_desc(platform="tpu", topology_name=topology, **kwargs)


@functools.lru_cache(maxsize=None)
def _gpu_topology(topology: str, spec: str):
  from jax.experimental import topologies
  return topologies.get_topology_desc(platform="cuda", target_config=_GPU_SPECS[spec],
                                      topology=topology)


def devices(target: Target) -> list:
  """The compile-only devices of `target` (all hosts), in topology order."""
  reason = compiler_available(target)
  if reason:
    raise RuntimeError(f"cannot compile for {target.name}: {reason}")
  if target.platform == "cuda":
    devs = list(_gpu_topology(target.topology, target.chip_config).devices)
  else:
    devs = list(_topology(target.topology, target.chip_config).devices)
  if len(devs) != target.chips:
    raise RuntimeError(f"{target.name}: XLA:TPU gives {len(devs)} devices for topology "
                       f"{target.topology}, expected {target.chips}.")
  return devs


def process_count(devs) -> int:
  """Hosts of a slice (each TPU VM host is one JAX process)."""
  return len({d.process_index for d in devs})


_HBM_ERROR = re.compile(r"exceeds available HBM \(([\d.]+)([KMGT]?)\)")
_UNITS = {"": 1, "K": 1024, "M": 1024 ** 2, "G": GiB, "T": 1024 ** 4}


def parse_oom(message: str) -> Optional[tuple[int, int]]:
  """(bytes asked, bytes available) from an XLA:TPU out-of-memory error, or None."""
  m = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\) exceeds available HBM "
                r"\(([\d.]+)([KMGT]?)\)", message)
  if m:
    return (int(float(m.group(1)) * _UNITS[m.group(2)]),
            int(float(m.group(3)) * _UNITS[m.group(4)]))
  m = re.search(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm", message)
  if m:
    return (int(float(m.group(1)) * _UNITS[m.group(2)]),
            int(float(m.group(3)) * _UNITS[m.group(4)]))
  return None


def is_oom(error: BaseException) -> bool:
  text = str(error)
  return "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text


@functools.lru_cache(maxsize=None)
def _available_hbm(device_kind: str, topology: str, chip_config: str) -> int:
  import jax
  import jax.numpy as jnp
  import numpy as np
  devs = list(_topology(topology, chip_config).devices)
  mesh = jax.sharding.Mesh(np.array(devs[:1]), ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  probe = lambda x: jnp.sin(jnp.zeros((1 << 40) // 4, jnp.float32) + x)  # 1 TiB of temporaries
  try:
    jax.jit(probe, out_shardings=rep).lower(
        jax.ShapeDtypeStruct((), jnp.float32, sharding=rep)).compile()
  except Exception as e:  # noqa: BLE001  (XlaRuntimeError; the message is what we read)
    parsed = parse_oom(str(e))
    if parsed:
      return parsed[1]
    raise RuntimeError(f"XLA:TPU refused the HBM probe without naming its HBM: {e}") from None
  raise RuntimeError(f"XLA:TPU compiled a 1 TiB program for {device_kind}: cannot read its HBM.")


def available_hbm(target: Target) -> int:
  """Bytes of HBM per chip that XLA:TPU lets one program use (its own figure); for a GPU
  target the device memory of its spec (XLA:GPU refuses nothing at compile time)."""
  if target.platform == "cuda":
    m = re.search(r"device_memory_size: (\d+)", _GPU_SPECS[target.chip_config])
    return int(m.group(1))
  devs = devices(target)
  return _available_hbm(devs[0].device_kind, target.topology, target.chip_config)


@functools.lru_cache(maxsize=None)
def _cycles_of_matmul(topology: str, chip_config: str) -> tuple[float, float]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  devs = list(_topology(topology, chip_config).devices)
  mesh = jax.sharding.Mesh(np.array(devs[:1]), ("x",))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  m = n = k = 8192
  sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=rep)
  compiled = jax.jit(jnp.matmul, out_shardings=rep).lower(sds((m, k)), sds((k, n))).compile()
  return hlo.hlo_estimated_cycles(compiled.as_text()), 2.0 * m * n * k


def seconds_per_cycle(target: Target) -> float:
  """Seconds per XLA:TPU cost-model cycle on `target`, calibrated so that a large bf16
  matmul (8192^3) runs at the chip's published peak (`hardware.ACCELERATORS`): its estimated
  cycles x this = its FLOPs / peak. Converts `hlo.hlo_estimated_cycles` to seconds."""
  devs = devices(target)
  peak = hardware.device_peak(devs[0], "bfloat16").flops_per_s
  cycles, flops = _cycles_of_matmul(target.topology, target.chip_config)
  if cycles <= 0:
    raise RuntimeError(f"XLA:TPU wrote no cycle estimates for {target.name}")
  return flops / peak / cycles


# One TPU VM host's chips as a topology of its own, by device kind.
_HOST_TOPOLOGY = {"TPU v5 lite": ("v5e:2x2", "default"), "TPU v6 lite": ("v6e:2x2", "default"),
                  "TPU v5": ("v5:2x2x1", "megacore"), "TPU v4": ("v4:2x2x1", "megacore")}


def one_host_devices(devs) -> list:
  """The devices one process of a multi-host slice compiles its own programs for (the
  sampler: each host samples its own prompts on its own chips).

  XLA:TPU's compile-only client numbers a program's devices from 0, so a program over one
  host's chips of a larger topology (ids such as 0, 1, 4, 5 of a v5e:4x4) is refused; the
  same chips as a one-host topology (v5e:2x2) compile. Single-host slices return `devs`."""
  if process_count(devs) == 1:
    return list(devs)
  per_host = len(devs) // process_count(devs)
  kind = devs[0].device_kind
  if kind not in _HOST_TOPOLOGY:
    raise ValueError(f"no one-host topology known for {kind!r}")
  host = list(_topology(*_HOST_TOPOLOGY[kind]).devices)
  if len(host) != per_host:
    raise ValueError(f"{kind}: a host of this slice has {per_host} chips, the one-host topology "
                     f"{_HOST_TOPOLOGY[kind][0]} has {len(host)}")
  return host
