"""No silent CPU fallback: `launch.main` prints the platform first and refuses, in one line,
a config meant for accelerators when JAX found only CPUs (`experiment.cpu_refusal`)."""

import os
import re
import socket
import subprocess
import sys

import pytest

from configs import alfworld, sokoban, webshop
from hgpo_jax.training import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**overrides):
  c = sokoban.get_config("smoke")
  c.unlock()
  c.update_from_flattened_dict(overrides)
  return c


def _experiment(**overrides):
  return experiment.from_config(_config(**overrides))


def test_every_config_family_has_allow_cpu_off():
  for family in (alfworld, sokoban, webshop):
    assert family.get_config("smoke").allow_cpu is False


def test_cpu_refusal_names_each_reason_and_the_way_out(tmp_path):
  weights = str(tmp_path)  # an existing directory: the preset's weights would load
  cpu = dict(platform="cpu", num_devices=2, distributed=False)
  assert experiment.cpu_refusal(_experiment(), **cpu) is None  # the smoke run is CPU-sized
  assert experiment.cpu_refusal(_experiment(**{"mesh.data": 2}), **cpu) is None  # fits 2 devices
  line = experiment.cpu_refusal(
      _experiment(**{"mesh.data": 1, "mesh.fsdp": 4, "mesh.tensor": 2}), **cpu)
  assert line == ("config.mesh asks for 8 devices (fsdp 4 x tensor 2), but JAX found "
                  "only CPUs (2 devices): install JAX for the accelerator (make venv "
                  "ACCEL=cuda12 or ACCEL=tpu) or pass --config.allow_cpu=true to run on the CPUs")
  big = _experiment(**{"model.name": "qwen2.5-7b", "model.path": weights, "mesh.fsdp": 4})
  line = experiment.cpu_refusal(big, **dict(cpu, distributed=True, num_devices=1))
  assert line.startswith("model qwen2.5-7b is meant for accelerators; config.mesh asks for 4 "
                         "devices (fsdp 4); --distributed starts a multi-host run, but JAX found "
                         "only CPUs (1 device):")
  # A path that does not exist fails on its own line when the model loads.
  missing = _experiment(**{"model.name": "qwen2.5-1.5b", "model.path": str(tmp_path / "nope")})
  assert experiment.cpu_refusal(missing, **cpu) is None
  # The same configs on accelerators, or with allow_cpu, are not refused.
  for platform in ("gpu", "tpu"):
    assert experiment.cpu_refusal(big, platform=platform, num_devices=1, distributed=True) is None
  allowed = _experiment(**{"model.name": "qwen2.5-7b", "model.path": weights, "allow_cpu": True})
  assert experiment.cpu_refusal(allowed, **dict(cpu, distributed=True)) is None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.parametrize("case", ["mesh", "preset", "distributed"])
def test_launch_main_refuses_a_pod_config_on_cpu_in_one_line(tmp_path, case):
  args = {"mesh": ["--config.mesh.fsdp=64"],  # more than the suite's fake CPU devices
          "preset": ["--config.model.name=qwen2.5-1.5b", f"--config.model.path={tmp_path}"],
          "distributed": ["--distributed=explicit", "--num_processes=1", "--process_id=0",
                          f"--coordinator_address=127.0.0.1:{_free_port()}"]}[case]
  cmd = [sys.executable, "-m", "launch.main", "--config=configs/sokoban.py:smoke",
         f"--workdir={tmp_path / 'run'}", *args]
  proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2, proc.stderr[-2000:]
  first = re.match(r"launch.main: platform cpu \(cpu\), (\d+) local / (\d+) global devices, "
                   r"process 0/1, jax \S+, compute float32, XLA:CPU numerics default\n", proc.stdout)
  assert first and first[1] == first[2], proc.stdout
  err = proc.stderr
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert err.startswith("launch.main: error: "), err
  n = int(first[1])
  assert f"but JAX found only CPUs ({n} device{'s' if n > 1 else ''})" in err, err
  assert "--config.allow_cpu=true" in err, err
  assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")  # nothing ran


def test_cpu_numerics_setting_is_printed_and_an_unknown_one_refused_in_one_line(tmp_path):
  """`--cpu_numerics` names the run's XLA:CPU setting on the platform line; an unknown
  $HGPO_JAX_CPU_NUMERICS ends the run before any work in one line."""
  cmd = [sys.executable, "-m", "launch.main", "--config=configs/sokoban.py:smoke",
         f"--workdir={tmp_path / 'run'}", "--config.mesh.fsdp=64"]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run(cmd + ["--cpu_numerics=host_math"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and ", XLA:CPU numerics host_math\n" in proc.stdout, proc.stdout
  proc = subprocess.run(cmd, cwd=ROOT, env=dict(env, HGPO_JAX_CPU_NUMERICS="fast"),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2 and proc.stdout == "", proc.stdout
  assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert proc.stderr.startswith("launch.main: error: CPU numerics setting 'fast'"), proc.stderr
