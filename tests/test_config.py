"""The config -> typed experiment step (`experiment.from_config`) and the config helpers.

`from_config` builds the experiment's sections (the update, loss, critic and rollout
dataclasses among them) once, with the config's field names; these tests pin that the
values arrive unchanged, that bad values fail with one line naming the config key, that
the options helper rejects unknown options, and that HGPO's depth K and the memory window
H cannot be split by an override. tests/training/test_experiment.py tests the tree itself
(every key of every shipped config reaches its field, the saved form reads back).
"""

import dataclasses

import jax
import pytest
from ml_collections.config_flags import config_path

from configs import alfworld as alfworld_config
from configs import common
from configs import sokoban as sokoban_config
from configs import webshop as webshop_config
from hgpo_jax import train
from hgpo_jax.advantages import registry
from hgpo_jax.models import config as model_config
from hgpo_jax.models import sharding as sharding_lib
from hgpo_jax.rollout import params as rollout_params
from hgpo_jax.sampling import logits as logits_lib
from hgpo_jax.training import checkpoint
from hgpo_jax.training import evaluation
from hgpo_jax.training import experiment
from hgpo_jax.training import losses
from hgpo_jax.training import programs
from hgpo_jax.training import run as run_lib
from hgpo_jax.training import train_step


def _override(c, key, value):
  """What `--config.<key>=<value>` does to a loaded config."""
  config_path.set_value(key, c, value)
  return c


# ------------------------------------------------------------------ estimator options
def test_estimator_options_rejects_unknown_overrides_naming_the_valid_ones():
  with pytest.raises(ValueError, match=r"^estimator 'grpo' has no option k; its options: "
                                       r"ddof, epsilon, norm, stats$"):
    common.estimator_options("grpo", k=2)
  with pytest.raises(ValueError, match="has no option temprature, zz"):
    common.estimator_options("hgpo", zz=1, temprature=3.0, k=2)
  opts = common.estimator_options("hgpo", k=4, alpha=0.5)
  defaults = registry.get("hgpo").options_cls()
  assert opts.to_dict() == {**dataclasses.asdict(defaults), "k": 4, "alpha": 0.5}


def test_family_options_pass_each_setting_only_to_estimators_that_have_it():
  got = {name: common.family_options(name, k=3, norm="mean").to_dict()
         for name in ("grpo", "rloo", "gigpo", "hgpo", "gae")}
  assert (got["hgpo"]["k"], got["hgpo"]["norm"]) == (3, "mean")
  assert got["grpo"]["norm"] == got["gigpo"]["norm"] == "mean"
  assert "k" not in got["gigpo"] and got["rloo"] == {"stats": "rows"}
  assert got["gae"] == dataclasses.asdict(registry.get("gae").options_cls())


# ------------------------------------------------------------------ K = H
@pytest.mark.parametrize("module,arg", [(alfworld_config, "algo=hgpo,k=2"),
                                        (webshop_config, "algo=hgpo,k=4"),
                                        (sokoban_config, "algo=hgpo,k=2")])
def test_history_length_and_hgpo_depth_move_together(module, arg):
  c = module.get_config(arg)
  assert c.algo.options.k == c.rollout.history_length
  _override(c, "rollout.history_length", 3)
  assert (c.algo.options.k, c.rollout.history_length) == (3, 3)
  _override(c, "algo.options.k", 1)
  assert (c.algo.options.k, c.rollout.history_length) == (1, 1)
  run = experiment.from_config(c)
  assert run.algo.options.k == run.rollout.history_length == 1
  assert c.to_dict()["rollout"]["history_length"] == 1  # saved configs hold plain values


def test_hand_built_split_of_k_and_history_length_is_rejected():
  c = sokoban_config.get_config("algo=hgpo,k=2,smoke")
  with c.unlocked():
    c.algo.options = common.estimator_options("hgpo", k=4)  # no shared reference
  with pytest.raises(train.ConfigError, match=r"^config.algo.options.k=4 differs from "
                                              r"config.rollout.history_length=2; .* k=4$"):
    experiment.from_config(c)


