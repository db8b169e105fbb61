"""The training options through the whole trainer: two iterations of HGPO on text Sokoban
(tiny model, real env servers) with dynamic sampling on planted episode returns, GSPO,
token rollout importance weights with rejection, the KL in the reward with the adaptive
controller and a cosine learning rate; and a run stopped after its first iteration and
resumed equals it."""

import math

import numpy as np
import pytest

from configs import sokoban as sokoban_config
from hgpo_jax import train
from hgpo_jax.training import experiment
from hgpo_jax.training import run_records
from hgpo_jax.training import update_targets

# planted episode returns per generation batch (2 groups x 2 trajectories): batch 0 keeps
# group 1 only, batch 1 group 0 only -> 2 groups, 2 dropped, 2 batches per iteration
PLANTED = {0: [1.0, 1.0, 0.0, 1.0], 1: [0.0, 2.0, 3.0, 3.0]}


def _config():
  c = sokoban_config.get_config("algo=hgpo,k=2,smoke")
  with c.unlocked():
    c.mesh.data = 1
    c.eval.at_end = False
    c.update_from_flattened_dict({
        "train.filter_groups": True, "train.max_generation_batches": 3,
        "train.policy_loss": "gspo", "train.rollout_is": "token", "train.rollout_rs": "token",
        "train.kl_in_reward": True, "train.kl_ctrl": "adaptive", "train.kl_reward_coef": 0.001,
        "train.lr_schedule": "cosine"})
  return c


class Stop(Exception):
  """Raised by the planted rollout to stop a run before an iteration."""


def _run(workdir, stop_at=None):
  """The options run in `workdir` with planted returns; stops (raising Stop) when iteration
  `stop_at` starts. Returns (metric lines, [(iteration, batch, rollout)], [trained rows])."""
  played, trained = [], []
  real_batch, real_targets = train.generation_batch, update_targets.compute_targets

  def planted_batch(run, iteration, index):
    if iteration == stop_at:
      raise Stop()
    ro = real_batch(run, iteration, index)
    ro.returns = np.asarray(PLANTED[index], np.float32)
    played.append((iteration, index, ro))
    return ro

  def recording_targets(rows, run):
    trained.append([(r.group, r.task_id) for r in rows])
    return real_targets(rows, run)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(train, "generation_batch", planted_batch)
    mp.setattr(update_targets, "compute_targets", recording_targets)
    try:
      train.train_and_evaluate(experiment.from_config(_config()), workdir)
    except Stop:
      pass
  return run_records.read_metrics(workdir), played, trained


@pytest.fixture(scope="module")
def options_run(tmp_path_factory):
  return _run(str(tmp_path_factory.mktemp("options")))


@pytest.mark.slow
def test_options_run_end_to_end(options_run):
  lines, played, trained = options_run
  c = _config()
  assert [l["step"] for l in lines] == [1, 2]
  assert [(it, b) for it, b, _ in played] == [(0, 0), (0, 1), (1, 0), (1, 1)]
  for it, line in enumerate(lines):
    assert line["filter/groups_kept"] == 2 and line["filter/groups_dropped"] == 2
    assert line["filter/generation_batches"] == 2 and line["filter/groups_filled"] == 0
    # the update trained on exactly group 1 of batch 0 and group 0 of batch 1
    b0, b1 = played[2 * it][2], played[2 * it + 1][2]
    want = ([(0, r.task_id) for r in b0.rows if r.group == 1]
            + [(1, r.task_id) for r in b1.rows if r.group == 0])
    assert trained[it] == want
    assert line["rollout/num_rows"] == len(want)
    # float32 sampler and learner on CPU: no mismatch, weights 1, nothing rejected
    assert line["rollout_corr/k3_kl"] < 1e-8
    assert line["rollout_corr/ratio_fraction_high"] == 0.0
    assert line["train/rollout_is_weight"] == pytest.approx(1.0, abs=1e-4)
    assert line["train/rollout_rs_kept"] == pytest.approx(1.0)
    assert math.isfinite(line["train/loss"]) and line["train/pg_clipfrac_lower"] == 0.0
  # cosine over 2 iterations: lr, then lr * (1 + cos(pi / 2)) / 2
  assert lines[0]["train/learning_rate"] == pytest.approx(c.train.lr, rel=1e-6)
  assert lines[1]["train/learning_rate"] == pytest.approx(c.train.lr / 2, rel=1e-6)
  # adaptive coefficient: beta_2 = beta_1 (1 + clip(KL_1 / 0.1 - 1, +-0.2) n_1 / 10000)
  kl1, n1 = lines[0]["train/reward_kl"], lines[0]["rollout/num_rows"]
  assert lines[0]["train/reward_kl_coef"] == 0.001
  assert abs(kl1) < 1e-6  # the policy is still the reference at the first iteration
  want = 0.001 * (1 + float(np.clip(kl1 / 0.1 - 1, -0.2, 0.2)) * n1 / 10000)
  assert lines[1]["train/reward_kl_coef"] == pytest.approx(want, rel=1e-9)


@pytest.mark.slow
def test_resumed_options_run_equals_the_uninterrupted_one(options_run, tmp_path):
  lines, _, trained = options_run
  first, _, _ = _run(str(tmp_path), stop_at=1)
  assert [l["step"] for l in first] == [1]
  resumed, played, resumed_trained = _run(str(tmp_path))
  assert [(it, b) for it, b, _ in played] == [(1, 0), (1, 1)]
  assert resumed_trained == trained[1:]
  keep = lambda l: {k: v for k, v in l.items()
                    if not k.startswith(("time/", "env/")) and not k.endswith(("_flop_per_s", "_mfu"))}
  assert [keep(l) for l in resumed] == [keep(l) for l in lines]
