"""A real env server subprocess (sokoban): exact transcripts, every kind of bad input,
isolation of env exceptions, no JAX, clean shutdown."""

import os
import pathlib
import signal
import subprocess
import sys
import time

import grpc
import pytest

from env_servers import base
from env_servers import protos
from env_servers import serve
from env_servers.protos import env_pb2
from env_servers.protos import env_pb2_grpc
from env_servers.sokoban import env as sokoban
from hgpo_jax.envs import launcher

TEST_ENVS_DIR = pathlib.Path(__file__).resolve().parent.parent / "envs"  # flaky_envs.py
SLOTS = 4


@pytest.fixture(name="server", scope="module")
def fixture_server():
  proc = launcher.start_servers("sokoban", [SLOTS], log_level="INFO")[0]
  channel = grpc.insecure_channel(proc.endpoint)
  yield proc, env_pb2_grpc.EnvStub(channel), channel
  channel.close()
  proc.stop()


@pytest.fixture(name="flaky_path")
def fixture_flaky_path(monkeypatch):
  monkeypatch.setenv("PYTHONPATH", str(TEST_ENVS_DIR))


def _reset(stub, slots, task_ids, split="train"):
  return stub.Reset(env_pb2.ResetRequest(slots=slots, task_ids=task_ids, seeds=[0] * len(slots),
                                         split=split), timeout=10).results


def _step(stub, slots, actions):
  raw = [a if isinstance(a, bytes) else a.encode() for a in actions]
  return stub.Step(env_pb2.StepRequest(slots=slots, actions=raw), timeout=10).results


def _code(call):
  with pytest.raises(grpc.RpcError) as e:
    call()
  return e.value.code(), e.value.details()


def test_describe_and_list_tasks(server):
  _, stub, _ = server
  d = stub.Describe(env_pb2.DescribeRequest(), timeout=10)
  assert (d.env_name, list(d.splits), d.num_slots, d.protocol_version) == (
      "sokoban", ["train", "test"], SLOTS, "1.0")
  tasks = stub.ListTasks(env_pb2.ListTasksRequest(split="test"), timeout=10).task_ids
  assert list(tasks) == sokoban.SokobanEnv().task_ids("test")
  assert _code(lambda: stub.ListTasks(env_pb2.ListTasksRequest(split="dev"), timeout=10)) == (
      grpc.StatusCode.INVALID_ARGUMENT, "unknown split 'dev'; sokoban splits: ['train', 'test']")


def test_walkthroughs_match_in_process_transcripts(server):
  _, stub, _ = server
  tasks = ["train-00000", "train-00001", "train-00002", "train-00003"]
  local = [sokoban.SokobanEnv() for _ in tasks]
  expected = [env.reset(seed=0, options={"task_id": t, "split": "train"}) for env, t in
              zip(local, tasks)]
  got = _reset(stub, [3, 2, 1, 0], tasks)
  for r, (obs, info), slot in zip(got, expected, [3, 2, 1, 0]):
    assert (r.slot, r.observation, r.anchor_obs) == (slot, obs, info[base.ANCHOR_OBS])
    assert list(r.admissible_actions) == info[base.ADMISSIBLE]
    assert r.info["walkthrough"] == info["walkthrough"]
    assert (r.reward, r.done, r.won) == (0.0, False, False)
  plans = [info["walkthrough"].split() for _, info in expected]
  wins = [False] * 4
  for t in range(max(map(len, plans))):
    active = [i for i in range(4) if t < len(plans[i]) and not wins[i]]
    if not active:
      break
    got = _step(stub, [3 - i for i in active], [plans[i][t] for i in active])
    for i, r in zip(active, got):
      obs, reward, terminated, _, info = local[i].step(plans[i][t])
      assert (r.observation, r.anchor_obs, r.reward, r.done, r.won) == (
          obs, info[base.ANCHOR_OBS], reward, terminated, info[base.WON])
      wins[i] = terminated
  assert wins == [True] * 4
  assert stub.Describe(env_pb2.DescribeRequest(), timeout=10).process["jax_imported"] == "false"


