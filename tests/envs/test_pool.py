"""EnvPool over real sokoban server processes: exact transcripts on one and two
servers, recovery from a killed (SIGKILL) or hung (SIGSTOP) server without lost or
duplicated steps, endpoints the pool does not own, and no orphan processes."""

import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from env_servers import base
from env_servers.sokoban import env as sokoban
from hgpo_jax.envs import launcher
from hgpo_jax.envs import pool as pool_lib

TEST_ENVS_DIR = str(pathlib.Path(__file__).resolve().parent)  # flaky_envs.py
TASKS = ["train-00010", "train-00011", "train-00012"] * 2  # G=3 tasks x N=2
SEEDS = [7] * len(TASKS)
MOVES = list(sokoban.MOVES)


def _actions(step: int, latest) -> list:
  """A fixed random policy: the same action for a given (step, slot) in every run;
  None (skip) once the slot's episode is over."""
  rng = random.Random(1000 + step)
  return [None if r.done else rng.choice(MOVES + ["jump"]) for r in latest]


def _row(latest):
  return [(r.observation, r.reward, r.done, r.won) for r in latest]


def _play(pool, steps, on_step=None):
  """Resets all slots, runs `steps` steps of the fixed policy; returns the transcript
  (per step, per slot: the slot's latest (observation, reward, done, won))."""
  latest = pool.reset(TASKS, SEEDS, "train")
  transcript = [_row(latest)]
  for t in range(steps):
    if on_step:
      on_step(t, pool)
    stepped = pool.step(_actions(t, latest))
    latest = [new if new is not None else old for new, old in zip(stepped, latest)]
    transcript.append(_row(latest))
  return transcript


def _reference(steps):
  """The same episodes on in-process envs."""
  envs = [sokoban.SokobanEnv() for _ in TASKS]
  latest = []
  for env, task, seed in zip(envs, TASKS, SEEDS):
    obs, _ = env.reset(seed=seed, options={"task_id": task, "split": "train"})
    latest.append(base.StepResult(obs, "", [], 0.0, False, False))
  transcript = [_row(latest)]
  for t in range(steps):
    for i, action in enumerate(_actions(t, latest)):
      if action is not None:
        obs, reward, terminated, truncated, info = envs[i].step(action)
        latest[i] = base.StepResult(obs, "", [], reward, terminated or truncated,
                                    info[base.WON])
    transcript.append(_row(latest))
  return transcript


STEPS = 12
REFERENCE = _reference(STEPS)


def test_reference_policy_is_not_trivial():
  # Episodes end at different steps (slots 0 and 2 at step 2, 4 and 5 at step 9) and
  # slot 1 wanders: recovery must handle finished and running episodes alike.
  assert [t for t, row in enumerate(REFERENCE) if row[4][2]][0] == 9
  assert [d for _, _, d, _ in REFERENCE[-1]] == [True, False, True, False, True, True]
  assert len({row[1][0] for row in REFERENCE}) > 3


def test_two_servers_serve_one_pool_exactly():
  with pool_lib.EnvPool(launcher.LocalServers("sokoban", num_servers=2), len(TASKS)) as pool:
    assert len(set(pool.endpoints)) == 2 and len(pool.server_pids) == 2
    assert pool.describe.env_name == "sokoban"
    assert pool.list_tasks("test") == sokoban.SokobanEnv().task_ids("test")
    assert _play(pool, STEPS) == REFERENCE
    m = pool.metrics()
    assert (m["restarts"], m["failed_calls"], m["replayed_episodes"]) == (0, 0, 0)
    assert m["step_latency_ms_p50"] > 0


def test_step_arguments_are_checked():
  with pool_lib.EnvPool(launcher.LocalServers("sokoban"), 2) as pool:
    with pytest.raises(ValueError, match="slot 0: never reset"):
      pool.step(["up", None])
    results = pool.reset(["train-00000"] * 2, [0, 0], "train")
    assert pool.step([None, None]) == [None, None]
    with pytest.raises(ValueError, match="step needs 2 actions"):
      pool.step(["up"])
    out = pool.step(["up", None])
    assert out[1] is None and out[0].anchor_obs != results[0].anchor_obs
    assert pool.step(["right", None])[0].won  # train-00000 is solved by "up right"
    with pytest.raises(ValueError, match="slot 0: episode is over"):
      pool.step(["up", "up"])
    with pytest.raises(pool_lib.EnvPoolError, match="unknown task id 'train-55555'"):
      pool.reset(["train-55555", "train-00000"], [0, 0], "train")


