"""End to end with a critic: `algo=ppo` (estimator gae) and `algo=hiper` (estimator hae).

The real ALFWorld env server runs as a subprocess, the tiny model plays 4 ungrouped
tasks for 3 steps, the critic (a separate value model initialised from the policy)
gives the values, and both the actor and the critic are updated, checkpointed together
and restored exactly.
"""

import math
import os

import numpy as np
import orbax.checkpoint as ocp
import pytest

import checkpoint_arrays
from configs import alfworld as alfworld_config
from configs import webshop as webshop_config
from hgpo_jax import train
from hgpo_jax.advantages import hae
from hgpo_jax.training import experiment
from hgpo_jax.training import run_records

CRITIC_KEYS = ("critic/value_loss", "critic/value_clipfrac", "critic/explained_variance",
               "critic/grad_norm")


def _config(algo, **overrides):
  c = alfworld_config.get_config(f"algo={algo},model=tiny,smoke")
  with c.unlocked():
    c.mesh.data = 1
    c.update_from_flattened_dict(overrides)
  return c


def _metrics(workdir):
  return run_records.read_metrics(workdir)


def _deterministic(record):
  return {k: v for k, v in record.items() if not k.startswith(("time/", "env/", "perf/"))}  # wall-clock based


# ---------------------------------------------------------------------------- configs
def test_critic_configs_carry_the_published_settings():
  for module, env in ((alfworld_config, "alfworld"), (webshop_config, "webshop")):
    ppo = module.get_config("algo=ppo")
    hiper = module.get_config("algo=hiper")
    for c in (ppo, hiper):
      experiment.from_config(c)
      assert (c.rollout.num_groups, c.rollout.group_size) == (128, 1)  # 128 tasks, no grouping
      assert c.critic.lr == 1e-5 and c.critic.cliprange_value == 0.5
    assert ppo.algo.name == "gae" and ppo.rollout.response_format == "react"
    assert (ppo.algo.options.gamma, ppo.algo.options.lam, ppo.algo.options.multi_turn) == (1.0, 1.0, False)
    assert ppo.train.mini_batch_rows == (256 if env == "alfworld" else 64)  # both scripts
    assert hiper.algo.name == "hae" and hiper.rollout.response_format == "hiper"
    o = hiper.algo.options
    assert (o.gamma, o.lambda_turn, o.lambda_seg, o.norm_adv) == (1.0, 1.0, 0.95, True)
    assert (o.keep_penalty, o.keep_penalty_mode, o.keep_consistency_penalty, o.bootstrap_truncated) == (
        (-0.3, "normalised", -0.3, True) if env == "alfworld" else (-3.5, "normalised", -0.3, False))
    assert hiper.train.mini_batch_rows == 256
    smoke = module.get_config("algo=hiper,smoke")
    assert (smoke.rollout.num_groups, smoke.rollout.group_size) == (4, 1)
  assert hae.PUBLISHED_SETTINGS["alfworld"]["keep_penalty"] == -0.3


def test_hae_without_the_hiper_format_is_rejected():
  c = _config("ppo")
  with c.unlocked():
    c.algo.name = "hae"
    c.algo.options = alfworld_config.get_config("algo=hiper").algo.options
  with pytest.raises(train.ConfigError, match="response_format='hiper'"):
    experiment.from_config(c)


# ---------------------------------------------------------------------------- PPO end to end
@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("ppo"))
  out = train.train_and_evaluate(experiment.from_config(_config("ppo")), workdir)
  return workdir, out


@pytest.mark.slow
def test_ppo_trains_the_critic_and_checkpoints_it(ppo_run):
  workdir, _ = ppo_run
  lines = _metrics(workdir)
  assert [l["step"] for l in lines] == [1, 2, 3]
  for line in lines[:2]:
    for key in CRITIC_KEYS + ("critic/mean_value_token", "train/loss"):
      assert math.isfinite(line[key]), key
    assert line["critic/num_updates"] >= 1 and line["critic/learning_rate"] == pytest.approx(1e-5)
    # every response token is regressed: the critic scores as many tokens as the actor
    assert line["critic/scored_tokens"] == line["train/scored_tokens"]
  # the critic moved between the iterations (its first-iteration values differ)
  assert lines[0]["critic/mean_value_token"] != lines[1]["critic/mean_value_token"]
  meta = ocp.StandardCheckpointer().metadata(os.path.join(workdir, "checkpoints", "2", "state"))
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  assert set(tree["critic"]) == {"params", "opt_state", "step"}
  assert set(tree["critic"]["params"]) == {"backbone", "value_head", "value_bias"}
  assert tuple(tree["critic"]["params"]["value_head"].shape) == (1, 64)


@pytest.mark.slow
def test_ppo_resume_after_iteration_one_equals_uninterrupted(ppo_run, tmp_path):
  workdir, _ = ppo_run
  first = train.train_and_evaluate(
      experiment.from_config(_config("ppo", **{"train.num_iterations": 1, "eval.at_end": False})),
      str(tmp_path))
  assert first["start_iteration"] == 0
  second = train.train_and_evaluate(experiment.from_config(_config("ppo")), str(tmp_path))
  assert second["resume_source"] == "workdir" and second["start_iteration"] == 1
  a = [_deterministic(l) for l in _metrics(workdir)]
  b = [_deterministic(l) for l in _metrics(str(tmp_path))]
  assert any(k.startswith("critic/") for k in b[1])
  assert a == b  # iteration 2 depends on the restored critic (values, value loss) and actor


