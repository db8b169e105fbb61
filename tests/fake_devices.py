"""The fake CPU devices a test uses, so the suite runs under any device count.

conftest.py gives the suite 8 fake devices unless XLA_FLAGS sets another count (the
reduction-order variations of docs/reproducibility.md run it with 4 and 16). A test
that builds a fixed mesh takes exactly the devices it needs from here and is skipped,
with the reason, where the process has fewer.
"""

from __future__ import annotations

import jax
import pytest


def take(n: int) -> list:
  """The first `n` devices; skips the test when fewer exist."""
  if jax.device_count() < n:
    pytest.skip(f"needs {n} (fake) devices, the process has {jax.device_count()}")
  return jax.devices()[:n]
