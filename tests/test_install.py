"""`make venv ACCEL=cpu|cuda12|tpu`: what each target installs, the stamp's rebuild rule, and
the pinned accelerator plugins (against jax's own metadata, and against PyPI)."""

import os
import re
import shutil
import stat
import subprocess
import sys
from importlib import metadata

import pytest
from packaging.requirements import Requirement

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_FILES = {"cuda12": "requirements-cuda12.txt", "tpu": "requirements-tpu.txt"}


def _pins(path: str) -> dict[str, Requirement]:
  """{name: requirement} of a requirements file (comments and blank lines skipped)."""
  out = {}
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    for line in f:
      line = line.split("#", 1)[0].strip()
      if line:
        req = Requirement(line)
        out[req.name.lower()] = req
  return out


def _version(req: Requirement) -> str:
  (spec,) = req.specifier
  assert spec.operator == "==", req
  return spec.version


# ---------------------------------------------------------------------------------------
# The Makefile: a fake venv whose pip and python log their arguments.
# ---------------------------------------------------------------------------------------

@pytest.fixture
def sandbox(tmp_path):
  """The Makefile and the requirements files it reads, with a `.venv` whose `pip` and
  `python` append their argv to `log` (no install happens)."""
  for name in ["Makefile", "requirements.txt", "pyproject.toml", "tests/requirements.txt",
               "env_servers/requirements-nodeps.txt", *TARGET_FILES.values()]:
    os.makedirs(tmp_path / os.path.dirname(name), exist_ok=True)
    shutil.copy(os.path.join(ROOT, name), tmp_path / name)
  os.makedirs(tmp_path / ".venv" / "bin")
  for tool in ("pip", "python"):
    path = tmp_path / ".venv" / "bin" / tool
    path.write_text(f'#!/bin/sh\necho "{tool} $*" >> "{tmp_path}/log"\n')
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
  return tmp_path


def _make(sandbox, *args) -> list[str]:
  """Runs `make venv ARGS` in the sandbox; returns the pip/python calls it made."""
  log = sandbox / "log"
  if log.exists():
    log.unlink()
  done = subprocess.run(["make", "venv", *args], cwd=sandbox, capture_output=True, text=True,
                        timeout=60, env=dict(os.environ, MAKEFLAGS=""))
  assert done.returncode == 0, done.stdout + done.stderr
  return log.read_text().splitlines() if log.exists() else []


def _installs(calls: list[str]) -> list[str]:
  return [c.split()[-1] for c in calls if c.startswith("pip install") and " -r " in c]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_venv_installs_the_target_and_rebuilds_when_accel_changes(sandbox):
  cpu = _make(sandbox)  # a new venv: cpu, today's install plus removing a GPU plugin
  assert _installs(cpu) == ["requirements.txt", "env_servers/requirements-nodeps.txt",
                            "tests/requirements.txt"]
  assert "pip uninstall --quiet --yes jax-cuda12-plugin jax-cuda12-pjrt" in cpu
  assert (sandbox / ".venv" / ".accel").read_text().strip() == "cpu"
  assert _make(sandbox) == []  # up to date: nothing runs
  gpu = _make(sandbox, "ACCEL=cuda12")
  assert _installs(gpu) == ["requirements.txt", "requirements-cuda12.txt",
                            "env_servers/requirements-nodeps.txt", "tests/requirements.txt"]
  assert not any(c.startswith("pip uninstall") for c in gpu)
  assert _make(sandbox) == []  # the default is now the venv's own target: no rebuild
  assert _make(sandbox, "ACCEL=cuda12") == []
  tpu = _make(sandbox, "ACCEL=tpu")
  assert "requirements-tpu.txt" in _installs(tpu)
  assert "requirements-cuda12.txt" not in _installs(tpu)
  assert "pip uninstall --quiet --yes jax-cuda12-plugin jax-cuda12-pjrt" in tpu
  assert _make(sandbox, "ACCEL=cpu")[-1] == "python -m env_servers.protos.build"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_venv_refuses_an_unknown_accel_in_one_line(sandbox):
  done = subprocess.run(["make", "venv", "ACCEL=gpu"], cwd=sandbox, capture_output=True,
                        text=True, timeout=60)
  assert done.returncode != 0
  assert "ACCEL=gpu is not a target; use one of: cpu cuda12 tpu" in done.stderr
  assert not (sandbox / "log").exists()


# ---------------------------------------------------------------------------------------
# The pins
# ---------------------------------------------------------------------------------------

def test_accelerator_pins_match_the_base_jax_and_its_declared_extras():
  base = _pins("requirements.txt")
  jax_version = _version(base["jax"])
  assert _version(base["jaxlib"]) == jax_version
  try:
    declared = [Requirement(r) for r in metadata.requires("jax") or []]
    installed = metadata.version("jax")
  except metadata.PackageNotFoundError:
    pytest.skip("jax is not installed")
  if installed != jax_version:
    pytest.skip(f"jax {installed} is installed, the pins are for {jax_version}")
  for target, path in TARGET_FILES.items():
    pins = _pins(path)
    assert pins["jax"].extras == {target} and _version(pins["jax"]) == jax_version
    extra = [r for r in declared if r.marker and r.marker.evaluate({"extra": target})]
    names = {r.name.lower() for r in extra} - {"jaxlib", "requests"}
    assert names and names <= set(pins), (target, names, set(pins))
    for r in extra:  # every plugin jax[target] asks for is pinned inside its range
      if r.name.lower() in pins:
        assert r.specifier.contains(_version(pins[r.name.lower()])), (target, r)
  cuda = _pins(TARGET_FILES["cuda12"])
  assert _version(cuda["jax-cuda12-pjrt"]) == _version(cuda["jax-cuda12-plugin"]) == jax_version
  # libtpu: the one tests/requirements.txt pins for the XLA:TPU compile tests
  tests_libtpu = _pins("tests/requirements.txt")["libtpu"]
  assert _version(_pins(TARGET_FILES["tpu"])["libtpu"]) == _version(tests_libtpu)


def _available(name: str) -> list[str] | None:
  """Versions of `name` that pip finds for this interpreter (`pip index versions` reads the
  index pages only, no wheel); None when the index cannot be reached."""
  done = subprocess.run([sys.executable, "-m", "pip", "index", "versions", name,
                         "--disable-pip-version-check", "--timeout", "20"],
                        capture_output=True, text=True, timeout=180)
  found = re.search(r"Available versions: (.*)", done.stdout)
  if found:
    return [v.strip() for v in found.group(1).split(",")]
  if re.search(r"Could not fetch|NewConnectionError|Max retries|Temporary failure|timed out",
               done.stdout + done.stderr):
    return None
  return []


@pytest.mark.network
@pytest.mark.parametrize("target", sorted(TARGET_FILES))
def test_pip_finds_every_pinned_plugin_of_the_target(target):
  """Each pinned accelerator package has its pinned version on the index for this Python
  (a wheel for this interpreter and platform; the index pages only, nothing downloaded).
  Marked `network`: `make test` deselects it, so an index behind a proxy or TLS error
  cannot fail the suite."""
  for name, req in _pins(TARGET_FILES[target]).items():
    versions = _available(name)
    if versions is None:
      pytest.skip(f"the package index is unreachable (pip index versions {name}): "
                  "run where PyPI is reachable")
    assert _version(req) in versions, (name, _version(req), versions[:8])
