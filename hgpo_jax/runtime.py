"""Process-wide JAX settings shared by the trainer, the tools and the tests.

JAX is imported inside the functions: JAX reads JAX_PLATFORMS when it is imported, and the
topology compiles (`targets.prepare_environment`) set it after importing this module.
"""

from __future__ import annotations

import os

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hgpo_jax", "jax_compile")
# The widest x86 instruction set XLA's CPU compiler may use (see pin_cpu_isa).
CPU_ISA = "AVX2"


# XLA:CPU settings by name; hgpo_jax.runtime.pin_cpu_numerics applies one.
#   default:    code generation capped at AVX2, and no platform-dependent math
#               (--xla_cpu_enable_platform_dependent_math=false). With it, an AMD EPYC
#               (AVX2) and an Intel Xeon (AVX-512, AMX) give the same bits on every line
#               of launch/cpu_numerics/witness.py, a training iteration's phases included, at 1,
#               2 and 16 cores (results/reproducibility_records.md); without it they part in
#               matmuls with contractions over 256, in an RMS norm and in a softmax-attention
#               block.
#   host_math:  the ISA cap alone: the numerics of the committed results tables' runs
#               (the default of the trainer revisions they record); bf16 products run on
#               the CPU's bf16 units only under it (under `default` at float32 speed).
#   no_ynnpack: the ISA cap and no YNNPACK fusions (dots in Eigen, reductions in XLA's own
#               code): a diagnosis setting; Eigen splits long contractions by thread count.
# What each pins, measured on two machines, and the cost: docs/reproducibility.md.
CPU_NUMERICS = {
    "default": (f"--xla_cpu_max_isa={CPU_ISA}", "--xla_cpu_enable_platform_dependent_math=false"),
    "host_math": (f"--xla_cpu_max_isa={CPU_ISA}",),
    "no_ynnpack": (f"--xla_cpu_max_isa={CPU_ISA}", "--xla_cpu_experimental_ynn_fusion_type="),
}
CPU_NUMERICS_ENV = "HGPO_JAX_CPU_NUMERICS"


def cpu_numerics_name(mode: str | None = None) -> str:
  """The setting `pin_cpu_numerics(mode)` applies: `mode`, else $HGPO_JAX_CPU_NUMERICS, else
  "default"."""
  return mode or os.environ.get(CPU_NUMERICS_ENV) or "default"


def pin_cpu_numerics(mode: str | None = None) -> str:
  """Adds the XLA:CPU flags of setting `mode` (CPU_NUMERICS) to XLA_FLAGS.

  `mode` defaults to $HGPO_JAX_CPU_NUMERICS, else "default". A flag already in XLA_FLAGS
  wins (its name is not added again), so an explicit `--xla_cpu_max_isa=AVX512` allows
  AVX-512 at the price of cross-machine equality. Why the ISA cap: XLA compiles CPU
  kernels for the host's vector extensions, and the extension set changes float results
  (jitted `exp` and `tanh` give other bits under AVX than under AVX2 on the same machine;
  tests/test_reproducibility.py). Accelerator programs are unaffected. Must run before
  JAX creates its CPU backend (the first computation or device query); returns the
  resulting XLA_FLAGS.
  """
  mode = cpu_numerics_name(mode)
  if mode not in CPU_NUMERICS:
    raise ValueError(f"CPU numerics setting {mode!r} (${CPU_NUMERICS_ENV}) is not one of "
                     f"{sorted(CPU_NUMERICS)}.")
  flags = os.environ.get("XLA_FLAGS", "")
  for flag in CPU_NUMERICS[mode]:
    if flag.split("=")[0] + "=" not in flags:
      flags = f"{flags} {flag}".strip()
  os.environ["XLA_FLAGS"] = flags
  return flags


def pin_cpu_isa(mode: str | None = None) -> str:
  """The entry points' call, before JAX initialises its backends: pin_cpu_numerics with
  `mode` (their `--cpu_numerics`), else $HGPO_JAX_CPU_NUMERICS, else the default, and
  `select_platforms` (no libtpu start-up on a host without TPUs)."""
  select_platforms()
  return pin_cpu_numerics(mode)


# PCI vendor id of Google's TPU chips (what JAX's own Cloud TPU check reads as well).
_TPU_PCI_VENDOR = "0x1ae0"


def tpu_chips_present() -> bool:
  """Whether this host has TPU chips, read from the PCI bus and the device nodes (TPU VMs
  expose /dev/accel* or /dev/vfio/<n>) without loading libtpu."""
  import glob
  for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
    try:
      with open(path, encoding="ascii") as f:
        if f.read().strip() == _TPU_PCI_VENDOR:
          return True
    except OSError:
      continue
  return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def select_platforms() -> str:
  """Keeps JAX from starting libtpu on a host without TPU chips; returns jax_platforms.

  Why: the venv holds the `libtpu` wheel for the topology compiles (`launch.plan
  --topology`), and JAX's default backend discovery initialises every installed plugin:
  on a machine without TPUs libtpu then prints its start-up errors ("Failed to find host
  bounds", "unexpected worker hostname", a "Source Location Trace") before the program's
  first line. With no TPU on the PCI bus, JAX gets the platforms that can exist here (a GPU
  plugin whose device nodes are present, and the CPU); a topology compile still loads
  libtpu as a compiler (`targets.devices`). An explicit JAX_PLATFORMS or jax_platforms
  wins. Must run before JAX initialises its backends (the first device query or compile).
  Before JAX is imported it sets JAX_PLATFORMS (which JAX reads on import, and which child
  processes inherit) without importing JAX: `launch/__init__.py` calls it so that every
  `python -m launch.*` tool starts clean; once JAX is imported it sets jax_platforms.
  """
  import glob
  import importlib.util
  import pkgutil
  import sys
  jax = sys.modules.get("jax")
  chosen = os.environ.get("JAX_PLATFORMS") or (jax.config.jax_platforms if jax else "") or ""
  if chosen or tpu_chips_present() or importlib.util.find_spec("libtpu") is None:
    return chosen
  plugins = [m.name for m in pkgutil.iter_modules() if m.name.startswith("jax_")]
  nodes = {"cuda": "/dev/nvidia[0-9]*", "rocm": "/dev/kfd"}
  platforms = [platform for platform, node in nodes.items()
               if glob.glob(node) and any(p.startswith(f"jax_{platform}") for p in plugins)]
  chosen = ",".join(platforms + ["cpu"])
  if jax is None:
    os.environ["JAX_PLATFORMS"] = chosen
  else:
    jax.config.update("jax_platforms", chosen)
  return chosen


def enable_compilation_cache(cache_dir: str | None = None) -> str:
  """Turns on JAX's persistent compilation cache (CPU included).

  Why: compiling the sampler and the train step dominates short runs and the test
  suite; a warm cache cuts first-call latency several-fold.
  Thresholds are zeroed because the defaults skip small and fast-compiling entries.
  """
  import jax
  cache_dir = cache_dir or os.environ.get("HGPO_JAX_COMPILE_CACHE", DEFAULT_CACHE_DIR)
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return cache_dir
