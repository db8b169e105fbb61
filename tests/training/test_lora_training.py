"""Training with LoRA adapters (hgpo_jax/models/lora.py, training/train_step.py): fresh
adapters give the full model's log-probs bit for bit, an update moves only the adapters
(optimizer state and checkpoints hold only them), the reference is the base with the
adapters off, sharded == unsharded, a checkpoint resumes the uninterrupted run, and the
trainer end to end (slow)."""

import jax
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config as model_config
from hgpo_jax.models import decoder, loading, lora, sharding
from hgpo_jax.training import checkpoint, experiment, train_batch, train_step

TINY = model_config.get_preset("tiny").replace(num_layers=2, vocab_size=64, mlp_dim=64)
LORA = lora.LoraConfig(rank=4, alpha=8.0)


def _models(mesh=None, targets=lora.TARGETS, top_layers=0):
  base = decoder.Decoder(TINY, rngs=nnx.Rngs(0))
  adapted = loading.with_lora(base, lora.LoraConfig(rank=4, alpha=8.0, targets=targets,
                                                    top_layers=top_layers),
                              seed=3, mesh=mesh)
  return base, adapted


def _mesh(data=1, fsdp=1, tensor=1):
  return sharding.make_mesh(data, fsdp, tensor, devices=fake_devices.take(data * fsdp * tensor))


def _host_batch(rows=16, seed=0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, TINY.vocab_size, rng.integers(1, 7)).tolist() for _ in range(rows)]
  responses = [rng.integers(1, TINY.vocab_size, rng.integers(1, 9)).tolist() for _ in range(rows)]
  adv = rng.normal(size=rows).astype(np.float32)
  batch, _ = train_batch.build_train_batch(prompts, responses, adv, prompt_buckets=[8],
                                           response_buckets=[8], row_multiple=16)
  return batch


def _config(**kw):
  return train_step.UpdateConfig(**dict(dict(lr=1e-2, mini_batch_rows=16, micro_batch_rows=8,
                                             ppo_epochs=2), **kw))


def _learner(model, mesh, config):
  learner = train_step.Learner(model, mesh, config)
  return learner, learner.init_state(nnx.state(model, nnx.Param))


def _iterate(learner, state, hosts):
  ref = learner.reference_params(state)
  history = []
  for host in hosts:
    filled = train_step.fill_rows(learner, state.params, ref, host)
    state, metrics = train_step.train_iteration(learner, state, filled)
    history.append(metrics)
  return state, history