def test_history_length_of_estimators_without_depth_is_free():
  c = alfworld_config.get_config("algo=gigpo,k=2")
  _override(c, "rollout.history_length", 0)
  assert experiment.from_config(c).rollout.history_length == 0


# ------------------------------------------------------------------ typed configs
def test_from_config_builds_the_dataclasses_with_the_configs_values():
  c = alfworld_config.get_config("algo=ppo,k=2")
  exp = experiment.from_config(c)
  t, r = c.train, c.rollout
  # Every train key but the trainer loop's own is a field of UpdateConfig or LossConfig.
  update_fields = {f.name for f in dataclasses.fields(train_step.UpdateConfig)}
  loss_fields = {f.name for f in dataclasses.fields(losses.LossConfig)}
  loop_fields = {f.name for f in dataclasses.fields(experiment.Train)} - {"update"}
  assert set(t.keys()) - update_fields - loss_fields == loop_fields
  for key in loop_fields:
    assert getattr(exp.train, key) == t[key], key
  for key in set(t.keys()) & update_fields:
    assert getattr(exp.train.update, key) == t[key], key
  for key in set(t.keys()) & loss_fields:
    assert getattr(exp.train.update.loss, key) == t[key], key
  assert exp.train.update.scored_tail == r.max_new_tokens
  assert exp.train.update.total_iterations == t.num_iterations
  critic_update, value_loss = exp.critic_update, exp.critic.value_loss
  # The critic: its own optimizer settings, the actor's batching.
  assert (critic_update.lr, critic_update.weight_decay, critic_update.grad_clip) == (
      c.critic.lr, c.critic.weight_decay, c.critic.grad_clip) == (1e-5, 0.01, 1.0)
  assert (critic_update.mini_batch_rows, critic_update.micro_batch_rows) == (256, 16)
  # The critic's own loss unit (critic.ppo_micro_batch_size_per_gpu), no 0.5 factor.
  assert (critic_update.loss_unit_rows, exp.train.update.loss_unit_rows) == (16, 16)
  assert (value_loss.cliprange_value, value_loss.loss_scale) == (0.5, 1.0)
  # The critic's update takes none of the actor's loss options.
  assert critic_update.loss == losses.LossConfig() and critic_update.scored_tail is None
  # config.rollout and RolloutParams have the same keys and values.
  assert dataclasses.asdict(exp.rollout) == r.to_dict()
  assert (exp.sampling.train.temperature, exp.sampling.eval.temperature) == (1.0, 0.4)
  # The training rollout's log-probs feed the rollout correction; an evaluation reads none.
  assert (exp.sampling.train.need_logprobs, exp.sampling.eval.need_logprobs) == (True, False)
  for s in (exp.sampling.train, exp.sampling.eval):
    assert (s.top_p, s.top_k, s.max_new_tokens, s.stop_strings) == (
        r.top_p, r.top_k, r.max_new_tokens, ("</action>",))
  assert experiment.from_config(sokoban_config.get_config("algo=rloo")).critic_update is None


def test_from_config_consults_the_registry_once(monkeypatch):
  c = sokoban_config.get_config("algo=hgpo,k=2,smoke")
  calls = []
  real_get = registry.get
  monkeypatch.setattr(registry, "get", lambda name: calls.append(name) or real_get(name))
  exp = experiment.from_config(c)
  assert calls == ["hgpo"]
  assert (exp.estimator.name, exp.critic_update, programs.uses_reference(exp.train)) == (
      "hgpo", None, True)
  assert calls == ["hgpo"]  # the tree holds the estimator: no lookup when it is read


