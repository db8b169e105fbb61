"""Rollout ahead of the update (`train.max_staleness`, hgpo_jax/training/async_rollout.py).

The thread is tested on its own with a stand-in player (the weights each batch is played
with, the bound on how far it runs ahead, the metrics, the versions a checkpoint keeps,
errors), then the trainer: `max_staleness=1` equals a synchronous loop whose iteration t
trains on the batch sampled with the weights after iteration t - 2, bit for bit; a run
resumed from a checkpoint with a batch played ahead equals an uninterrupted one; and bad
values are one line each.
"""

import threading

import jax.numpy as jnp
import pytest

from configs import sokoban as sokoban_config
from hgpo_jax import train
from hgpo_jax.training import async_rollout
from hgpo_jax.training import experiment
from hgpo_jax.training import run_records


# ------------------------------------------------------------------ the thread alone
@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_batch_is_played_with_the_weights_k_versions_back(k):
  played = []
  gate = threading.Event()

  def play(it, params):
    played.append((it, int(params)))
    return f"batch{it}"

  end = 7
  ahead = async_rollout.Rollouter(play, 0, end, k, {-1: jnp.asarray(-1)}, rebind=gate.set)
  try:
    for it in range(end):
      ro, m = ahead.take(it)
      assert ro == f"batch{it}"
      assert m["async/staleness"] == min(it, k) and m["async/learner_wait_s"] >= 0
      # nothing runs further ahead than the published weights allow
      assert max(i for i, _ in played) <= it + k
      ahead.publish(it, jnp.asarray(it))
  finally:
    ahead.close()
  assert played == [(it, max(it - 1 - k, -1)) for it in range(end)]
  assert [async_rollout.sampled_version(t, 0) for t in range(3)] == [-1, 0, 1]


def test_a_checkpoint_keeps_the_versions_of_the_batches_not_trained_yet():
  ahead = async_rollout.Rollouter(lambda it, p: it, 0, 10, 2, {-1: jnp.asarray(-1)},
                                  rebind=lambda: None)
  try:
    for it in range(4):
      ahead.take(it)
      ahead.publish(it, jnp.asarray(it))
    # after 4 iterations batches 4 and 5 are sampled with the weights after 1 and 2
    saved = ahead.pending_versions(4)
    assert {lag: int(p) for lag, p in saved.items()} == {"lag1": 2, "lag2": 1}
    back = async_rollout.restored_versions(saved, 4, 2, jnp.asarray(3))
    assert {v: int(p) for v, p in back.items()} == {1: 1, 2: 2, 3: 3}
    early = async_rollout.restored_versions({"lag1": jnp.asarray(-1), "lag2": jnp.asarray(-1)},
                                            1, 2, jnp.asarray(0))
    assert {v: int(p) for v, p in early.items()} == {-1: -1, 0: 0}
  finally:
    ahead.close()


def test_the_threads_error_reaches_the_learner_and_evaluation_pauses_it():
  rebound = []

  def play(it, params):
    if it == 1:
      raise RuntimeError("env server gone")
    return it

  ahead = async_rollout.Rollouter(play, 0, 5, 1, {-1: jnp.asarray(0)},
                                  rebind=lambda: rebound.append(True))
  try:
    assert ahead.take(0)[0] == 0
    with ahead.for_evaluation():
      assert rebound == [True]
    with pytest.raises(RuntimeError, match="env server gone"):
      ahead.take(1)
  finally:
    ahead.close()
  with pytest.raises(ValueError, match="max_staleness >= 1"):
    async_rollout.Rollouter(play, 0, 5, 0, {}, rebind=lambda: None)


# ------------------------------------------------------------------ the trainer
def _config(**overrides):
  c = sokoban_config.get_config("algo=hgpo,k=2,smoke")
  with c.unlocked():
    c.mesh.data = 1
    c.train.num_iterations = 3
    c.eval.every = 2
    c.update_from_flattened_dict(overrides)
  return c


def _deterministic(record):
  return {k: v for k, v in record.items()
          if not k.startswith(("time/", "env/", "async/")) and not k.endswith(
              ("_flop_per_s", "_mfu"))}


