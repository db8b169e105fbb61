"""Test-suite set-up: 8 fake CPU devices, the CPU ISA pin and JAX's persistent compilation cache.

The environment variables must be set before JAX initialises its backends, so this
file sets them at import time (pytest imports conftest before any test module).
"""

import json
import os
import time

_START = time.monotonic()
SUITE_BUDGET_MIN = 30
"""`make test`'s budget: minutes of wall time from a cold compilation cache on the 2-core
reference machine (docs/architecture.md, "Testing")."""

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:TPU as a compiler only (tests marked tpu_compile, hgpo_jax/cost/targets.py): no
# TPU metadata server to ask, and every pytest-xdist worker may load libtpu.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import pytest  # noqa: E402

from hgpo_jax import runtime  # noqa: E402  (after the env vars on purpose)

runtime.pin_cpu_isa()  # the same CPU programs on every x86 machine (see runtime.py)
runtime.enable_compilation_cache()


@pytest.fixture(autouse=True)
def _compile_only_tests_skip_the_persistent_cache(request):
  """Tests marked tpu_compile / gpu_compile compile with a compile-only client (XLA:TPU from
  libtpu, XLA:GPU's deviceless compiler), which cannot read an executable back from the
  persistent cache: JAX warns ("PjRtCompiler must be constructed with a Client") and
  compiles again. Their compiles stay out of the cache; every other test keeps it."""
  if not {"tpu_compile", "gpu_compile"} & {m.name for m in request.node.iter_markers()}:
    yield
    return
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  # JAX decides once per process whether the cache is in use: reset that decision on the
  # way in and out, so the flag is read again.
  was = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", was)
    compilation_cache.reset_cache()


DURATIONS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "durations.json")
"""Seconds per test file from a cold run of the suite ({"tests/x/test_y.py": s}), written by
`python -m launch.test_durations REPORT.xml --order tests/durations.json`."""


def module_order(paths: list[str], seconds: dict[str, float]) -> list[str]:
  """`paths` (test files, collection order) with the slowest recorded first; files without
  a record keep their collection order after the recorded ones.

  Why: `make test` hands whole files to its pytest-xdist workers (`--dist loadfile`, so a
  module-scoped fixture such as a trainer run is built once, not once per worker), and a
  long file that starts last leaves the other worker idle; longest-first keeps both busy
  to the end."""
  recorded = sorted((p for p in paths if p in seconds), key=lambda p: -seconds[p])
  return recorded + [p for p in paths if p not in seconds]


def pytest_collection_modifyitems(session, config, items):
  """Orders the collected tests file by file as `module_order` does (the same order in every
  pytest-xdist worker: the file is read, not measured); a file's own tests keep their order."""
  try:
    with open(DURATIONS_FILE, encoding="utf-8") as f:
      seconds = json.load(f)
  except (OSError, ValueError):
    return  # no record: pytest's collection order
  root = str(config.rootpath)
  by_file: dict[str, list] = {}
  for item in items:
    by_file.setdefault(os.path.relpath(str(item.path), root), []).append(item)
  items[:] = [item for path in module_order(list(by_file), seconds) for item in by_file[path]]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
  """The suite's wall time against its budget, in every log (the controller only under
  pytest-xdist; `--durations=10` in `make test` lists the slowest tests above it)."""
  if hasattr(config, "workerinput"):
    return
  minutes = (time.monotonic() - _START) / 60
  over = " (over budget)" if minutes > SUITE_BUDGET_MIN else ""
  terminalreporter.write_line(f"suite wall time {minutes:.1f} min{over}; budget of make test "
                              f"{SUITE_BUDGET_MIN} min from a cold compilation cache on 2 cores")