def test_training_consults_the_registry_once_before_loading_the_model(monkeypatch, tmp_path):
  c = sokoban_config.get_config("algo=hgpo,k=2,smoke")
  with c.unlocked():
    c.mesh.data = 1
  calls = []
  real_get = registry.get
  monkeypatch.setattr(registry, "get", lambda name: calls.append(name) or real_get(name))

  class Stop(Exception):
    pass

  def stop(*args, **kwargs):
    raise Stop

  monkeypatch.setattr(run_lib.loading, "load_model", stop)
  with pytest.raises(Stop):
    train.train_and_evaluate(experiment.from_config(c), str(tmp_path))
  assert calls == ["hgpo"]


@pytest.mark.parametrize("key,value,match", [
    ("train.ppo_epochs", 0, r"^config.train: ppo_epochs=0 and micro_batch_rows=4 must be >= 1\.$"),
    ("train.lr", 0.0, r"^config.train: lr=0.0 and grad_clip=1.0 must be > 0"),
    ("train.clip_ratio_c", 1.0, r"^config.train: clip_ratio_c=1.0 must be > 1"),
    ("rollout.subgoal_tokens", 0, r"^config.rollout: subgoal_tokens must be >= 1, got 0$"),
    ("rollout.free_query_tokens", -1, r"^config.rollout: free_query_tokens must be >= 1, got -1$"),
    ("rollout.history_length", -1, r"^config.rollout: history_length must be >= 0, got -1$"),
    ("rollout.response_format", "json", r"^config.rollout: response_format='json'; use one of"),
    ("rollout.top_p", 0.0, r"^config.rollout: SamplingParams.top_p=0.0 must be in \(0, 1\]"),
    ("eval.temperature", -1.0, r"^config.eval.temperature: SamplingParams.temperature=-1.0 "),
])
def test_bad_values_fail_with_one_line_naming_the_config_key(key, value, match):
  c = sokoban_config.get_config("algo=grpo,smoke")
  _override(c, key, value)
  with pytest.raises(train.ConfigError, match=match) as e:
    experiment.from_config(c)
  assert "\n" not in str(e.value)


def test_bad_critic_values_name_the_critic_section():
  c = alfworld_config.get_config("algo=ppo,k=2,smoke")
  _override(c, "critic.lr", -1.0)
  with pytest.raises(train.ConfigError, match=r"^config.critic: lr=-1.0 and grad_clip=1.0"):
    experiment.from_config(c)
  _override(c, "critic.lr", 1e-5)
  _override(c, "critic.cliprange_value", 0.0)
  with pytest.raises(train.ConfigError, match=r"^config.critic: cliprange_value=0.0 must be > 0"):
    experiment.from_config(c)


def test_rollout_params_fields_are_the_config_rollout_keys():
  names = [f.name for f in dataclasses.fields(rollout_params.RolloutParams)]
  assert sorted(names) == sorted(common.base_config().rollout.keys())
  defaults = rollout_params.RolloutParams()
  assert dataclasses.asdict(defaults) == common.base_config().rollout.to_dict()


@pytest.mark.parametrize("value", [0, -3])
def test_rollout_max_candidates_is_a_positive_int(value):
  c = sokoban_config.get_config("algo=grpo,smoke")
  # The default is the sampler's own; an override arrives in RolloutParams unchanged.
  assert c.rollout.max_candidates == logits_lib.DEFAULT_MAX_CANDIDATES == 256
  assert experiment.from_config(
      _override(c, "rollout.max_candidates", 64)).rollout.max_candidates == 64
  _override(c, "rollout.max_candidates", value)
  with pytest.raises(train.ConfigError, match=rf"^config.rollout: max_candidates must be an "
                                              rf"int >= 1, got {value}$") as e:
    experiment.from_config(c)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="max_candidates must be an int >= 1, got True"):
    rollout_params.RolloutParams(max_candidates=True)


def test_the_program_registry_sampler_takes_rollout_max_candidates():
  """`programs.build` (the trainer's sampler, `launch.plan`'s generate program) passes
  `rollout.max_candidates` to the Sampler."""
  c = alfworld_config.get_config("algo=grpo,model=tiny,smoke")
  c.rollout.max_candidates = 32
  mesh = sharding_lib.make_mesh(-1, 1, 1, devices=jax.devices()[:1])
  assert programs.build(experiment.from_config(c), mesh).sampler.max_candidates == 32


