"""The search env through a real env server subprocess: scripted episodes (the right
answer scores 1, a wrong one 0, the turn limit truncates), transcripts equal to the
in-process env, and an env server whose retriever server dies: that slot's error, never an
empty search result."""

import signal
import subprocess
import sys

import grpc
import pytest

from env_servers import base
from env_servers.protos import env_pb2
from env_servers.protos import env_pb2_grpc
from env_servers.search import env as search_env
from hgpo_jax.envs import launcher

SEARCH_1 = "<search>Liorkexkuth Works</search>"
SEARCH_2 = "<search>Zethbaex Quimtirsiox</search>"


@pytest.fixture(name="stub", scope="module")
def fixture_stub():
  proc = launcher.start_servers("search", [3])[0]
  channel = grpc.insecure_channel(proc.endpoint)
  yield env_pb2_grpc.EnvStub(channel)
  channel.close()
  proc.stop()


def _reset(stub, task_ids):
  request = env_pb2.ResetRequest(slots=list(range(len(task_ids))), task_ids=task_ids,
                                 seeds=[0] * len(task_ids), split="test")
  return stub.Reset(request, timeout=30).results


def _step(stub, slots, actions):
  return stub.Step(env_pb2.StepRequest(slots=slots, actions=[a.encode() for a in actions]),
                   timeout=30).results


def test_scripted_episodes_over_grpc(stub):
  first = _reset(stub, ["test-0001", "test-0001", "test-0001"])
  assert [r.observation for r in first] == [
      "In which city was the founder of Liorkexkuth Works born?"] * 3
  assert first[0].info["task"] == first[0].observation
  a = _step(stub, [0, 1, 2], [SEARCH_1, SEARCH_1, "<search>Kiostel</search>"])
  assert a[0].anchor_obs == a[1].anchor_obs != a[2].anchor_obs  # GiGPO's anchor groups
  assert a[0].observation.startswith("<information>Doc 1(Title: Liorkexkuth Works)")
  b = _step(stub, [0, 1, 2], [SEARCH_2, SEARCH_2, SEARCH_2])
  assert b[0].anchor_obs == b[1].anchor_obs and "city of Ruvin" in b[0].observation
  c = _step(stub, [0, 1, 2], ["<answer>Ruvin</answer>", "<answer>Kiostel</answer>", "nothing"])
  assert [(r.reward, r.done, r.won) for r in c] == [(1.0, True, True), (0.0, True, False),
                                                    (0.0, False, False)]
  assert c[0].info["f1"] == "1.0" and c[2].info["action_valid"] == "False"
  d = _step(stub, [2], [SEARCH_1])  # the 4th turn: the turn limit
  assert (d[0].done, d[0].reward, d[0].info.get(base.TRUNCATED)) == (True, 0.0, "true")


def test_served_transcript_equals_in_process(stub):
  actions = [SEARCH_1, "bad", SEARCH_2, "<answer>the Dafil</answer>"]
  served = [_reset(stub, ["test-0001"])[0]]
  served += [_step(stub, [0], [a])[0] for a in actions]
  env = search_env.SearchEnv()
  local = [env.reset(options={"task_id": "test-0001"})]
  local += [env.step(a) for a in actions]
  for s, l in zip(served, local):
    obs, info = l[0], l[-1]
    assert (s.observation, s.anchor_obs) == (obs, info[base.ANCHOR_OBS])
  assert served[-1].reward == local[-1][1] == 1.0


def _start_retriever(port=0):
  proc = subprocess.Popen([sys.executable, "-m", "env_servers.retriever", "--port", str(port)],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
  line = proc.stdout.readline()
  assert line.startswith("PORT "), line
  return proc, int(line.split()[1])


def test_env_server_over_a_retriever_server_that_dies():
  retriever, port = _start_retriever()
  env_server = launcher.start_servers(
      "search", [1], {"retriever": f"127.0.0.1:{port}", "retriever_timeout_s": 1,
                      "retriever_tries": 2})[0]
  channel = grpc.insecure_channel(env_server.endpoint)
  stub = env_pb2_grpc.EnvStub(channel)
  try:
    _reset(stub, ["test-0001"])
    ok = _step(stub, [0], [SEARCH_1])[0]
    local = search_env.SearchEnv()
    local.reset(options={"task_id": "test-0001"})
    assert ok.observation == local.step(SEARCH_1)[0]  # remote retrieval = in-process retrieval
    retriever.kill()
    retriever.wait()
    dead = _step(stub, [0], [SEARCH_2])[0]
    assert dead.done and dead.observation.startswith(
        f"[env error in step] RetrieverError: retriever at 127.0.0.1:{port} did not answer")
    assert "\n" not in dead.info[base.ERROR]
    retriever, _ = _start_retriever(port)  # back: the slot is reset and plays on
    _reset(stub, ["test-0001"])
    again = _step(stub, [0], [SEARCH_1])[0]
    assert again.observation == ok.observation and not again.done
  finally:
    channel.close()
    env_server.stop()
    retriever.send_signal(signal.SIGTERM)
    retriever.wait(timeout=20)