def _synchronous_reference(c, workdir, monkeypatch, lag):
  """Today's loop (max_staleness=0) in which iteration t's batch is played with the
  weights after iteration t - 1 - lag: the definition of max_staleness=lag."""
  versions = {}
  real_rollout, real_publish = train.rollout, async_rollout.Synchronous.publish

  def publish(self, iteration, params):
    versions[iteration] = async_rollout.copy_params(params)
    real_publish(self, iteration, params)

  def rollout(run, iteration):
    versions.setdefault(-1, async_rollout.copy_params(run.state.params))
    run.sampler.model = run.sampler_weights(
        versions[async_rollout.sampled_version(iteration, lag)])
    try:
      return real_rollout(run, iteration)
    finally:
      run.update_sampler()

  monkeypatch.setattr(train, "rollout", rollout)
  monkeypatch.setattr(async_rollout.Synchronous, "publish", publish)
  try:
    return train.train_and_evaluate(experiment.from_config(c), workdir)
  finally:
    monkeypatch.undo()


@pytest.fixture(scope="module")
def ahead_run(tmp_path_factory):
  """Three iterations with max_staleness=1 (a periodic evaluation after the second)."""
  workdir = str(tmp_path_factory.mktemp("ahead"))
  train.train_and_evaluate(experiment.from_config(_config(**{"train.max_staleness": 1})),
                           workdir)
  return run_records.read_metrics(workdir)


def test_one_step_off_policy_equals_its_synchronous_reference(ahead_run, tmp_path,
                                                              monkeypatch):
  _synchronous_reference(_config(), str(tmp_path / "ref"), monkeypatch, lag=1)
  a, r = ahead_run, run_records.read_metrics(str(tmp_path / "ref"))
  assert len(a) == len(r) == 4  # 3 iterations and the final evaluation
  assert [_deterministic(x) for x in a] == [_deterministic(x) for x in r]
  assert [x.get("async/staleness") for x in a[:3]] == [0.0, 1.0, 1.0]
  assert any(k.startswith("eval/") for k in a[1])  # the evaluation paused the thread
  # iteration 2's rows were sampled one version back: the learner's log-probs differ from
  # the sampler's (today's loop: equal up to rounding, |kl| < 1e-6 in iteration 1)
  assert abs(a[0]["rollout_corr/kl"]) < 1e-6 < abs(a[1]["rollout_corr/kl"])


def test_resume_with_a_batch_played_ahead_equals_an_uninterrupted_run(ahead_run, tmp_path):
  cut = str(tmp_path / "cut")
  train.train_and_evaluate(experiment.from_config(
      _config(**{"train.max_staleness": 1, "train.num_iterations": 2})), cut)
  out = train.train_and_evaluate(experiment.from_config(
      _config(**{"train.max_staleness": 1})), cut)
  assert (out["resume_source"], out["start_iteration"]) == ("workdir", 2)
  c = run_records.read_metrics(cut)
  assert [_deterministic(x) for x in ahead_run] == [_deterministic(x) for x in c]


def test_an_env_server_killed_while_the_thread_plays_recovers(ahead_run, tmp_path,
                                                             monkeypatch):
  """An env server SIGKILLed during a Step call the rollout thread makes (iteration 1's
  batch, played while iteration 0 updates) is restarted and its episodes replayed, as in a
  synchronous run: the metrics are the uninterrupted run's."""
  import os
  import signal
  import threading

  from hgpo_jax.envs import pool as pool_lib
  real_step, real_rollout, playing, killed = pool_lib.EnvPool.step, train.rollout, [], []

  def rollout(run, iteration, **kw):
    playing.append(iteration)
    return real_rollout(run, iteration, **kw)

  def step(self, actions):
    if threading.current_thread().name == "rollouter" and playing[-1] == 1 and not killed:
      killed.append(self.server_pids[0])  # the first Step of batch 1
      os.kill(killed[0], signal.SIGKILL)
    return real_step(self, actions)

  monkeypatch.setattr(train, "rollout", rollout)
  monkeypatch.setattr(pool_lib.EnvPool, "step", step)
  workdir = str(tmp_path / "killed")
  train.train_and_evaluate(experiment.from_config(
      _config(**{"train.max_staleness": 1, "rollout.dump": True})), workdir)
  got = run_records.read_metrics(workdir)
  assert killed and sum(x.get("env/restarts", 0) for x in got) >= 1
  assert [_deterministic(x) for x in got] == [_deterministic(x) for x in ahead_run]
  # each dumped row names the weights that sampled it: initial, initial, after iteration 0
  from hgpo_jax.advantages import dump
  versions = [{r["policy_version"] for r in dump.read_rows(
      os.path.join(workdir, "rollouts", f"iter_{it:06d}.jsonl"))} for it in range(3)]
  assert versions == [{-1}, {-1}, {0}]