def test_training_and_evaluation_rollouts_pass_every_rollout_setting(monkeypatch):
  """Both call sites go through `evaluation.collect`, which hands collect() the experiment's
  rollout section itself (the free-span caps included: no setting re-spelled or defaulted
  on the way)."""
  seen = {}
  monkeypatch.setattr(evaluation.rollout_lib, "collect",
                      lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs) or "rollout")
  c = webshop_config.get_config("algo=grpo,smoke")
  for key, value in (("rollout.free_query_tokens", 5), ("rollout.subgoal_tokens", 7),
                     ("rollout.history_length", 3), ("rollout.fallback_chars", 11)):
    _override(c, key, value)
  exp = experiment.from_config(c)
  on_step = lambda t, T, n: None
  out = evaluation.collect("pool", "sampler", "tok", ["task"], 2, exp,
                           sampling=exp.sampling.eval, rng="rng", on_step=on_step)
  assert out == "rollout"
  assert seen["args"] == ("pool", "sampler", "tok", ["task"], 2)
  assert seen["kwargs"] == dict(env_name="webshop", max_steps=c.env.max_steps, params=exp.rollout,
                                sampling=exp.sampling.eval, rng="rng", on_step=on_step)
  assert dataclasses.asdict(seen["kwargs"]["params"]) == c.rollout.to_dict()
  r = seen["kwargs"]["params"]
  assert (r.history_length, r.constrained, r.fallback_chars, r.response_format,
          r.free_query_tokens, r.subgoal_tokens, r.format_instructions,
          r.history_drop_chars) == (3, True, 11, "react", 5, 7, True, 13000)


# ------------------------------------------------------------------ removed options
def test_init_weights_is_gone_and_an_override_fails_before_any_work():
  """`checkpoint.init_weights` never ran (the trainer raised NotImplementedError after
  loading the model); initial weights come from `model.path`, a run's state from
  `checkpoint.resume_from`."""
  c = sokoban_config.get_config("algo=grpo,smoke")
  assert "init_weights" not in c.checkpoint
  with pytest.raises(KeyError, match="init_weights"):
    _override(c, "checkpoint.init_weights", "/some/run")
  assert checkpoint.RESUME_SOURCES == ("workdir", "resume_path", "scratch")


@pytest.mark.parametrize("module", [alfworld_config, webshop_config, sokoban_config])
def test_every_family_has_the_critic_algorithms(module):
  # One variant order for all families (configs/common.finish): the published critic
  # settings, then smoke, then no env grouping over the smoke sizes.
  for algo, est in (("ppo", "gae"), ("hiper", "hae")):
    c = module.get_config(f"algo={algo},model=tiny,smoke")
    run = experiment.from_config(c)
    assert (c.algo.name, c.rollout.group_size, c.rollout.num_groups) == (est, 1, 4)
    assert run.critic_update.lr == 1e-5
  hiper = module.get_config("algo=hiper,smoke")
  assert hiper.rollout.response_format == "hiper" and hiper.rollout.max_new_tokens == 128
  assert hiper.algo.options.keep_penalty == (-3.5 if module is webshop_config else -0.3)


def test_local_variant_evaluates_on_the_family_held_out_split():
  # `local` once hard-coded ALFWorld's split name, which the shop server does not have.
  assert alfworld_config.get_config("local").env.eval_splits == ("valid_unseen",)
  assert webshop_config.get_config("local").env.eval_splits == ("test",)


