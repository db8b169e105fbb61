"""Importing the library and using JAX in a plain interpreter prints nothing on a host
without TPUs (the libtpu wheel of the topology compiles does not start up)."""

import os
import subprocess
import sys

import pytest

from hgpo_jax import runtime

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _every_module() -> list[str]:
  names = []
  for folder, _, files in os.walk(os.path.join(ROOT, "hgpo_jax")):
    for f in sorted(files):
      if f.endswith(".py"):
        rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-len(".py")].split(os.sep)
        names.append(".".join(rel[:-1] if rel[-1] == "__init__" else rel))
  return sorted(names)


@pytest.mark.skipif(runtime.tpu_chips_present(), reason="a TPU host starts libtpu on purpose")
def test_importing_every_module_and_a_first_computation_print_nothing():
  modules = _every_module()
  assert "hgpo_jax.models.loading" in modules and len(modules) > 50
  code = (f"import {', '.join(modules)}\n"
          "import jax, jax.numpy as jnp\n"
          "assert float(jnp.ones(3).sum()) == 3.0 and jax.devices()")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout == "" and out.stderr == "", (out.stdout + out.stderr)[:2000]
