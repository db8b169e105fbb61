"""The typed experiment tree (`hgpo_jax.training.experiment`): every key of every shipped
config reaches one field with its value, the saved form (`Experiment.to_dict`, what a
checkpoint and the metrics writers store) reads back into an equal tree, keys no section
declares are refused in one line, and `override` re-checks the result."""

import json
import re
import types

import jax.numpy as jnp
import numpy as np
import pytest

from configs import alfworld, search, sokoban, webshop
from hgpo_jax.training import checkpoint as checkpoint_lib
from hgpo_jax.training import experiment
from hgpo_jax.training import run as run_lib

VARIANTS = [
    (alfworld, ""), (alfworld, "smoke"), (alfworld, "local"), (alfworld, "algo=ppo,k=2"),
    (alfworld, "algo=hiper"), (alfworld, "algo=gigpo,model=smollm2-135m,lora"),
    (alfworld, "algo=grpo,gspo"), (alfworld, "algo=gigpo,dynamic"),
    (webshop, ""), (webshop, "algo=hiper,smoke"), (webshop, "algo=rloo,local"),
    (sokoban, "algo=hgpo,k=2"), (sokoban, "algo=ppo,smoke"),
    (search, ""), (search, "algo=gigpo,listed"), (search, "local"),
]


def _leaves(d, prefix=""):
  for k, v in d.items():
    if isinstance(v, dict) and not (prefix == "env." and k == "args") and k != "options":
      yield from _leaves(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}", v


def _plain(v):
  return tuple(v) if isinstance(v, (list, tuple)) else v


@pytest.mark.parametrize("module,arg", VARIANTS, ids=lambda x: getattr(x, "__name__", x))
def test_every_key_reaches_its_field_and_the_saved_form_reads_back(module, arg):
  config = module.get_config(arg)
  exp = experiment.from_config(config)
  saved = exp.to_dict()
  flat = dict(_leaves(saved))
  for key, value in _leaves(config.to_dict()):
    assert key in flat, f"config.{key} reaches no field"
    assert _plain(flat[key]) == _plain(value), key
  # what a checkpoint stores is JSON: it reads back into the same tree
  again = experiment.from_dict(json.loads(json.dumps(saved)))
  assert again == exp
  assert json.loads(json.dumps(again.to_dict())) == json.loads(json.dumps(saved))
  assert experiment.from_config(exp) is exp  # the door converts once


def test_the_saved_fields_are_where_the_library_reads_them():
  exp = experiment.from_config(alfworld.get_config("algo=ppo,k=2"))
  assert exp.train.update.lr == exp.to_dict()["train"]["lr"] == 1e-6
  assert exp.train.update.loss.kl_coef == exp.to_dict()["train"]["kl_coef"]
  assert exp.critic.value_loss.cliprange_value == exp.to_dict()["critic"]["cliprange_value"]
  assert exp.algo.name == "gae" and exp.estimator.needs_critic
  assert exp.critic_update.lr == exp.critic.lr == 1e-5


@pytest.mark.parametrize("section,key", [("train", "lrr"), ("rollout", "group"), ("eval", "x"),
                                         ("model", "flash"), ("critic", "beta"),
                                         ("checkpoint", "init_weights"), ("env", "server")])
def test_a_key_no_section_declares_is_refused_in_one_line(section, key):
  d = experiment.from_config(sokoban.get_config("algo=grpo,smoke")).to_dict()
  d[section][key] = 1
  with pytest.raises(experiment.ConfigError,
                     match=rf"^config\.{section}\.{key} is not a setting of this trainer") as e:
    experiment.from_dict(d)
  assert "\n" not in str(e.value)
  d = experiment.from_config(sokoban.get_config("algo=grpo,smoke")).to_dict()
  d["model"]["lora"]["ranks"] = 2
  with pytest.raises(experiment.ConfigError, match=r"^config\.model\.lora\.ranks is not"):
    experiment.from_dict(d)
  d = experiment.from_config(sokoban.get_config("algo=grpo,smoke")).to_dict()
  d["trainer"] = {}
  with pytest.raises(experiment.ConfigError, match=r"^config\.trainer is not a setting"):
    experiment.from_dict(d)


def test_override_returns_a_new_checked_tree():
  exp = experiment.from_config(sokoban.get_config("algo=grpo,smoke"))
  other = exp.override({"train.lr": 3e-4, "mesh.data": 1, "rollout.decode_slots": 4})
  assert (other.train.update.lr, other.mesh.data, other.rollout.decode_slots) == (3e-4, 1, 4)
  assert (exp.train.update.lr, exp.mesh.data, exp.rollout.decode_slots) == (1e-4, -1, 0)
  assert other.override({"train.lr": 1e-4, "mesh.data": -1, "rollout.decode_slots": 0}) == exp
  with pytest.raises(experiment.ConfigError, match=r"^config\.train\.lrr is not a setting"):
    exp.override({"train.lrr": 1.0})
  with pytest.raises(experiment.ConfigError, match=r"^config\.train: lr=-1\.0"):
    exp.override({"train.lr": -1.0})
  with pytest.raises(experiment.ConfigError, match=r"^config\.train\.constrained_logprobs "
                                                   r"scores the constrained policy"):
    exp.override({"rollout.constrained": False, "train.constrained_logprobs": True})


def test_the_checkpoint_stores_the_experiment_and_it_loads_back(tmp_path):
  exp = experiment.from_config(alfworld.get_config("algo=gigpo,model=smollm2-135m,lora"))
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"), async_save=False)
  saved = {}
  fake = types.SimpleNamespace(
      state=types.SimpleNamespace(to_checkpoint=lambda: {"w": jnp.arange(3.0)}),
      critic_state=None, kl_controller=None, experiment=exp,
      checkpointer=types.SimpleNamespace(save=lambda step, tree, **kw: saved.update(
          kw, step=step) or ckpt.save(step, tree, **kw)))
  run_lib.Run.checkpoint(fake, 2, {"rollout/success": 0.5})
  assert saved["config"] == exp.to_dict() and saved["cursor"] == {"iteration": 2}
  restored = ckpt.restore({"w": jnp.zeros(3)})
  assert restored.step == 2 and np.array_equal(restored.state["w"], np.arange(3.0))
  assert experiment.from_dict(restored.config) == exp


def test_the_library_never_reads_a_config_dict():
  """hgpo_jax/ takes the typed tree; only the launch tools (and configs/) hold ConfigDicts."""
  import pathlib
  root = pathlib.Path(experiment.__file__).parents[1]
  readers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                   if re.search(r"^\s*(import|from) ml_collections", p.read_text(), re.M))
  assert readers == []


def test_env_step_latency_is_for_servers_this_trainer_starts():
  exp = experiment.from_config(sokoban.get_config("algo=grpo,smoke"))
  assert exp.override({"env.step_latency_ms": 250.0}).env.step_latency_ms == 250.0
  for values in ({"env.step_latency_ms": -1.0},
                 {"env.step_latency_ms": 250.0, "env.endpoints": ("host:1",)}):
    with pytest.raises(experiment.ConfigError, match=r"^config\.env\.step_latency_ms=\S+ delays"):
      exp.override(values)