def test_bad_inputs_get_clear_statuses_and_the_server_keeps_serving(server):
  _, stub, channel = server
  _reset(stub, [0], ["train-00005"])
  env = sokoban.SokobanEnv()
  env.reset(seed=0, options={"task_id": "train-00005"})
  stub.Close(env_pb2.CloseRequest(slots=[1]), timeout=10)  # slot 1 back to never-reset
  ia, fp = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
  assert _code(lambda: _step(stub, [7], ["up"])) == (
      ia, f"slot 7: unknown slot; this server has slots 0..{SLOTS - 1}")
  assert _code(lambda: _step(stub, [-1], ["up"]))[1].startswith("slot -1: unknown slot")
  assert _code(lambda: _step(stub, [1], ["up"])) == (
      fp, "slot 1: step before reset; call Reset on it first")
  assert _code(lambda: _step(stub, [0, 0], ["up", "up"])) == (
      ia, "slot 0: listed twice in one call")
  assert _code(lambda: _step(stub, [0, 2], ["up"])) == (
      ia, "2 slots but 1 actions; send one per slot")
  assert _code(lambda: _step(stub, [0], [b"up\xff"])) == (
      ia, "slot 0: action is not valid UTF-8 (invalid start byte at byte 2); send UTF-8 text")
  assert _code(lambda: _reset(stub, [2], ["train-77777"])) == (
      ia, "slot 2: unknown task id 'train-77777' in split 'train'")
  # A string field that is not UTF-8 fails the parse: the server names the message.
  raw_reset = env_pb2.ResetRequest(slots=[2], task_ids=["train-0000X"], seeds=[0],
                                   split="train").SerializeToString().replace(b"X", b"\xfe")
  call_reset = channel.unary_unary("/hgpo_jax.env.v1.Env/Reset")
  code, details = _code(lambda: call_reset(raw_reset, timeout=10))
  assert code == ia and details.startswith("malformed ResetRequest:") and "UTF-8" in details
  call_step = channel.unary_unary("/hgpo_jax.env.v1.Env/Step")
  code, details = _code(lambda: call_step(b"\xff\xff\xff\xff", timeout=10))
  assert code == ia and details.startswith("malformed StepRequest:")
  # Over the 16 MiB message cap: gRPC itself refuses it.
  assert _code(lambda: _step(stub, [0], [b"u" * (17 * 2**20)]))[0] == (
      grpc.StatusCode.RESOURCE_EXHAUSTED)
  # Empty and 1 MB actions are invalid moves for the env, not errors.
  r = _step(stub, [0], [""])[0]
  assert r.observation.startswith("Invalid action ''") and not r.done
  r = _step(stub, [0], ["x" * 2**20])[0]
  assert r.observation.startswith("Invalid action 'xxxx") and r.info["action_truncated"] == "true"
  for action in ("", "x"):
    env.step(action)
  # Slot 0 went on exactly as an undisturbed env.
  obs, reward, terminated, _, _ = env.step("up")
  r = _step(stub, [0], ["up"])[0]
  assert (r.observation, r.reward, r.done) == (obs, reward, terminated)


def test_env_exception_stays_in_its_slot(flaky_path):
  del flaky_path
  proc = launcher.start_servers("flaky_envs:FlakyEnv", [3])[0]
  try:
    with grpc.insecure_channel(proc.endpoint) as channel:
      stub = env_pb2_grpc.EnvStub(channel)
      _reset(stub, [0, 1, 2], ["train-00000", "train-00001", "train-00002"])
      r0, r1, r2 = _step(stub, [0, 1, 2], ["up", "explode", "down"])
      assert r1.done and not r1.won and r1.info["error"] == "RuntimeError: boom"
      assert r1.observation == "[env error in step] RuntimeError: boom"
      assert not r0.done and "error" not in r0.info and "error" not in r2.info
      assert _code(lambda: _step(stub, [1], ["up"])) == (
          grpc.StatusCode.FAILED_PRECONDITION, "slot 1: slot must be reset (its env raised or "
          "a call was abandoned); call Reset on it first")
      assert not _step(stub, [0, 2], ["up", "up"])[0].info.get("error")
      assert _reset(stub, [1], ["train-00001"])[0].anchor_obs  # the slot works again
      assert len(_step(stub, [1], ["up"])) == 1
  finally:
    proc.stop()


def test_env_that_imports_jax_is_refused_with_a_clear_error(flaky_path):
  del flaky_path
  with pytest.raises(RuntimeError, match="must not import jax"):
    launcher.start_servers("flaky_envs:FlakyEnv", [1], env_args={"import_jax": True},
                           startup_timeout_s=60)


def test_startup_errors_are_reported_with_the_server_stderr():
  with pytest.raises(RuntimeError, match=r"exited during start-up(.|\n)*unknown env 'nope'"):
    launcher.start_servers("nope", [1])
  with pytest.raises(RuntimeError, match="rejected --env-arg"):
    launcher.start_servers("sokoban", [1], env_args={"colour": "red"})


