"""The fault-injection harness (`python -m tests.chaos`): its metrics comparison and
orphan scan, and (slow) a reduced chaos run of the real trainer."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import chaos

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _write(path, lines):
  path.write_text("".join(json.dumps(l) + "\n" for l in lines))
  return path


def _line(step, loss, **extra):
  return {"step": step, "train/loss": loss, "time/iteration_s": 1.0 + step,
          "env/restarts": 0.0, **extra}


def test_compare_ignores_only_timings_and_fault_counters(tmp_path):
  ref = _write(tmp_path / "ref.jsonl", [_line(1, 0.5), _line(2, 0.25)])
  same = _write(tmp_path / "same.jsonl", [dict(_line(1, 0.5), **{"time/iteration_s": 9.0,
                                                                  "env/restarts": 3.0}),
                                          _line(2, 0.25)])
  assert chaos.compare(ref, same, 2) == (True, [])
  off_by_an_ulp = _write(tmp_path / "ulp.jsonl", [_line(1, 0.5), _line(2, 0.25000000000000006)])
  assert chaos.compare(ref, off_by_an_ulp, 2) == (
      False, ["step 2: metrics differ in ['train/loss']"])
  extra_key = _write(tmp_path / "extra.jsonl", [_line(1, 0.5), _line(2, 0.25, **{"x/y": 1})])
  assert chaos.compare(ref, extra_key, 2)[1] == ["step 2: metrics differ in ['x/y']"]


def test_compare_finds_lost_and_duplicated_steps(tmp_path):
  ref = _write(tmp_path / "ref.jsonl", [_line(1, 0.5), _line(2, 0.25)])
  dup = _write(tmp_path / "dup.jsonl", [_line(1, 0.5), _line(1, 0.5), _line(2, 0.25)])
  equal, problems = chaos.compare(ref, dup, 2)
  assert not equal and problems == [f"{dup}: steps [1, 1, 2], expected 1..2 once each"]
  lost = _write(tmp_path / "lost.jsonl", [_line(2, 0.25)])
  equal, problems = chaos.compare(ref, lost, 2)
  assert not equal and problems == [f"{lost}: steps [2], expected 1..2 once each",
                                    "step 1: missing"]
  assert chaos.compare(ref, tmp_path / "missing.jsonl", 2) == (
      False, [f"{tmp_path / 'missing.jsonl'} is missing"])


def test_tagged_processes_are_found_through_their_environment():
  tag = "test-" + os.urandom(4).hex()
  child = subprocess.Popen([sys.executable, "-c", "import sys, time; print(flush=True); "
                            "time.sleep(30)"], stdout=subprocess.PIPE,
                           env=dict(os.environ, **{chaos.TAG_ENV: tag}))
  try:
    child.stdout.readline()  # the child runs Python: its exec (and environment) is done
    assert chaos.tagged_processes(tag) == [child.pid]
    assert chaos.tagged_processes(tag + "x") == []
  finally:
    child.kill()
    child.wait()
  assert chaos.tagged_processes(tag) == []


def test_table_lists_each_fault_kind():
  rows = {"env server SIGKILL during Reset/Step": {"injected": 12, "survived": 12, "orphans": 0},
          "corrupt latest checkpoint": {"injected": 1, "survived": 1, "orphans": 0}}
  assert chaos.table(rows, True).splitlines()[2:] == [
      "| env server SIGKILL during Reset/Step | 12 | 12 | yes | 0 |",
      "| corrupt latest checkpoint | 1 | 1 | yes | 0 |"]


@pytest.mark.slow
def test_reduced_chaos_run_loses_nothing(tmp_path):
  # Reference + 3 trainer processes (killed during a rollout, killed during the update,
  # then finishing) with env-server SIGKILL/SIGSTOP injected at most Reset/Step calls.
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)
  proc = subprocess.run([sys.executable, "-m", "tests.chaos", "--reduced", "--iterations", "2",
                         "--seed", "1", "--workdir", str(tmp_path / "chaos")], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
  rows = [l for l in proc.stdout.splitlines() if l.startswith("| ") and "injected" not in l]
  kinds = {l.split(" | ")[0][2:] for l in rows}
  assert {"trainer SIGKILL during rollout", "trainer SIGKILL during update"} <= kinds
  for l in rows:
    cells = [c.strip() for c in l.strip("|").split("|")]
    assert cells[1] == cells[2] and cells[3] == "yes" and cells[4] == "0", l
