"""The sampler/learner mismatch metrics and dynamic sampling's group selection.

The mismatch: the sampler's log-probs (`SampleOutput.logprobs`) against the learner's on
the same tokens (`Learner.compute_logprobs`), on the tiny model: ~0 when both compute in
float32, not when the sampler computes in bfloat16. Dynamic sampling: the host functions
of hgpo_jax/rollout/rollout.py on planted episode outcomes (verl-agent
`filter_group_data`: a group whose episode rewards are all equal is dropped).
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config, decoder, sharding, tokenizer
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.sampling import SamplingParams
from hgpo_jax.sampling import sampler as sampler_lib
from hgpo_jax.training import experiment, losses, train_batch, train_step

PROMPTS = ["go to cabinet 1", "You are in the middle of a room.", "open drawer 2",
           "put a clean apple in the fridge"]


def _mismatch(compute_dtype: str) -> dict[str, float]:
  """rollout_corr metrics of 4 sampled responses: sampler in `compute_dtype`, learner f32."""
  tok = tokenizer.tiny_tokenizer()
  model = decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh(1, 1, 1, devices=fake_devices.take(1))
  learner = train_step.Learner(model, mesh, train_step.UpdateConfig(mini_batch_rows=4,
                                                                    micro_batch_rows=4))
  state = learner.init_state(nnx.state(model, nnx.Param))
  played = nnx.merge(*nnx.split(model))
  played.cfg = model.cfg.replace(dtype=compute_dtype)
  smp = sampler_lib.Sampler(played, tok, prompt_buckets=(32,), batch_buckets=(4,),
                            cache_dtype=compute_dtype)
  prompts = [tok.encode(p) for p in PROMPTS]
  out = smp.generate(prompts, SamplingParams(max_new_tokens=12), jax.random.key(3))
  batch, _ = train_batch.build_train_batch(prompts, out.tokens, np.zeros(4, np.float32),
                                           prompt_buckets=(32,), response_buckets=(12,),
                                           row_multiple=4)
  batch = train_batch.with_rollout_logprobs(batch, out.logprobs)
  logp = np.asarray(learner.compute_logprobs(state.params, learner.lay_out(learner.put_batch(batch))))
  tail = lambda x: np.asarray(x)[:, -logp.shape[1]:]
  # the rollout log-probs sit on the response tokens, as many as the sampler gave
  assert np.count_nonzero(tail(batch.rollout_logprobs)) == sum(len(t) for t in out.tokens)
  return losses.mismatch_metrics(logp, tail(batch.rollout_logprobs), tail(batch.response_mask), 2.0)


def test_mismatch_metrics_are_zero_when_sampler_and_learner_compute_alike():
  m = _mismatch("float32")
  assert abs(m["kl"]) < 1e-5 and abs(m["log_ratio_mean"]) < 1e-5 and m["k3_kl"] < 1e-8
  assert m["ratio_q05"] == pytest.approx(1.0, abs=1e-4)
  assert m["ratio_q95"] == pytest.approx(1.0, abs=1e-4)
  assert m["ratio_fraction_high"] == 0.0 and m["seq_ratio_fraction_high"] == 0.0


def test_mismatch_metrics_see_a_bfloat16_sampler():
  m = _mismatch("bfloat16")
  assert m["k3_kl"] > 1e-6
  assert m["ratio_q95"] - m["ratio_q05"] > 1e-3


def test_mismatch_metrics_equal_their_formulas():
  rng = np.random.default_rng(0)
  learner = -rng.random((3, 5)) * 2
  rollout = learner + rng.normal(size=(3, 5)) * 0.5
  mask = rng.random((3, 5)) < 0.8
  m = losses.mismatch_metrics(learner, rollout, mask, 1.5)
  r = np.exp(learner - rollout)[mask]
  assert m["kl"] == pytest.approx(np.mean((rollout - learner)[mask]))
  assert m["k3_kl"] == pytest.approx(np.mean(r - 1 - np.log(r)))
  assert m["chi2_token"] == pytest.approx(np.mean(r ** 2) - 1)
  assert m["ratio_fraction_high"] == pytest.approx(np.mean(r > 1.5))
  assert m["ratio_q50"] == pytest.approx(np.median(r))
  seq = np.exp(np.where(mask, learner - rollout, 0).sum(-1))
  assert m["seq_ratio_fraction_high"] == pytest.approx(np.mean(seq > 1.5))


# ------------------------------------------------------------------ dynamic sampling
def _rollout(returns_gn, tag: str) -> rollout_lib.Rollout:
  """A rollout whose trajectory t of group g returned returns_gn[g][t], one row each."""
  returns_gn = np.asarray(returns_gn, np.float32)
  groups, size = returns_gn.shape
  rows = [rollout_lib.StepRow(group=g, traj=g * size + i, step=0, task_id=f"{tag}{g}",
                              task_type="", anchor_obs="o", prompt_ids=[1], response_ids=[2],
                              response="", action="a", valid=True,
                              reward=float(returns_gn[g, i]), done=True)
          for g in range(groups) for i in range(size)]
  return rollout_lib.Rollout(rows=rows, won=returns_gn.reshape(-1) > 0,
                             returns=returns_gn.reshape(-1), lengths=np.ones(groups * size, int),
                             task_types=[""] * groups * size,
                             timings={"generation_s": 1.0, "env_s": 2.0}, decode_work=(3, 4))


def test_uniform_groups_are_dropped_and_later_batches_fill_the_batch():
  first = _rollout([[1, 1], [0, 1], [0, 0], [5, 5]], "a")  # only group 1 varies
  second = _rollout([[2, 3], [0, 0], [1, 0], [4, 2]], "b")  # groups 0, 2, 3 vary
  assert rollout_lib.varied_groups(first, 2, "score") == [1]
  picks, stats = rollout_lib.dynamic_selection([first, second], 2, 4, "score")
  assert picks == [(0, 1), (1, 0), (1, 2), (1, 3)]
  assert stats == {"groups_kept": 4.0, "groups_filled": 0.0, "groups_dropped": 4.0,
                   "generation_batches": 2.0, "varied_surplus": 0.0}
  ro = rollout_lib.select_groups([first, second], picks, 2)
  assert [r.task_id for r in ro.rows] == ["a1", "a1", "b0", "b0", "b2", "b2", "b3", "b3"]
  assert [(r.group, r.traj) for r in ro.rows] == [(g, 2 * g + i) for g in range(4) for i in range(2)]
  np.testing.assert_array_equal(ro.returns, [0, 1, 2, 3, 1, 0, 4, 2])
  assert ro.timings == {"generation_s": 2.0, "env_s": 4.0} and ro.decode_work == (6, 8)
  assert len(ro.task_types) == ro.num_trajectories == 8


def test_the_cap_fills_with_the_last_batchs_uniform_groups():
  first = _rollout([[1, 1], [0, 1]], "a")
  second = _rollout([[0, 0], [3, 3]], "b")
  picks, stats = rollout_lib.dynamic_selection([first, second], 2, 2, "score")
  assert picks == [(0, 1), (1, 0)]
  assert stats["groups_kept"] == 1.0 and stats["groups_filled"] == 1.0
  assert stats["groups_dropped"] == 2.0  # a0 and b1
  # more varied groups than needed: the first ones in generation order
  picks, stats = rollout_lib.dynamic_selection([_rollout([[0, 1], [1, 0], [2, 0]], "c")], 2, 2,
                                               "score")
  assert picks == [(0, 0), (0, 1)] and stats["varied_surplus"] == 1.0


def test_success_metric_reads_the_won_flag():
  ro = _rollout([[1, 2], [0, 3]], "a")  # returns differ in both; won: [T, T], [F, T]
  assert rollout_lib.varied_groups(ro, 2, "score") == [0, 1]
  assert rollout_lib.varied_groups(ro, 2, "success") == [1]
  with pytest.raises(ValueError, match="'reward'"):
    rollout_lib.varied_groups(ro, 2, "reward")


def test_selected_rows_keep_their_fields():
  ro = _rollout([[0, 1]], "a")
  ro.rows[1] = dataclasses.replace(ro.rows[1], response_logprobs=[-0.5])
  out = rollout_lib.select_groups([ro], [(0, 0)], 2)
  assert out.rows[1].response_logprobs == [-0.5] and out.rows[1].reward == 1.0


# ------------------------------------------------------------------ config errors
def _config(algo="grpo", **overrides):
  from configs import sokoban
  c = sokoban.get_config(f"algo={algo},smoke")
  with c.unlocked():
    c.update_from_flattened_dict(overrides)
  return c


@pytest.mark.parametrize("algo,overrides,match", [
    ("grpo", {"train.policy_loss": "dpo"}, r"config\.train: policy_loss='dpo'"),
    ("grpo", {"train.kl_estimator": "k5"}, r"config\.train: kl_estimator='k5'"),
    ("grpo", {"train.kl_estimator": "full"}, r"kl_estimator='full'"),
    ("grpo", {"train.lr_schedule": "linear"}, r"config\.train: lr_schedule='linear'"),
    ("grpo", {"train.rollout_is_threshold": -2.0}, r"rollout_is_threshold=-2\.0"),
    ("grpo", {"train.rollout_rs": "geometric"}, r"rollout_rs='geometric'"),
    ("ppo", {"train.filter_groups": True}, r"config\.train\.filter_groups .*'gae' has a critic"),
    ("grpo", {"train.filter_groups": True, "train.filter_groups_metric": "reward"},
     r"filter_groups_metric='reward'"),
    ("grpo", {"train.filter_groups": True, "train.max_generation_batches": 0},
     r"max_generation_batches=0"),
    ("grpo", {"train.kl_in_reward": True, "train.kl_ctrl": "pid"}, r"kl_ctrl='pid'"),
    ("grpo", {"train.kl_in_reward": True, "train.kl_reward_estimator": "full"},
     r"kl_reward_estimator='full'"),
    ("grpo", {"train.group_by_length": True, "train.rollout_is": "token"},
     r"config\.train\.group_by_length with rollout_is='token'"),
    ("grpo", {"train.pack_rows": True, "train.policy_loss": "gspo"},
     r"pack_rows with policy_loss='gspo'"),
    ("ppo", {"critic.lr_schedule": "step"}, r"config\.critic: lr_schedule='step'"),
])
def test_bad_training_options_end_in_one_line_naming_the_flag(algo, overrides, match):
  from hgpo_jax import train
  with pytest.raises(train.ConfigError, match=match) as info:
    experiment.from_config(_config(algo, **overrides))
  assert "\n" not in str(info.value)


def test_new_options_default_to_the_old_behaviour():
  exp = experiment.from_config(_config("hgpo"))
  assert exp.train.update.loss == dataclasses.replace(exp.train.update.loss, policy_loss="ppo",
                                                      kl_estimator="k3", rollout_is="none",
                                                      rollout_rs="none")
  assert not exp.train.update.scheduled
  c = _config("hgpo")
  assert not c.train.filter_groups and not c.train.kl_in_reward


def test_the_critic_has_its_own_learning_rate_schedule():
  exp = experiment.from_config(_config("ppo", **{"train.lr_schedule": "cosine"}))
  assert exp.train.update.scheduled and not exp.critic_update.scheduled  # train.* does not leak
  exp = experiment.from_config(_config("ppo", **{"critic.lr_schedule": "cosine",
                                                 "critic.warmup_steps": 1,
                                                 "train.num_iterations": 5}))
  assert exp.critic_update.scheduled and not exp.train.update.scheduled
  assert exp.critic_update.total_iterations == 5 and exp.critic_update.warmup_iterations == 1
  lrs = [train_step.iteration_learning_rate(exp.critic_update, i) for i in range(5)]
  assert lrs[0] == 0.0 and lrs[1] == exp.critic_update.lr and lrs[-1] < lrs[1]