def test_local_variant_computes_in_float32_with_query_chunks():
  # bf16 products are opt-in (docs/performance.md): slower than float32 on the AVX2
  # reference machine and they change the training numbers; query chunks are exact.
  c = alfworld_config.get_config("algo=hgpo,k=2,model=smollm2-135m,local")
  model = experiment.from_config(c).model
  cfg = experiment.model_settings(model, model_config.get_preset("tiny").replace(dtype="bfloat16"))
  assert (cfg.dtype, cfg.attn_query_chunk, cfg.remat) == ("float32", 256, True)
  _override(c, "model.compute_dtype", "bfloat16")
  assert experiment.model_settings(experiment.from_config(c).model, cfg).dtype == "bfloat16"


@dataclasses.dataclass
class _Device:
  platform: str
  device_kind: str = "fake"


def test_compute_and_reference_dtypes_auto_resolve_by_the_meshs_platform():
  """`auto` (the configs' default) is the papers' mixed precision on TPUs and GPUs (bf16
  products over float32 parameters, a bf16 reference) and the parameters' dtype on CPUs;
  "" is the parameters' dtype and a named dtype is itself everywhere."""
  resolve = model_config.resolve_compute_dtype
  assert [resolve("auto", "float32", p) for p in ("tpu", "gpu", "cpu")] == [
      "bfloat16", "bfloat16", "float32"]
  assert resolve("auto", "bfloat16", "cpu") == "bfloat16"
  assert resolve("", "float32", "tpu") == "float32"
  assert resolve("float32", "float32", "tpu") == "float32"
  assert resolve("bfloat16", "float32", "cpu") == "bfloat16"
  with pytest.raises(ValueError, match="compute_dtype='fp8': use one of"):
    resolve("fp8", "float32", "tpu")
  ref = train_step.resolve_reference_dtype
  assert (ref("auto", "bfloat16"), ref("auto", "float32"), ref("", "bfloat16")) == (
      "bfloat16", "", "")
  assert ref("float32", "bfloat16") == "float32"
  # the configs' defaults, through model_settings for a TPU target and this host's CPUs
  c = alfworld_config.get_config("algo=hgpo,model=qwen2.5-1.5b")
  assert (c.model.compute_dtype, c.train.reference_dtype) == ("auto", "auto")
  preset, model = model_config.get_preset("tiny"), experiment.from_config(c).model
  assert experiment.model_settings(model, preset, [_Device("tpu")]).dtype == "bfloat16"
  assert experiment.model_settings(model, preset, [_Device("cuda")]).dtype == "bfloat16"
  assert experiment.model_settings(model, preset).dtype == "float32"


def test_bf16_parameters_at_a_small_learning_rate_are_warned_about():
  """bf16 parameters at the papers' lr 1e-6: one warning line per optimizer whose steps
  round away (the critic's only with a critic); float32 parameters, or a large enough lr,
  none. The rounding it warns about, measured: a +-1e-6 step changes few N(0, 0.02) bf16
  weights, a +-1e-6 step on float32 weights changes them all."""
  import numpy as np
  warnings = lambda c: experiment.precision_warnings(experiment.from_config(c))
  c = alfworld_config.get_config("algo=ppo,model=qwen2.5-1.5b")
  assert warnings(c) == []
  c.model.dtype = "bfloat16"
  lines = warnings(c)
  assert [line.split(":")[0] for line in lines] == [
      "model.dtype=bfloat16 with train.lr=1e-06", "model.dtype=bfloat16 with critic.lr=1e-05"]
  g = alfworld_config.get_config("algo=gigpo,model=qwen2.5-1.5b")
  g.model.dtype = "bfloat16"
  assert len(warnings(g)) == 1
  g.train.lr = experiment.BF16_LOST_STEP_LR
  assert warnings(g) == []
  rng = np.random.default_rng(0)
  w = rng.normal(0, 0.02, 100_000).astype(np.float32)
  step = rng.choice([-1e-6, 1e-6], w.size).astype(np.float32)
  bf16 = jax.numpy.asarray(w, jax.numpy.bfloat16)
  moved = np.asarray((bf16.astype(np.float32) + step).astype(jax.numpy.bfloat16) != bf16)
  assert moved.mean() < 0.05 and np.all(w + step != w)
