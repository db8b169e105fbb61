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