def test_sigterm_stops_cleanly():
  proc = launcher.start_servers("sokoban", [1], log_level="INFO")[0]
  os.kill(proc.pid, signal.SIGTERM)
  assert proc.popen.wait(10) == 0
  # The stderr reader thread drains the last lines after the exit: wait for the line
  # (a generous deadline for a loaded machine), then assert it arrived.
  deadline = time.monotonic() + 30
  while "stopping (SIGTERM)" not in proc.stderr_tail() and time.monotonic() < deadline:
    time.sleep(0.02)
  assert "stopping (SIGTERM)" in proc.stderr_tail(), proc.stderr_tail()


def test_server_exits_when_its_parent_dies():
  # The parent starts a server, prints its pid and is then SIGKILLed (no atexit).
  code = ("from hgpo_jax.envs import launcher; import time; "
          "p = launcher.start_servers('sokoban', [1])[0]; print(p.pid, flush=True); "
          "time.sleep(60)")
  parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
  server_pid = int(parent.stdout.readline())
  assert _alive(server_pid)
  parent.kill()
  parent.wait()
  deadline = time.monotonic() + 10
  while _alive(server_pid) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not _alive(server_pid)


def _alive(pid: int) -> bool:
  """True while `pid` runs (a zombie, i.e. exited but not yet reaped, counts as gone)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().split(")")[-1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def test_abandoned_call_marks_its_slots_stale():
  # In-process SlotServer: the client's deadline passes after the first slot.
  core = serve.SlotServer("sokoban", 3)
  core.reset([0, 1, 2], ["train-00000"] * 3, [0, 0, 0], "train")
  calls = iter([True, False])
  with pytest.raises(serve.RequestError, match="abandoned by the client after 1 of 2 slots"):
    core.step([0, 1], [b"up", b"up"], is_active=lambda: next(calls))
  with pytest.raises(serve.RequestError, match="slot 0: slot must be reset"):
    core.step([0], [b"up"])
  assert len(core.step([2], [b"up"])) == 1  # untouched slots keep going
  assert core.reset([0, 1], ["train-00000"] * 2, [0, 0], "train")[0].anchor_obs
  assert len(core.step([0, 1], [b"up", b"up"])) == 2


def test_env_args_parse_as_json_or_text():
  assert serve.parse_env_args(["max_steps=30", "speedup=false", "data_dir=/x/y", "r=0.5",
                               "name=a=b"]) == {"max_steps": 30, "speedup": False,
                                                "data_dir": "/x/y", "r": 0.5, "name": "a=b"}
  with pytest.raises(ValueError, match="--env-arg 'max_steps' is not key=value"):
    serve.parse_env_args(["max_steps"])


def test_env_exception_outside_a_slot_is_internal_and_marked(flaky_path):
  # The env's task list raises: INTERNAL with the env-error trailing metadata, which the
  # client pool reads as "do not restart, raise" (tests/envs/test_pool.py).
  del flaky_path
  proc = launcher.start_servers("flaky_envs:BrokenCatalogEnv", [1])[0]
  try:
    with grpc.insecure_channel(proc.endpoint) as channel:
      stub = env_pb2_grpc.EnvStub(channel)
      with pytest.raises(grpc.RpcError) as e:
        stub.ListTasks(env_pb2.ListTasksRequest(split="test"), timeout=10)
      assert e.value.code() == grpc.StatusCode.INTERNAL
      assert e.value.details() == ("env error in ListTasks: OSError: task file test.json is "
                                   "missing")
      assert (protos.ENV_ERROR_METADATA, "1") in tuple(e.value.trailing_metadata())
      assert len(stub.ListTasks(env_pb2.ListTasksRequest(split="train"), timeout=10).task_ids)
  finally:
    proc.stop()


def test_step_latency_delays_every_step_and_nothing_else():
  """`--step-latency-ms` (a remote env's round trip, for launch.benchmarks.async_rollout):
  every Step call waits at least that long; the results are those of an undelayed server."""
  import time
  plain, slow = serve.SlotServer("sokoban", 2), serve.SlotServer("sokoban", 2,
                                                                 step_latency_s=0.25)
  for core in (plain, slow):
    core.reset([0, 1], ["train-00000"] * 2, [0, 0], "train")
  start = time.perf_counter()
  got = slow.step([0, 1], [b"up", b"left"])
  assert time.perf_counter() - start >= 0.25
  assert [r.observation for r in got] == [r.observation for r in plain.step([0, 1],
                                                                            [b"up", b"left"])]
  with pytest.raises(ValueError, match="--step-latency-ms must be >= 0, got -5"):
    serve.SlotServer("sokoban", 1, step_latency_s=-0.005)
  proc = launcher.ServerProcess("sokoban", 1, step_latency_ms=250)
  try:
    assert proc.cmd[-2:] == ["--step-latency-ms", "250"]
  finally:
    proc.stop()