def test_critic_warmup_needs_a_critic_and_is_not_negative():
  c = alfworld_config.get_config("algo=grpo,model=tiny,smoke")
  with c.unlocked():
    c.critic.warmup_iterations = 1
  with pytest.raises(train.ConfigError, match="needs an estimator with a critic"):
    experiment.from_config(c)
  with pytest.raises(train.ConfigError, match="warmup_iterations must be >= 0"):
    experiment.from_config(_config("ppo", **{"critic.warmup_iterations": -1}))


@pytest.mark.slow
def test_critic_warmup_updates_only_the_critic_first(tmp_path):
  """verl's trainer.critic_warmup: iteration 1 trains the critic, the actor from 2 on."""
  workdir = str(tmp_path)
  train.train_and_evaluate(experiment.from_config(
      _config("ppo", **{"critic.warmup_iterations": 1, "train.num_iterations": 2,
                        "eval.at_end": False})), workdir)
  first, second = _metrics(workdir)
  assert first["train/actor_updated"] == 0.0 and second["train/actor_updated"] == 1.0
  assert not any(k.startswith(("train/loss", "perf/update")) for k in first)
  assert math.isfinite(second["train/loss"]) and second["train/num_updates"] >= 1
  assert first["critic/num_updates"] >= 1 and math.isfinite(first["critic/value_loss"])
  one, two = checkpoint_arrays.state_arrays(workdir, 1), checkpoint_arrays.state_arrays(workdir, 2)
  assert one["['step']"] == 0 and two["['step']"] >= 1  # actor optimizer steps
  assert one["['critic']['step']"] >= 1
  params = [k for k in one if k.startswith("['params']")]
  assert params and any(not np.array_equal(one[k], two[k]) for k in params)


# ---------------------------------------------------------------------------- HiPER end to end
@pytest.fixture(scope="module")
def hiper_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("hiper"))
  out = train.train_and_evaluate(experiment.from_config(_config("hiper", **{"rollout.dump": True})),
                                 workdir)
  return workdir, out


@pytest.mark.slow
def test_hiper_trains_a_three_head_critic(hiper_run):
  workdir, _ = hiper_run
  lines = _metrics(workdir)
  assert [l["step"] for l in lines] == [1, 2, 3]
  for line in lines[:2]:
    for key in CRITIC_KEYS + tuple(f"critic/mean_value_{h}" for h in hae.HEADS) + ("train/loss",):
      assert math.isfinite(line[key]), key
    for h in hae.HEADS:  # per-level explained variance, at most 1
      assert line[f"critic/explained_variance_{h}"] <= 1.0, h
    assert 0.0 <= line["rollout/subgoal_change_rate"] <= 1.0 and 0.0 <= line["rollout/switch_rate"] <= 1.0
    # one regressed entry per turn for low and term, plus one per segment start for high
    rows = line["rollout/num_rows"]
    assert rows * 2 <= line["critic/scored_tokens"] * line["critic/num_updates"] <= rows * 3
  meta = ocp.StandardCheckpointer().metadata(os.path.join(workdir, "checkpoints", "2", "state"))
  tree = getattr(meta, "item_metadata", meta)
  tree = getattr(tree, "tree", tree)
  assert tuple(tree["critic"]["params"]["value_head"].shape) == (3, 64)


@pytest.mark.slow
def test_hiper_dump_recomputes_the_trainers_advantages(hiper_run):
  """The dump carries switch, subgoal, token tags and the three read-out values; the
  registry estimator on the dump alone gives the trainer's advantages."""
  import jax
  from hgpo_jax.advantages import grouping, registry
  workdir, _ = hiper_run
  c = _config("hiper")
  for name in ("iter_000000.jsonl", "iter_000001.jsonl"):
    rows = run_records.read_jsonl(os.path.join(workdir, "rollouts", name))
    assert all(r["switch"] in ("KEEP", "SWITCH", None) for r in rows)
    assert all(len(r["token_tags"]) >= 1 and set(r["values"]) == set(hae.HEADS) for r in rows)
    est = registry.get("hae")
    fields = hae.hae_fields_from_dump(rows, num_tokens=c.rollout.max_new_tokens)
    g = grouping.build_row_batch(rows, gamma=c.algo.gamma, invalid_penalty=c.rollout.invalid_penalty,
                                 capacity=c.rollout.num_groups * c.env.max_steps, extra_fields=fields)
    out = est(jax.device_put(g.batch), est.options(**c.algo.options.to_dict()))
    adv = g.to_input_order(np.asarray(out.advantage))
    # the same jit program on the same inputs (dumped f32 values round-trip exactly)
    np.testing.assert_allclose(adv, [r["advantage"] for r in rows], rtol=1e-6, atol=1e-6)
    assert np.any(adv != 0)


@pytest.mark.slow
def test_hiper_resume_after_iteration_one_equals_uninterrupted(hiper_run, tmp_path):
  workdir, _ = hiper_run
  train.train_and_evaluate(experiment.from_config(
      _config("hiper", **{"train.num_iterations": 1, "eval.at_end": False, "rollout.dump": True})),
      str(tmp_path))
  second = train.train_and_evaluate(
      experiment.from_config(_config("hiper", **{"rollout.dump": True})), str(tmp_path))
  assert second["resume_source"] == "workdir" and second["start_iteration"] == 1
  a = [_deterministic(l) for l in _metrics(workdir)]
  b = [_deterministic(l) for l in _metrics(str(tmp_path))]
  assert a == b
