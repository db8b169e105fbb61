"""Process-wide JAX settings shared by the trainer, the tools and the tests."""

import os

import jax

DEFAULT_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hgpo_jax", "jax_compile")


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