def _flat(tree):
  return {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def test_fresh_adapters_give_the_full_models_logprobs_bitwise():
  base, adapted = _models()
  mesh, config = _mesh(), _config()
  host = _host_batch()
  logps = []
  for model in (base, adapted):
    learner, state = _learner(model, mesh, config)
    x = learner.lay_out(learner.put_batch(host))
    logps.append(np.asarray(learner.compute_logprobs(state.params, x)))
  assert np.any(logps[0] != 0)
  np.testing.assert_array_equal(logps[1], logps[0])


def test_update_moves_only_the_adapters_and_the_reference_is_the_base():
  base, adapted = _models()
  mesh, config = _mesh(), _config()
  learner, state = _learner(adapted, mesh, config)
  assert learner.reference_params(state) is train_step.ADAPTERS_OFF
  before = _flat(jax.device_get(state.params))
  # the optimizer's moments exist for the adapters only
  moments = _flat(state.opt_state[1][0].mu)
  assert moments and all(lora.is_adapter(k.split("/")[-1]) for k in moments)
  assert set(_flat(state.to_checkpoint()["params"])) == {k for k in before
                                                         if lora.is_adapter(k.split("/")[-1])}
  state, history = _iterate(learner, state, [_host_batch(seed=1)])
  after = _flat(jax.device_get(state.params))
  assert int(state.step) == 2 and history[0]["grad_norm"] > 0
  for name, value in before.items():
    if lora.is_adapter(name.split("/")[-1]):
      assert np.max(np.abs(after[name] - value)) > 1e-3, name  # every adapter moved
    else:
      np.testing.assert_array_equal(after[name], value, err_msg=name)  # the base bitwise
  # the reference log-probs (adapters off) are the base model's, bit for bit, after the update
  host = _host_batch(seed=2)
  filled = train_step.fill_rows(learner, state.params, train_step.ADAPTERS_OFF, host)
  base_learner, base_state = _learner(base, mesh, config)
  want = base_learner.compute_logprobs(base_state.params,
                                       base_learner.lay_out(base_learner.put_batch(host)))
  np.testing.assert_array_equal(np.asarray(filled.ref_logprobs), np.asarray(want))
  assert np.max(np.abs(np.asarray(filled.old_logprobs) - np.asarray(want))) > 1e-3


def test_reference_copy_settings_are_refused_with_adapters():
  _, adapted = _models()
  for kw in (dict(reference_memory="host"), dict(reference_dtype="bfloat16")):
    with pytest.raises(ValueError, match="do not apply with LoRA") as e:
      train_step.Learner(adapted, _mesh(), _config(**kw))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("shape,top_layers", [((8, 1, 1), 0), ((2, 2, 2), 0), ((2, 2, 2), 1)])
def test_sharded_equals_unsharded(shape, top_layers):
  hosts = [_host_batch(32, seed=s) for s in (1, 2)]
  config = _config(lr=1e-3, mini_batch_rows=32)
  params, metrics = {}, {}
  for name, mesh in (("single", _mesh()), ("sharded", _mesh(*shape))):
    _, adapted = _models(mesh, top_layers=top_layers)
    learner, state = _learner(adapted, mesh, config)
    p0 = _flat(jax.device_get(state.params))
    state, history = _iterate(learner, state, hosts)
    params[name], metrics[name] = _flat(jax.device_get(state.params)), history[-1]
    if shape == (2, 2, 2) and name == "sharded":  # A's input and B's output axes split as W's
      spec = lambda n: tuple(state.params["layers"][n].sharding.spec)  # noqa: E731
      assert spec("q")[3] == "fsdp" and spec("q_lora_a")[1] == "fsdp"
      assert spec("q")[1] == "tensor" and spec("q_lora_b")[2] == "tensor"
      assert spec("down_lora_a")[1] == "tensor" and spec("down_lora_b")[2] == "fsdp"
  travelled = max(np.max(np.abs(params["single"][k] - p0[k])) for k in p0)
  assert travelled > 1e-3
  for k in p0:
    np.testing.assert_allclose(params["sharded"][k], params["single"][k],
                               atol=0.05 * travelled, err_msg=k)
  for k in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(metrics["sharded"][k], metrics["single"][k], rtol=1e-4, atol=1e-7)


def test_checkpoint_resume_equals_the_uninterrupted_run(tmp_path):
  hosts = [_host_batch(seed=s) for s in (1, 2, 3)]
  mesh, config = _mesh(), _config()
  _, adapted = _models()
  learner, state = _learner(adapted, mesh, config)
  initial = jax.device_get(state.params)
  state, uninterrupted = _iterate(learner, state, hosts)
  # interrupted: one iteration, save, restore onto a fresh initial state, two more
  learner, state = _learner(adapted, mesh, config)
  state, first = _iterate(learner, state, hosts[:1])
  saver = checkpoint.Checkpointer(str(tmp_path / "ckpt"), max_to_keep=2, async_save=False)
  saver.save(1, state.to_checkpoint(), cursor={"iteration": 1}, config={}, metrics={})
  saver.close()
  saved = _flat(state.to_checkpoint()["params"])
  assert saved and all(lora.is_adapter(k.split("/")[-1]) for k in saved)
  learner, fresh = _learner(adapted, mesh, config)
  target = learner.abstract_state(fresh.params).to_checkpoint()
  restored = checkpoint.resume(str(tmp_path / "ckpt"), target).restored
  state = train_step.TrainState.from_checkpoint(restored.state, like=fresh)
  state, rest = _iterate(learner, state, hosts[1:])
  final = _flat(jax.device_get(state.params))
  for k, v in _flat(initial).items():
    if not lora.is_adapter(k.split("/")[-1]):
      np.testing.assert_array_equal(final[k], v)
  assert [h["loss"] for h in first + rest] == [h["loss"] for h in uninterrupted]
  assert [h["grad_norm"] for h in first + rest] == [h["grad_norm"] for h in uninterrupted]


def test_critic_trains_its_adapters_and_full_rank_value_heads():
  from hgpo_jax.models import critic
  from hgpo_jax.training import critic_step
  _, adapted = _models()
  heads, cfg = 3, adapted.cfg
  learner = critic_step.CriticLearner(critic.abstract_critic(cfg, heads), _mesh(),
                                      _config(mini_batch_rows=16))
  params = critic.params_from_policy(nnx.state(adapted, nnx.Param), cfg, heads, seed=0)
  state = learner.init_state(params)
  trained = set(_flat(learner.trained_shardings))
  assert {"value_head", "value_bias"} <= trained and len(trained) == 2 + 2 * 7
  assert all(k.startswith("value_") or lora.is_adapter(k.split("/")[-1]) for k in trained)
  rng = np.random.default_rng(0)
  host = _host_batch(16, seed=4)
  mask = np.repeat(np.asarray(host.response_mask)[..., None], heads, axis=-1)
  batch = critic_step.value_batch(host, mask, rng.normal(size=mask.shape).astype(np.float32),
                                  np.zeros(mask.shape, np.float32))
  before = _flat(jax.device_get(state.params))
  state, metrics = train_step.train_iteration(learner, state, batch)
  after = _flat(jax.device_get(state.params))
  assert metrics["grad_norm"] > 0
  for name, value in before.items():
    if name in trained:
      assert np.max(np.abs(after[name] - value)) > 1e-4, name
    else:
      np.testing.assert_array_equal(after[name], value, err_msg=name)


# ---------------------------------------------------------------------------- end to end
def _sokoban(workdir, **overrides):
  from configs import sokoban as sokoban_config
  c = sokoban_config.get_config("algo=hgpo,k=2,smoke")
  with c.unlocked():
    c.mesh.data = 1
    c.update_from_flattened_dict({"model.lora.rank": 4, "model.lora.alpha": 8.0, **overrides})
  return c


def _deterministic_lines(workdir):
  from hgpo_jax.training import run_records
  lines = run_records.read_metrics(workdir)
  return [{k: v for k, v in line.items() if not k.startswith(("time/", "env/"))
           and not k.endswith(("_flop_per_s", "_mfu"))} for line in lines]


@pytest.mark.slow
def test_trainer_with_lora_resumes_to_the_uninterrupted_runs_metrics(tmp_path):
  from hgpo_jax import train
  whole = str(tmp_path / "whole")
  train.train_and_evaluate(experiment.from_config(_sokoban(whole)), whole)
  lines = _deterministic_lines(whole)
  assert [line["step"] for line in lines] == [1, 2, 3]
  assert lines[0]["train/kl"] == 0.0 and lines[1]["train/kl"] != 0.0  # reference: adapters off
  parted = str(tmp_path / "parted")
  train.train_and_evaluate(experiment.from_config(
      _sokoban(parted, **{"train.num_iterations": 1, "eval.at_end": False})), parted)
  out = train.train_and_evaluate(experiment.from_config(_sokoban(parted)), parted)
  assert out["resume_source"] == "workdir" and out["start_iteration"] == 1
  assert _deterministic_lines(parted) == lines


def test_plan_counts_the_frozen_base_the_adapters_and_their_optimizer_state():
  """`programs.build` with LoRA: params are the base (in the compute dtype) + the adapters,
  the optimizer state the adapters' moments only, no reference copy; the reference pass is
  its own program over the same params (adapters off), and without a KL term (off, or at
  coefficient 0) there is none."""
  from configs import alfworld
  from hgpo_jax.compiled import plan as plan_lib
  from hgpo_jax.training import programs
  config = alfworld.get_config("algo=hgpo,model=tiny,smoke")
  config.rollout.max_prompt_tokens, config.rollout.max_new_tokens = 64, 32
  config.train.mini_batch_rows = config.train.micro_batch_rows = 16
  mesh = _mesh(2)
  full = programs.build(experiment.from_config(config), mesh)
  config.model.lora.rank = 8
  adapted = programs.build(experiment.from_config(config), mesh)
  tiny = model_config.get_preset("tiny")
  d, h, kv, dh, f, n = (tiny.hidden_dim, tiny.num_heads, tiny.num_kv_heads, tiny.head_dim,
                        tiny.mlp_dim, tiny.num_layers)
  adapter_numbers = 8 * n * ((d + h * dh) + 2 * (d + kv * dh) + (h * dh + d) + 2 * (d + f)
                             + (f + d))
  assert adapted.params_bytes == full.params_bytes + 4 * adapter_numbers  # f32 on CPU
  counters = full.opt_bytes - 2 * full.params_bytes  # AdamW's two moments + its step counts
  assert adapted.opt_bytes == 2 * 4 * adapter_numbers + counters
  assert adapted.reference_bytes == 0 and full.reference_bytes == full.params_bytes
  program = adapted.programs["logprobs"]
  assert program.jitted is adapted.learner.compute_reference_logprobs
  assert program.args[0] is adapted.programs["update"].args[0].params
  plan = plan_lib.compile_plan(experiment.from_config(config), (2, 1, 1),
                               devices=fake_devices.take(2), phases=["logprobs", "update"])
  assert plan.reference == 0 and plan.opt_state == adapted.opt_bytes
  for field, value in (("kl_coef", 0.0), ("use_kl_loss", False)):  # each turns the KL off
    config.train[field] = value
    no_kl = programs.build(experiment.from_config(config), mesh)
    assert no_kl.programs["logprobs"].calls == 0 and "logprobs_old" not in no_kl.programs


@pytest.mark.parametrize("overrides,message", [
    ({"model.lora.rank": -1}, "config.model.lora.rank=-1 must be >= 0"),
    ({"model.lora.rank": 8, "model.lora.alpha": 0.0}, "config.model.lora.alpha=0.0 must be > 0"),
    ({"model.lora.rank": 8, "model.lora.targets": "q_proj,qkv"}, "names no module"),
    ({"model.lora.rank": 8, "train.reference_memory": "host"}, "do not apply with"),
    ({"model.lora.path": "/nonexistent/adapter"}, "is not a directory"),
])
def test_bad_lora_settings_are_one_line_config_errors(overrides, message):
  from configs import alfworld
  from hgpo_jax import train
  config = alfworld.get_config("algo=hgpo,model=tiny,smoke")
  config.update_from_flattened_dict(overrides)
  with pytest.raises(train.ConfigError, match=message) as e:
    experiment.from_config(config)
  assert "\n" not in str(e.value)


def test_length_grouped_update_and_its_flop_count_with_adapters():
  """A mini-batch of length-grouped parts (`Learner.update_mini_batch`: gradient programs
  over the adapters' gradient sum, then the step) equals the one-part update of the same
  rows, and `LearnerFlops` compiles those programs (the trainer's perf metrics)."""
  from hgpo_jax.compiled import trainer_metrics
  from hgpo_jax.training import packing
  _, adapted = _models()
  config = _config(ppo_epochs=1, micro_batch_rows=4, mini_batch_rows=16)
  learner, state = _learner(adapted, _mesh(), config)
  host = _host_batch(16, seed=5)
  parts = packing.group_mini_batch(host, micro_batch_rows=4, length_multiple=8)
  assert len(parts) == 4
  filled = train_step.fill_logprobs(learner, state.params, train_step.ADAPTERS_OFF, [parts])
  whole = train_step.fill_rows(learner, state.params, train_step.ADAPTERS_OFF, host)
  one, m_one = learner.update(learner.init_state(nnx.state(adapted, nnx.Param)), whole)
  grouped, m_grouped = learner.update_mini_batch(state, filled[0])
  np.testing.assert_allclose(float(m_grouped["loss"]), float(m_one["loss"]), rtol=1e-5)
  for k, v in _flat(jax.device_get(grouped.params)).items():
    np.testing.assert_allclose(v, _flat(jax.device_get(one.params))[k], atol=1e-6, err_msg=k)
  flops = trainer_metrics.LearnerFlops(learner).per_call(tuple(parts))
  assert flops["update"] > flops["logprobs"] > 0


@pytest.mark.parametrize("top_layers", [0, 1])
def test_unrolled_adapted_layers_equal_the_scan(top_layers):
  """model.adapted_layers="unrolled" (a Python loop over the adapted layers) trains the
  adapters as the scan does: the same parameters after two iterations of two epochs, the
  same metrics, to float32 round-off."""
  hosts = [_host_batch(seed=s) for s in (1, 2)]
  mesh, config = _mesh(), _config(lr=1e-3)
  params, metrics = {}, {}
  for loop in ("scan", "unrolled"):
    _, adapted = _models(top_layers=top_layers)
    adapted.cfg = adapted.cfg.replace(adapted_layers=loop)
    learner, state = _learner(adapted, mesh, config)
    p0 = _flat(jax.device_get(state.params))
    state, history = _iterate(learner, state, hosts)
    params[loop], metrics[loop] = _flat(jax.device_get(state.params)), history[-1]
  travelled = max(np.max(np.abs(params["scan"][k] - p0[k])) for k in p0)
  assert travelled > 1e-4
  for k in p0:
    np.testing.assert_allclose(params["unrolled"][k], params["scan"][k], atol=1e-6, err_msg=k)
  for k in ("loss", "kl", "grad_norm", "entropy"):
    np.testing.assert_allclose(metrics["unrolled"][k], metrics["scan"][k], rtol=1e-5, err_msg=k)


def test_adapted_layers_refusals():
  from hgpo_jax.training import experiment
  with pytest.raises(experiment.ConfigError, match="adapted_layers='unrolled' loops over LoRA") as e:
    experiment.Model(adapted_layers="unrolled")
  assert "\n" not in str(e.value)
  with pytest.raises(experiment.ConfigError, match="use one of"):
    experiment.Model(adapted_layers="python", lora=experiment.Lora(rank=4))
  with pytest.raises(ValueError, match="use one of"):
    TINY.replace(lora=LORA, adapted_layers="python")