DEADLINE_S = 6.0


@pytest.mark.parametrize("failure", ["SIGKILL", "SIGSTOP"])
def test_dead_or_hung_server_is_recovered_without_lost_or_duplicated_steps(failure):
  victims = []

  def break_server(t, pool):
    if t == 5:
      pid = pool.server_pids[1]
      victims.append(pid)
      os.kill(pid, getattr(signal, failure))
      # Signals are asynchronous: wait until it took effect, or step 5 may be served.
      deadline = time.monotonic() + 5
      while _state(pid) not in ("T", "Z", "gone") and time.monotonic() < deadline:
        time.sleep(0.005)

  # The deadline is what detects the SIGSTOPped server. On a loaded machine a healthy call
  # can also wait past it and be restarted and replayed; that changes no step, so the
  # transcript equal to the reference (no step lost or applied twice) is the claim, with at
  # least the broken server's restart, and the exact replay counts when it was the only one.
  with pool_lib.EnvPool(launcher.LocalServers("sokoban", num_servers=2), len(TASKS),
                        deadline_s=DEADLINE_S) as pool:
    assert _play(pool, STEPS, on_step=break_server) == REFERENCE
    m = pool.metrics()
    pids = pool.server_pids
  assert victims[0] not in pids
  assert m["restarts"] >= 1 and m["failed_calls"] >= m["restarts"]
  # Server 1 hosts slots 3..5; the unfinished ones were replayed up to step 5.
  unfinished = [i for i in range(3, 6) if not REFERENCE[5][i][2]]
  replayed_steps = sum(sum(1 for t in range(5) if not REFERENCE[t][i][2]) for i in unfinished)
  assert m["replayed_episodes"] >= len(unfinished)
  assert m["replayed_steps"] >= replayed_steps
  if m["restarts"] == 1:
    assert (m["failed_calls"], m["replayed_episodes"], m["replayed_steps"]) == (
        1, len(unfinished), replayed_steps)
  if failure == "SIGSTOP":
    assert m["step_latency_ms_max"] >= 1000 * DEADLINE_S  # waited for the deadline
  assert not any(_alive(p) for p in victims + pids)


def test_endpoints_not_owned_are_retried_then_fail_clearly():
  procs = launcher.start_servers("sokoban", [3, 3])
  try:
    with pool_lib.EnvPool([p.endpoint for p in procs], len(TASKS), deadline_s=2,
                          max_retries=2, backoff_s=0.05) as pool:
      assert pool.server_pids == []
      pool.reset(TASKS, SEEDS, "train")
      pool.step(["jump"] * len(TASKS))
      procs[0].kill()
      with pytest.raises(pool_lib.EnvPoolError,
                         match=rf"{procs[0].endpoint}: Step failed 3 times, last with "
                         r"UNAVAILABLE.*check that the server is running"):
        pool.step(["jump"] * len(TASKS))
      assert pool.metrics()["failed_calls"] == 3
      with pytest.raises(ValueError, match="slot 0: never reset .or the last step call failed"):
        pool.step(["jump"] * len(TASKS))
  finally:
    for p in procs:
      p.stop()


def test_unreachable_endpoint_fails_at_construction():
  with pytest.raises(pool_lib.EnvPoolError,
                     match=r"127.0.0.1:1: Describe failed 2 times, last with UNAVAILABLE"):
    pool_lib.EnvPool(["127.0.0.1:1"], 2, max_retries=1, backoff_s=0.01)
  with pytest.raises(TypeError, match="pass a list of endpoints"):
    pool_lib.EnvPool("127.0.0.1:1", 2)


def test_endpoint_restarted_by_someone_else_is_replayed():
  original = launcher.start_servers("sokoban", [len(TASKS)])[0]
  replacement = []

  def restart_server(t, pool):
    del pool
    if t == 4:
      original.kill()
      # Someone else (a supervisor) brings it back on the same port a moment later.
      threading.Timer(0.3, lambda: replacement.append(
          launcher.ServerProcess("sokoban", len(TASKS), port=original.port))).start()

  try:
    with pool_lib.EnvPool([original.endpoint], len(TASKS), deadline_s=5, max_retries=4,
                          backoff_s=0.5) as pool:
      assert _play(pool, STEPS, on_step=restart_server) == REFERENCE
      m = pool.metrics()
    assert m["restarts"] == 0 and m["failed_calls"] >= 1
    assert m["replayed_episodes"] == sum(not d for _, _, d, _ in REFERENCE[4])
  finally:
    for proc in replacement:
      proc.stop()