def test_split_placement_equals_shared_placement(tmp_path):
  """The sampler on 4 devices of its own (the last 4 of the 8 fake CPU devices, the same
  data-parallel shape) and the learner on the first 4 give the metrics of both on the
  first 4, bit for bit, with the batch played ahead and without."""
  def metrics(name, **overrides):
    c = _config(**{"mesh.data": 4, "train.num_iterations": 2, "eval.every": 0, **overrides})
    train.train_and_evaluate(experiment.from_config(c), str(tmp_path / name))
    return run_records.read_metrics(str(tmp_path / name))

  for k in (1, 0):
    shared = metrics(f"shared{k}", **{"train.max_staleness": k})
    split = metrics(f"split{k}", **{"train.max_staleness": k, "mesh.rollout_devices": 4})
    assert len(split) == 3 and [_deterministic(x) for x in split] == [
        _deterministic(x) for x in shared]
    assert all(x["time/weight_transfer_s"] > 0 for x in split[:2])
    assert not any("time/weight_transfer_s" in x for x in shared)


def test_split_placement_runs_the_sampler_on_its_own_devices():
  import jax
  from hgpo_jax.training import programs
  from hgpo_jax.training import run as run_lib
  exp = experiment.from_config(_config(**{"mesh.data": -1, "mesh.rollout_devices": 2,
                                          "mesh.rollout_tensor": 2}))
  mesh = run_lib.make_mesh(exp.mesh)
  sampler = programs.sampling_mesh(exp.mesh, mesh, jax.local_devices(), 1)
  assert list(mesh.devices.flat) == jax.devices()[:6] and mesh.shape["data"] == 6
  assert list(sampler.devices.flat) == jax.devices()[6:]
  assert (sampler.shape["data"], sampler.shape["tensor"]) == (1, 2)


@pytest.mark.parametrize("mesh,match", [
    ({"mesh.rollout_devices": -1}, r"^config\.mesh\.rollout_devices=-1, .* need rollout_devices >= 0"),
    ({"mesh.rollout_devices": 3, "mesh.rollout_tensor": 2},
     r"^config\.mesh\.rollout_fsdp x rollout_tensor = 2 must divide config\.mesh\.rollout_devices=3"),
    ({"mesh.rollout_fsdp": 2}, r"^config\.mesh\.rollout_fsdp/rollout_tensor shape the sampler's own"),
    ({"mesh.data": -1, "mesh.rollout_devices": 8}, r"^config\.mesh\.rollout_devices=8 leaves none of a process's 8 devices"),
    ({"mesh.data": 6, "mesh.rollout_devices": 4},
     r"^config\.mesh 6x1x1 needs 6 devices besides the sampler's 4; 4 available"),
])
def test_bad_placements_are_one_line(mesh, match):
  from hgpo_jax.training import run as run_lib
  with pytest.raises(experiment.ConfigError, match=match) as e:
    run_lib.make_mesh(experiment.from_config(_config(**mesh)).mesh)
  assert "\n" not in str(e.value)


def test_dynamic_sampling_ahead_on_several_processes_is_one_line(monkeypatch):
  import types

  import jax
  exp = experiment.from_config(_config(**{"train.max_staleness": 1,
                                          "train.filter_groups": True}))
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(experiment.ConfigError, match=(
      r"^config\.train\.max_staleness=1 with config\.train\.filter_groups runs on one "
      r"process")) as e:
    train.rollout_source(types.SimpleNamespace(experiment=exp), 0, 3)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("arg,staleness,match", [
    ("algo=hgpo,k=2,smoke", -1, r"^config\.train\.max_staleness=-1 must be >= 0"),
    ("algo=ppo,smoke", 1,
     r"^config\.train\.max_staleness=1 plays rollouts ahead for critic-free estimators"),
])
def test_bad_values_are_one_line(arg, staleness, match):
  c = sokoban_config.get_config(arg)
  c.train.max_staleness = staleness
  with pytest.raises(experiment.ConfigError, match=match) as e:
    experiment.from_config(c)
  assert "\n" not in str(e.value)
