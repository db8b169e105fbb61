"""Process-wide JAX settings shared by the trainer, the tools and the tests."""

from __future__ import annotations

import os

import jax

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hgpo_jax", "jax_compile")
# The widest x86 instruction set XLA's CPU compiler may use (see pin_cpu_isa).
CPU_ISA = "AVX2"


def pin_cpu_isa(isa: str = CPU_ISA) -> str:
  """Caps the instruction set of XLA's CPU code generation at `isa` (XLA_FLAGS).

  Why: XLA compiles CPU kernels for the host's vector extensions, and the extension set
  changes float results: jitted `exp` and `tanh` give other bits with
  `--xla_cpu_max_isa=AVX` (no FMA) than with AVX2 on the same machine
  (tests/test_reproducibility.py; docs/reproducibility.md lists what was measured), so
  an AVX-512 machine would not reproduce the metrics of an AVX2 one bit for bit. Capping at AVX2 (every x86 server since 2013) makes
  the CPU programs the same on all of them. A `--xla_cpu_max_isa` already in XLA_FLAGS
  wins (set it to use AVX-512, at the price of cross-machine equality). Accelerator
  programs are unaffected. Must run before JAX creates its CPU backend (the first
  computation or device query); returns the resulting XLA_FLAGS.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_cpu_max_isa" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_cpu_max_isa={isa}".strip()
  return os.environ["XLA_FLAGS"]


def enable_compilation_cache(cache_dir: str | None = None) -> str:
  """Turns on JAX's persistent compilation cache (CPU included).

  Why: compiling the sampler and the train step dominates short runs and the test
  suite; a warm cache cuts first-call latency several-fold.
  Thresholds are zeroed because the defaults skip small and fast-compiling entries.
  """
  cache_dir = cache_dir or os.environ.get("HGPO_JAX_COMPILE_CACHE", DEFAULT_CACHE_DIR)
  os.makedirs(cache_dir, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", cache_dir)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  return cache_dir
