"""The hardware table: device peaks, memory sizes and bandwidths, and MFU.

`device_peak()` gives the peak FLOP/s of one device. Accelerators: a table of published
dense peaks by `device.device_kind` (`ACCELERATORS`, with each device's HBM and its
datasheet bandwidth); CPU: cores x f32 vector lanes x FMA units x 2 x clock, detected from
/proc/cpuinfo and lscpu (`describe_cpu()` says what was found). `HGPO_PEAK_FLOPS` (FLOP/s
per device) overrides both.

MFU here is FLOPs-of-the-executable / time / peak: with `model.remat` the recomputed
forward pass is counted (strictly, hardware FLOPs utilisation).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
from typing import Any, Optional

GiB = 1024 ** 3  # the one binary gigabyte of the cost accounting and the plan


@dataclasses.dataclass(frozen=True)
class Peak:
  """Peak FLOP/s of one device for a dtype, and where the number comes from."""
  flops_per_s: float
  device_kind: str
  dtype: str
  source: str


# Published dense peaks per chip / GPU (no sparsity), FLOP/s, HBM per device and HBM
# bandwidth (bytes/s). TPU: cloud.google.com/tpu/docs/{v4,v5e,v5p,v6e}; GPU: NVIDIA
# A100/H100/H200 datasheets (SXM parts). TPU f32 matmuls run as bf16 passes at JAX's
# default precision, so TPUs list one peak; GPUs list f32 without TF32.
ACCELERATORS: dict[str, dict[str, Any]] = {
    "TPU v4": dict(bfloat16=275e12, float32=275e12, memory_gib=32, bandwidth=1200e9),
    "TPU v5 lite": dict(bfloat16=197e12, float32=197e12, memory_gib=16, bandwidth=819e9),  # v5e
    "TPU v5e": dict(bfloat16=197e12, float32=197e12, memory_gib=16, bandwidth=819e9),
    "TPU v5p": dict(bfloat16=459e12, float32=459e12, memory_gib=95, bandwidth=2765e9),
    "TPU v5": dict(bfloat16=459e12, float32=459e12, memory_gib=95, bandwidth=2765e9),  # v5p's kind
    "TPU v6 lite": dict(bfloat16=918e12, float32=918e12, memory_gib=32, bandwidth=1640e9),  # v6e
    "TPU v6e": dict(bfloat16=918e12, float32=918e12, memory_gib=32, bandwidth=1640e9),
    "NVIDIA H200": dict(bfloat16=989e12, float32=67e12, memory_gib=141, bandwidth=4.8e12),
    "NVIDIA H100 PCIe": dict(bfloat16=756e12, float32=51e12, memory_gib=80, bandwidth=2.0e12),
    "NVIDIA H100": dict(bfloat16=989e12, float32=67e12, memory_gib=80, bandwidth=3.35e12),  # SXM
    "NVIDIA A100": dict(bfloat16=312e12, float32=19.5e12, memory_gib=80, bandwidth=2.04e12),
}


def _table_entry(kind: str) -> Optional[tuple[str, dict]]:
  """The longest table key that `kind` starts with (e.g. "NVIDIA H100 80GB HBM3")."""
  best = None
  for key, row in ACCELERATORS.items():
    if kind.lower().startswith(key.lower()) and (best is None or len(key) > len(best[0])):
      best = (key, row)
  return best


def memory_bandwidth(kind: str) -> tuple[Optional[str], Optional[float]]:
  """(table key, datasheet HBM bytes/s) of the `ACCELERATORS` entry `device_kind` `kind`
  starts with (the longest key), or (None, None) for a device the table does not hold."""
  entry = _table_entry(kind)
  return (entry[0], entry[1]["bandwidth"]) if entry else (None, None)


def _read(path: str) -> str:
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return ""


def describe_cpu() -> dict[str, Any]:
  """What the CPU peak is computed from: cores, widest f32 vector, FMA, clock."""
  info = _read("/proc/cpuinfo")
  flags = set()
  model = ""
  mhz = []
  for line in info.splitlines():
    key, _, value = line.partition(":")
    key = key.strip()
    if key == "flags" and not flags:
      flags = set(value.split())
    elif key == "model name" and not model:
      model = value.strip()
    elif key == "cpu MHz":
      try:
        mhz.append(float(value))
      except ValueError:
        pass
  clock_hz, clock_source = 0.0, "none"
  khz = _read("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").strip()
  if khz.isdigit():
    clock_hz, clock_source = int(khz) * 1e3, "cpufreq max"
  elif shutil.which("lscpu"):
    try:
      out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
      m = re.search(r"CPU max MHz:\s*([\d.]+)", out)
      if m and float(m.group(1)) > 0:
        clock_hz, clock_source = float(m.group(1)) * 1e6, "lscpu max MHz"
    except (OSError, subprocess.SubprocessError):
      pass
  if not clock_hz and mhz:
    clock_hz, clock_source = max(mhz) * 1e6, "/proc/cpuinfo cpu MHz"
  lanes = 16 if "avx512f" in flags else 8 if "avx" in flags else 4 if "sse2" in flags else 1
  # Two FMA pipes per core on current x86 server cores (Zen 2+, Skylake-SP Gold and up);
  # without FMA, one multiply and one add pipe (the same 2 FLOPs per lane per cycle).
  fma_units = 2 if "fma" in flags else 1
  try:
    cores = len(os.sched_getaffinity(0))
  except AttributeError:
    cores = os.cpu_count() or 1
  return dict(model=model, cores=cores, f32_lanes=lanes, fma_units=fma_units,
              clock_hz=clock_hz, clock_source=clock_source,
              bf16_dot="avx512_bf16" in flags, amx="amx_bf16" in flags)


def cpu_peak(dtype: str = "float32") -> Peak:
  """cores x f32 lanes x FMA units x 2 FLOPs x clock (bf16: x2 with AVX512-BF16 dot
  products; AMX tiles are not counted)."""
  c = describe_cpu()
  per_cycle = c["f32_lanes"] * c["fma_units"] * 2
  if dtype == "bfloat16" and c["bf16_dot"]:
    per_cycle *= 2
  flops = c["cores"] * per_cycle * c["clock_hz"]
  source = (f"detected: {c['model'] or 'cpu'}, {c['cores']} cores x {c['f32_lanes']} f32 lanes x "
            f"{c['fma_units']} FMA x 2 x {c['clock_hz'] / 1e9:.3f} GHz ({c['clock_source']})"
            + (", bf16 dot x2" if dtype == "bfloat16" and c["bf16_dot"] else ""))
  return Peak(flops, "cpu", dtype, source)


def device_peak(device=None, dtype: str = "float32") -> Peak:
  """Peak FLOP/s of one device (default `jax.devices()[0]`) for compute dtype `dtype`."""
  override = os.environ.get("HGPO_PEAK_FLOPS")
  if device is None:
    import jax
    device = jax.devices()[0]
  kind = getattr(device, "device_kind", "cpu")
  if override:
    return Peak(float(override), kind, dtype, "HGPO_PEAK_FLOPS")
  if device.platform == "cpu":
    return cpu_peak(dtype)
  entry = _table_entry(kind)
  if entry is None:
    raise ValueError(f"no published peak for device kind {kind!r}; set HGPO_PEAK_FLOPS "
                     f"(FLOP/s per device) or add it to hgpo_jax.cost.hardware.ACCELERATORS.")
  key, row = entry
  return Peak(row.get(dtype, row["bfloat16"]), kind, dtype, f"table: {key} {dtype}")


def mfu(flops: float, seconds: float, peak: Peak) -> float:
  """Achieved / peak FLOP/s (flops per device, peak per device)."""
  return flops / seconds / peak.flops_per_s if seconds > 0 else 0.0
