"""A retriever the env pool owns (`LocalServers.retriever_corpus`, the trainer's
`env.args.retriever='local'`): one `env_servers.retriever` process serves every env server
of the pool, searches equal the in-process env's, a killed retriever is restarted on its
port and the step it failed is played again, and closing the pool stops it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from configs import search as search_config
from env_servers.search import dataset
from env_servers.search import env as search_env
from hgpo_jax.envs import launcher
from hgpo_jax.envs import pool as pool_lib
from hgpo_jax.training import experiment
from hgpo_jax.training import run as run_lib

SEARCH_1 = "<search>Liorkexkuth Works</search>"
SEARCH_2 = "<search>Zethbaex Quimtirsiox</search>"


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
    return f.read().split()[2] != "Z"  # a zombie is dead


def _in_process(task_id: str, actions: list[str]) -> list[str]:
  env = search_env.SearchEnv()
  env.reset(options={"task_id": task_id})
  return [env.step(a)[0] for a in actions]


def test_one_owned_retriever_serves_the_pool_and_is_restarted_when_killed():
  servers = launcher.LocalServers("search", num_servers=2, retriever_corpus=dataset.corpus_path())
  with pool_lib.EnvPool(servers, num_slots=2) as pool:
    first_pid = pool.retriever_pid
    assert first_pid is not None and _alive(first_pid)
    tasks = pool.list_tasks("test")[:2]
    pool.reset(tasks, [0, 0], "test")
    one = pool.step([SEARCH_1, SEARCH_1])
    assert [r.observation for r in one] == [_in_process(t, [SEARCH_1])[0] for t in tasks]
    assert "<information>" in one[0].observation
    os.kill(first_pid, signal.SIGKILL)
    while _alive(first_pid):
      time.sleep(0.05)
    two = pool.step([SEARCH_2, SEARCH_2])  # both servers' steps fail, then run again
    assert [r.observation for r in two] == [_in_process(t, [SEARCH_1, SEARCH_2])[1]
                                            for t in tasks]
    assert not any(r.done for r in two)
    assert pool.retriever_pid not in (None, first_pid) and _alive(pool.retriever_pid)
    assert pool.metrics()["restarts"] == 1.0 and pool.metrics()["env_errors"] == 0.0
    last_pid = pool.retriever_pid
  assert not _alive(last_pid)  # closing the pool stopped it


def test_a_missing_corpus_is_a_clear_error_and_leaves_no_process(tmp_path):
  servers = launcher.LocalServers("search", retriever_corpus=str(tmp_path / "no_corpus.jsonl"))
  with pytest.raises(RuntimeError, match=r"^retriever \(pid \d+, exit code 2\) exited during "
                     r"start-up; its stderr ends with:\nretriever: .*no_corpus\.jsonl"):
    pool_lib.EnvPool(servers, num_slots=1)


def test_the_trainer_config_starts_a_local_retriever_and_refuses_it_with_endpoints():
  c = search_config.get_config("smoke")
  with c.unlocked():
    c.env.args.retriever = "local"
  pool = run_lib.make_pool(experiment.from_config(c).env, 1)
  try:
    assert pool.retriever_pid is not None and _alive(pool.retriever_pid)
  finally:
    pool.close()
  with c.unlocked():
    c.env.endpoints = ("127.0.0.1:1",)
  with pytest.raises(experiment.ConfigError, match="retriever='local' starts a retriever"):
    experiment.from_config(c)