def test_env_exceptions_fail_fast_without_restarts(monkeypatch):
  # An exception inside an env is the env's bug, not a server failure: one clear error
  # naming slot, task and exception; the server is neither restarted nor replayed.
  monkeypatch.setenv("PYTHONPATH", TEST_ENVS_DIR)
  with pool_lib.EnvPool(launcher.LocalServers("flaky_envs:FlakyEnv", num_servers=2), 4) as pool:
    pool.reset(["train-00001", "train-00002", "train-00003", "train-00004"], [5] * 4, "train")
    pool.step(["down"] * 4)
    pids = pool.server_pids
    with pytest.raises(pool_lib.EnvError, match=re.escape(
        "slot 2: the env raised in step 2 (action 'explode') of task 'train-00003' (split "
        "'train', seed 5): RuntimeError: boom; fix the env (the server log has the traceback)")):
      pool.step(["up", None, "explode", "up"])
    m = pool.metrics()
    assert (m["restarts"], m["failed_calls"], m["replayed_episodes"], m["env_errors"]) == (
        0, 0, 0, 1)
    assert pool.server_pids == pids
  # Raising outside any slot (the env's task list): INTERNAL marked as the env's error.
  with pool_lib.EnvPool(launcher.LocalServers("flaky_envs:BrokenCatalogEnv"), 2) as pool:
    assert len(pool.list_tasks("train")) == 1000
    with pytest.raises(pool_lib.EnvError, match=r"127.0.0.1:\d+: env error in ListTasks: "
                       r"OSError: task file test.json is missing; fix the env"):
      pool.list_tasks("test")
    m = pool.metrics()
    assert (m["restarts"], m["failed_calls"]) == (0, 1)
  # An env output the server cannot convert becomes that slot's env error.
  with pool_lib.EnvPool(launcher.LocalServers("flaky_envs:UnprintableEnv"), 2) as pool:
    pool.reset(["train-00001"] * 2, [0, 0], "train")
    with pytest.raises(pool_lib.EnvError, match=r"slot 1: the env raised in step 1 \(action "
                       r"'render'\).*ValueError: observation cannot be rendered"):
      pool.step(["down", "render"])
    assert pool.metrics()["restarts"] == 0


def test_non_deterministic_envs_are_not_replayed(monkeypatch):
  monkeypatch.setenv("PYTHONPATH", TEST_ENVS_DIR)
  with pool_lib.EnvPool(launcher.LocalServers("flaky_envs:DriftingEnv"), 2) as pool:
    pool.reset(["train-00001"] * 2, [0, 0], "train")
    pool.step(["down", "down"])
    os.kill(pool.server_pids[0], signal.SIGKILL)
    with pytest.raises(pool_lib.EnvPoolError, match="slot 0: replaying task 'train-00001'.*"
                       "not deterministic"):
      pool.step(["up", "up"])


def test_no_orphans_after_close_or_when_the_parent_is_killed():
  with pool_lib.EnvPool(launcher.LocalServers("sokoban", num_servers=2), 4) as pool:
    pids = pool.server_pids
    assert all(_alive(p) for p in pids)
  assert not any(_alive(p) for p in pids)
  code = ("from hgpo_jax.envs import launcher, pool; import time; "
          "p = pool.EnvPool(launcher.LocalServers('sokoban', num_servers=2), 4); "
          "print(*p.server_pids, flush=True); time.sleep(60)")
  parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  pids = [int(x) for x in parent.stdout.readline().split()]
  assert len(pids) == 2 and all(_alive(p) for p in pids)
  parent.kill()
  parent.wait()
  deadline = time.monotonic() + 10
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(_alive(p) for p in pids)


def test_pool_never_imports_jax():
  code = ("import sys; from hgpo_jax.envs import pool, launcher; "
          "p = pool.EnvPool(launcher.LocalServers('sokoban'), 2); "
          "p.reset(['train-00000'] * 2, [0, 0], 'train'); p.step(['up', 'up']); p.close(); "
          "print('jax' in sys.modules)")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       check=True)
  assert out.stdout.strip() == "False"


def _state(pid: int) -> str:
  """The /proc state letter of `pid` (R, S, T = stopped, Z = zombie) or "gone"."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0]
  except FileNotFoundError:
    return "gone"


def _alive(pid: int) -> bool:
  """True while `pid` runs (a zombie, i.e. exited but not yet reaped, counts as gone)."""
  return _state(pid) not in ("Z", "gone")
