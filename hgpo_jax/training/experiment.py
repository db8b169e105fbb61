"""The typed, frozen settings of a run: `from_config(config) -> Experiment`.

The user writes a run's settings as an `ml_collections.ConfigDict` (config files,
`--config.a.b=value` overrides, variants). The launch tools convert it once, at the door,
into one frozen tree of typed sections; the library (`hgpo_jax/`) reads only that tree or
its sections:

  Experiment: seed, allow_cpu, model (Model, its lora: Lora), env (Env), algo (Algo),
              rollout (rollout.params.RolloutParams), sampling (Sampling), train (Train:
              the loop's options and update: train_step.UpdateConfig with its loss:
              losses.LossConfig), critic (Critic), eval (Eval), mesh (Mesh),
              checkpoint (Checkpoint), metrics (Metrics), profile (Profile)

Every key of a config section is one field of one section (`config.train.lr` ->
`train.update.lr`, `config.train.kl_coef` -> `train.update.loss.kl_coef`,
`config.train.filter_groups` -> `train.filter_groups`); a key no section declares is
refused in one line. Each section checks its own fields (`__post_init__`), and
`_check_across_sections` holds every rule between sections, so an error names the key and
what to set in one line (`ConfigError`) before any model, env server or compile.
`Experiment.to_dict()` gives the nested plain dict of the same keys (what a checkpoint and
the metrics writers store) and `from_dict` reads it back into an equal tree.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping, Optional

import jax

from env_servers import registry as env_registry
from hgpo_jax.advantages import registry
from hgpo_jax.models import attention
from hgpo_jax.models import config as model_config
from hgpo_jax.models import lora as lora_lib
from hgpo_jax.models import platform
from hgpo_jax.rollout import params as rollout_params
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.sampling import types as sampling_types
from hgpo_jax.training import critic_step
from hgpo_jax.training import losses
from hgpo_jax.training import metrics as metrics_lib
from hgpo_jax.training import train_step

# Critic-based estimators the trainer supports -> number of value heads.
CRITIC_HEADS = {"gae": 1, "hae": 3}


class ConfigError(ValueError):
  """A config that cannot run; raised before any expensive work starts."""


def _names(cls) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


def _build(section: str, cls, values: Mapping[str, Any]):
  """`cls(**values)`; a key `cls` does not declare, or a value its checks refuse, is a
  ConfigError naming the section (a ConfigError of the checks passes through)."""
  unknown = sorted(set(values) - set(_names(cls))) if dataclasses.is_dataclass(cls) else ()
  if unknown:
    raise ConfigError(f"config.{section}.{unknown[0]} is not a setting of this trainer "
                      f"(config.{section} takes {sorted(_names(cls))})")
  try:
    return cls(**values)
  except ConfigError:
    raise
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{section}: {e}") from None


# ---------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Lora:
  """`config.model.lora`: adapters over the frozen base (hgpo_jax/models/lora.py)."""

  rank: int = 0
  alpha: float = 16.0
  targets: Any = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
  rslora: bool = False
  top_layers: int = 0
  path: str = ""
  """A PEFT adapter directory to start from ("" = fresh adapters)."""

  def __post_init__(self):
    self.config  # raises for a bad rank, alpha, target or top_layers
    if self.path and not os.path.isdir(self.path):
      raise ConfigError(f"config.model.lora.path={self.path!r} is not a directory "
                        f"(a PEFT adapter: adapter_config.json + adapter_model.safetensors)")

  @property
  def config(self) -> lora_lib.LoraConfig:
    """The model's LoraConfig (rank 0: no adapters)."""
    try:
      return lora_lib.from_settings(self.rank, self.alpha, self.targets, self.rslora,
                                    self.top_layers)
    except ValueError as e:
      raise ConfigError(f"config.{e.args[0]}") from None


@dataclasses.dataclass(frozen=True)
class Model:
  """`config.model`: which policy, its numerics and attention kernels."""

  name: str = "smollm2-135m"
  path: str = ""
  dtype: str = "float32"
  compute_dtype: str = "auto"
  remat: bool = True
  attn_query_chunk: int = 0
  attention_impl: str = "auto"
  decode_attention_impl: str = "auto"
  enable_thinking: bool = False
  lora: Lora = Lora()
  adapted_layers: str = "scan"

  def __post_init__(self):
    try:
      model_config.check_attention(self.attention_impl, self.decode_attention_impl,
                                   self.attn_query_chunk, owner="config.model")
    except ValueError as e:
      raise ConfigError(str(e)) from None
    if self.dtype not in model_config.DTYPES:
      raise ConfigError(f"config.model.dtype={self.dtype!r}: use one of "
                        f"{tuple(model_config.DTYPES)}")
    if self.adapted_layers not in model_config.ADAPTED_LAYER_LOOPS:
      raise ConfigError(f"config.model.adapted_layers={self.adapted_layers!r}: use one of "
                        f"{model_config.ADAPTED_LAYER_LOOPS}")
    if self.adapted_layers != "scan" and not self.lora.rank:
      raise ConfigError(f"config.model.adapted_layers={self.adapted_layers!r} loops over "
                        "LoRA adapters: set model.lora.rank > 0 (or leave it 'scan')")
    if self.compute_dtype not in model_config.COMPUTE_DTYPES:
      raise ConfigError(f"config.model.compute_dtype={self.compute_dtype!r}: use one of "
                        f"{model_config.COMPUTE_DTYPES} (auto: bfloat16 on TPU/GPU, model.dtype "
                        f"on CPU; \"\": model.dtype)")


@dataclasses.dataclass(frozen=True)
class Env:
  """`config.env`: the env servers (started here, or `endpoints`) and the task splits."""

  name: str = ""
  args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  """Constructor arguments of the env on the server (env-specific)."""
  endpoints: tuple = ()
  token_file: str = ""
  tls_root_cert: str = ""
  num_servers: int = 2
  deadline_s: float = 120.0
  train_split: str = "train"
  eval_splits: tuple = ("valid_seen", "valid_unseen")
  max_steps: int = 50
  step_latency_ms: float = 0.0
  """Every Step call of the env servers this trainer starts is delayed by this much (a
  remote env's latency, for benchmarks: `launch.benchmarks.async_rollout`)."""

  def __post_init__(self):
    object.__setattr__(self, "args", dict(self.args))
    object.__setattr__(self, "endpoints", tuple(self.endpoints))
    object.__setattr__(self, "eval_splits", tuple(self.eval_splits))
    if self.name not in env_registry.ENVS:
      raise ConfigError(f"unknown env {self.name!r}; registered: {sorted(env_registry.ENVS)}")
    if self.max_steps < 1:
      raise ConfigError(f"config.env.max_steps must be >= 1, got {self.max_steps}")
    if self.step_latency_ms < 0 or (self.step_latency_ms and self.endpoints):
      raise ConfigError(f"config.env.step_latency_ms={self.step_latency_ms:g} delays the env "
                        f"servers this trainer starts: >= 0, and 0 with env.endpoints")
    if not self.endpoints and self.num_servers < 1:
      raise ConfigError("config.env.num_servers must be >= 1 when no env.endpoints are given")
    if self.args.get("retriever") == "local" and self.endpoints:
      raise ConfigError("config.env.args.retriever='local' starts a retriever beside env "
                        "servers this trainer starts; with env.endpoints give the retriever's "
                        "host:port to those servers instead")


@dataclasses.dataclass(frozen=True)
class Algo:
  """`config.algo`: the registered advantage estimator and its options."""

  estimator: registry.Estimator
  """The registered estimator of `config.algo.name` (looked up once)."""
  options: Any
  """The estimator's options dataclass (`config.algo.options`)."""
  gamma: float = 0.95

  @property
  def name(self) -> str:
    return self.estimator.name

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, response_format: str) -> "Algo":
    """The section of `config.algo` (`name`, `gamma`, `options`), the estimator checked
    against the rollout's `response_format` before its options (a config switched to
    `hae` still holds another estimator's options: the format is the error to name)."""
    unknown = sorted(set(d) - {"name", "gamma", "options"})
    if unknown:
      raise ConfigError(f"config.algo.{unknown[0]} is not a setting of this trainer")
    name = d.get("name", "hgpo")
    try:
      est = registry.get(name)
    except KeyError as e:
      raise ConfigError(str(e.args[0])) from None
    if est.needs_critic and est.name not in CRITIC_HEADS:
      raise ConfigError(f"estimator {name!r} needs a critic but the trainer reads "
                        f"critic values only for {sorted(CRITIC_HEADS)}")
    if est.name == "hae" and response_format != "hiper":
      raise ConfigError("estimator 'hae' needs the HiPER response format: set "
                        "config.rollout.response_format='hiper' (configs: algo=hiper)")
    try:
      opts = est.options(**dict(d.get("options") or {}))
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.algo.options for {name!r}: {e}") from None
    return cls(estimator=est, options=opts, gamma=float(d.get("gamma", cls.gamma)))

  def to_dict(self) -> dict[str, Any]:
    return {"name": self.name, "gamma": self.gamma,
            "options": dataclasses.asdict(self.options)}


@dataclasses.dataclass(frozen=True)
class Sampling:
  """The sampler's parameters: training rollouts (`rollout.temperature`, top-p, top-k) and
  evaluation (`eval.temperature`; it reads the responses only, so its calls skip the work
  that only scores them: `SamplingParams.need_logprobs`). Derived from `rollout` and
  `eval`; not a config key."""

  train: sampling_types.SamplingParams
  eval: sampling_types.SamplingParams


@dataclasses.dataclass(frozen=True)
class Train:
  """`config.train`: the trainer loop's options here, the actor update's (optimizer,
  batching, layout, reference) in `update` and its loss's in `update.loss`."""

  update: train_step.UpdateConfig = train_step.UpdateConfig()
  num_iterations: int = 150
  filter_groups: bool = False
  """Dynamic sampling (DAPO, docs/algorithms.md §9.7)."""
  filter_groups_metric: str = "score"
  max_generation_batches: int = 10
  kl_in_reward: bool = False
  """KL to the reference in the reward (§9.4)."""
  kl_reward_estimator: str = "k1"
  kl_reward_coef: float = 0.001
  kl_ctrl: str = "fixed"
  kl_target: float = 0.1
  kl_horizon: int = 10000
  rollout_mismatch_metrics: bool = True
  constrained_logprobs: bool = False
  """The learner scores the constrained policy (§9.8)."""
  max_choices: int = 64
  max_staleness: int = 0
  """Batches played ahead of the update (hgpo_jax/training/async_rollout.py): batch t is
  sampled with the weights after iteration t - 1 - max_staleness; 0: in turn."""

  DERIVED = ("total_iterations", "scored_tail", "loss")
  """UpdateConfig fields set from other keys (`train.num_iterations`,
  `rollout.max_new_tokens`) or nested (the loss): not keys of `config.train`."""

  def __post_init__(self):
    if self.num_iterations < 1:
      raise ConfigError(f"config.train.num_iterations must be >= 1, got {self.num_iterations}")
    if self.filter_groups:
      if self.filter_groups_metric not in rollout_lib.FILTER_METRICS:
        raise ConfigError(f"config.train.filter_groups_metric={self.filter_groups_metric!r}: "
                          f"use one of {rollout_lib.FILTER_METRICS}")
      if self.max_generation_batches < 1:
        raise ConfigError(f"config.train.max_generation_batches={self.max_generation_batches} "
                          f"must be >= 1")
    if self.kl_in_reward:
      try:
        losses.KL_ESTIMATORS.get(self.kl_reward_estimator)
      except KeyError as e:
        raise ConfigError(f"config.train.kl_reward_estimator={self.kl_reward_estimator!r}: "
                          f"{e.args[0]}") from None
      self.kl_controller()
    if self.max_staleness < 0:
      raise ConfigError(f"config.train.max_staleness={self.max_staleness} must be >= 0 "
                        f"(0: rollout and update in turn)")
    if self.constrained_logprobs and self.max_choices < 2:
      raise ConfigError(f"config.train.max_choices={self.max_choices} must be >= 2")

  def kl_controller(self) -> losses.KLController:
    """A new controller of the KL-in-reward coefficient (`kl_in_reward`)."""
    try:
      return losses.KLController(self.kl_reward_coef, self.kl_ctrl, self.kl_target,
                                 self.kl_horizon)
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.train: {e}") from None

  @classmethod
  def from_dict(cls, d: Mapping[str, Any], *, scored_tail: int | None) -> "Train":
    """The section of the flat `config.train` keys: each key is a field of this class, of
    `UpdateConfig` or of `LossConfig`; any other is refused."""
    own = set(_names(cls)) - {"update"}
    update_keys = set(_names(train_step.UpdateConfig)) - set(cls.DERIVED)
    loss_keys = set(_names(losses.LossConfig))
    parts: dict[str, dict[str, Any]] = {"own": {}, "update": {}, "loss": {}}
    for key, value in d.items():
      part = ("own" if key in own else "update" if key in update_keys
              else "loss" if key in loss_keys else None)
      if part is None:
        raise ConfigError(f"config.train.{key} is not a setting of this trainer")
      parts[part][key] = value
    num_iterations = parts["own"].get("num_iterations", cls.num_iterations)
    loss = _build("train", losses.LossConfig, parts["loss"])
    update = _build("train", train_step.UpdateConfig,
                    dict(parts["update"], loss=loss, scored_tail=scored_tail,
                         total_iterations=num_iterations))
    return _build("train", cls, dict(parts["own"], update=update))

  def to_dict(self) -> dict[str, Any]:
    out = {k: getattr(self, k) for k in _names(type(self)) if k != "update"}
    out.update({k: getattr(self.update, k) for k in _names(train_step.UpdateConfig)
                if k not in self.DERIVED})
    out.update(dataclasses.asdict(self.update.loss))
    return out


CRITIC_UPDATE_KEYS = ("lr", "weight_decay", "grad_clip", "lr_schedule", "warmup_steps",
                      "warmup_ratio", "min_lr_ratio", "loss_unit_rows")
"""The critic's own optimizer keys; the rest of its update is the actor's batching."""


@dataclasses.dataclass(frozen=True)
class Critic:
  """`config.critic`: the value model of critic estimators (gae, hae): its optimizer (the
  actor's mini/micro-batches and epochs, as the published scripts), its loss and warmup."""

  lr: float = 1e-5
  weight_decay: float = 0.01
  grad_clip: float = 1.0
  lr_schedule: str = "constant"
  warmup_steps: int = -1
  warmup_ratio: float = 0.0
  min_lr_ratio: float = 0.0
  loss_unit_rows: int = 0
  warmup_iterations: int = 0
  """First iterations that update only the critic (verl trainer.critic_warmup)."""
  value_loss: critic_step.ValueLossConfig = critic_step.ValueLossConfig()

  def __post_init__(self):
    if self.warmup_iterations < 0:
      raise ConfigError(f"config.critic.warmup_iterations must be >= 0, got "
                        f"{self.warmup_iterations}")

  def update(self, actor: train_step.UpdateConfig) -> train_step.UpdateConfig:
    """The critic's update: `actor`'s batching with this section's optimizer keys."""
    try:
      return dataclasses.replace(actor, loss=losses.LossConfig(), scored_tail=None,
                                 **{k: getattr(self, k) for k in CRITIC_UPDATE_KEYS})
    except (TypeError, ValueError) as e:
      raise ConfigError(f"config.critic: {e}") from None

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "Critic":
    loss_keys = set(_names(critic_step.ValueLossConfig))
    value_loss = _build("critic", critic_step.ValueLossConfig,
                        {k: v for k, v in d.items() if k in loss_keys})
    return _build("critic", cls, dict({k: v for k, v in d.items() if k not in loss_keys},
                                      value_loss=value_loss))

  def to_dict(self) -> dict[str, Any]:
    out = {k: getattr(self, k) for k in _names(type(self)) if k != "value_loss"}
    out.update(dataclasses.asdict(self.value_loss))
    return out


@dataclasses.dataclass(frozen=True)
class Eval:
  """`config.eval`: periodic and final evaluation on the held-out splits."""

  every: int = 5
  num_tasks: int = 128
  temperature: float = 0.4
  at_end: bool = True
  repeats: int = 1
  """Evaluations of every held-out task, each with its own evaluation key
  (`evaluation.repeat_key`); the metrics are their means."""
  group_repeats: bool = False
  """Play a task's `repeats` evaluations as one group of trajectories in the same rollout
  calls (`evaluation.evaluate_grouped`: identical prompts prefilled once; other draws than
  `repeats` passes). `repeats` must divide the rollout's env slots."""

  def __post_init__(self):
    if self.repeats < 1:
      raise ConfigError(f"config.eval.repeats={self.repeats} must be >= 1")


@dataclasses.dataclass(frozen=True)
class Mesh:
  """`config.mesh`: data x fsdp x tensor devices (-1 data: all remaining), and where the
  sampler runs: on the training devices (`rollout_devices=0`, shared placement) or on the
  last `rollout_devices` devices of each process, a mesh of its own (`rollout_fsdp` x
  `rollout_tensor`, data the rest), with the training mesh over the others (split
  placement, docs/scaling.md "Rollout ahead of the update")."""

  data: int = -1
  fsdp: int = 1
  tensor: int = 1
  rollout_devices: int = 0
  rollout_fsdp: int = 1
  rollout_tensor: int = 1

  def __post_init__(self):
    n, f, t = self.rollout_devices, self.rollout_fsdp, self.rollout_tensor
    if n < 0 or f < 1 or t < 1:
      raise ConfigError(f"config.mesh.rollout_devices={n}, rollout_fsdp={f}, rollout_tensor={t}"
                        f": need rollout_devices >= 0 and rollout_fsdp, rollout_tensor >= 1")
    if n and n % (f * t):
      raise ConfigError(f"config.mesh.rollout_fsdp x rollout_tensor = {f * t} must divide "
                        f"config.mesh.rollout_devices={n} (the sampler's mesh)")
    if not n and (f, t) != (1, 1):
      raise ConfigError("config.mesh.rollout_fsdp/rollout_tensor shape the sampler's own "
                        "devices: set config.mesh.rollout_devices too")

  @property
  def split(self) -> bool:
    """The sampler runs on devices of its own."""
    return self.rollout_devices > 0


@dataclasses.dataclass(frozen=True)
class Checkpoint:
  """`config.checkpoint`: Orbax checkpoints and where a run resumes from."""

  every: int = 1
  keep: int = 3
  keep_period: int = 50
  resume_from: str = ""


@dataclasses.dataclass(frozen=True)
class Metrics:
  """`config.metrics`: the writers besides metrics.jsonl and what they read."""

  writers: tuple = ("tensorboard",)
  wandb_project: str = ""
  wandb_mode: str = "offline"

  def __post_init__(self):
    object.__setattr__(self, "writers", tuple(self.writers))
    for name in self.writers:
      try:
        missing = metrics_lib.missing_package(name)
      except KeyError as e:
        raise ConfigError(f"config.metrics.writers: {e.args[0]}") from None
      if missing:
        raise ConfigError(f"config.metrics.writers: {missing}")
    self.settings()

  def settings(self, run_config: Optional[Mapping[str, Any]] = None
               ) -> metrics_lib.WriterSettings:
    """What the writers read (`run_config`: the run's settings as a plain dict)."""
    try:
      return metrics_lib.WriterSettings(wandb_project=self.wandb_project,
                                        wandb_mode=self.wandb_mode, run_config=run_config)
    except ValueError as e:
      raise ConfigError(f"config.metrics: {e}") from None


@dataclasses.dataclass(frozen=True)
class Profile:
  """`config.profile`: a jax.profiler trace of some iterations."""

  iterations: int = 0
  skip: int = 1


# ---------------------------------------------------------------------------------------
# The tree
# ---------------------------------------------------------------------------------------
_PLAIN_SECTIONS = {"rollout": rollout_params.RolloutParams, "eval": Eval, "mesh": Mesh,
                   "checkpoint": Checkpoint, "metrics": Metrics, "profile": Profile}


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Every setting of a run, typed and checked (`from_config`); see the module docstring."""

  model: Model
  env: Env
  algo: Algo
  rollout: rollout_params.RolloutParams
  sampling: Sampling
  train: Train
  critic: Critic
  eval: Eval
  mesh: Mesh
  checkpoint: Checkpoint
  metrics: Metrics
  profile: Profile
  seed: int = 0
  allow_cpu: bool = False
  """Run a pod's job on CPUs when JAX finds no accelerator (`cpu_refusal`)."""

  def __post_init__(self):
    _check_across_sections(self)

  @property
  def estimator(self) -> registry.Estimator:
    """The registered estimator (`algo.estimator`)."""
    return self.algo.estimator

  @property
  def critic_update(self) -> train_step.UpdateConfig | None:
    """The critic's update; None for critic-free estimators."""
    return self.critic.update(self.train.update) if self.estimator.needs_critic else None

  def to_dict(self) -> dict[str, Any]:
    """The nested plain dict of the config's keys (JSON-able; `from_dict` reads it back)."""
    out: dict[str, Any] = {"seed": self.seed, "allow_cpu": self.allow_cpu}
    model = dataclasses.asdict(self.model)
    out["model"] = model
    out["env"] = dataclasses.asdict(self.env)
    out["algo"] = self.algo.to_dict()
    out["train"] = self.train.to_dict()
    out["critic"] = self.critic.to_dict()
    for name in _PLAIN_SECTIONS:
      out[name] = dataclasses.asdict(getattr(self, name))
    return out

  def override(self, values: Mapping[str, Any]) -> "Experiment":
    """This experiment with flat keys replaced (`{"mesh.data": 2, "train.lr": 1e-5}`), the
    result checked as a new config."""
    d = self.to_dict()
    for key, value in values.items():
      *path, last = key.split(".")
      node = d
      for part in path:
        node = node[part]
      if last not in node:
        raise ConfigError(f"config.{key} is not a setting of this trainer")
      node[last] = value
    return from_dict(d)


def from_dict(d: Mapping[str, Any]) -> Experiment:
  """The experiment of a nested plain dict of config keys (`ConfigDict.to_dict()`, or a
  saved `Experiment.to_dict()`); one-line ConfigError for a key no section declares or a
  value a check refuses."""
  d = dict(d)
  known = {"seed", "allow_cpu", "model", "env", "algo", "train", "critic", *_PLAIN_SECTIONS}
  unknown = sorted(set(d) - known)
  if unknown:
    raise ConfigError(f"config.{unknown[0]} is not a setting of this trainer")
  get = lambda name: dict(d.get(name) or {})
  model = get("model")
  model["lora"] = _build("model.lora", Lora, dict(model.get("lora") or {}))
  sections = {name: _build(name, cls, get(name)) for name, cls in _PLAIN_SECTIONS.items()}
  rollout = sections["rollout"]
  evaluation = sections["eval"]
  sampling = Sampling(train=_build("rollout", rollout.sampling, {}),
                      eval=_build("eval.temperature", rollout.sampling,
                                  {"temperature": evaluation.temperature,
                                   "need_logprobs": False}))
  return Experiment(
      model=_build("model", Model, model), env=_build("env", Env, get("env")),
      algo=Algo.from_dict(get("algo"), response_format=rollout.response_format),
      sampling=sampling,
      train=Train.from_dict(get("train"), scored_tail=rollout.max_new_tokens),
      critic=Critic.from_dict(get("critic")), seed=int(d.get("seed", 0)),
      allow_cpu=bool(d.get("allow_cpu", False)), **sections)


def from_config(config) -> Experiment:
  """The launch door: a ConfigDict (or a plain nested dict) as an `Experiment`; an
  Experiment is returned as it is."""
  if isinstance(config, Experiment):
    return config
  if hasattr(config, "to_dict"):
    config = config.to_dict()
  return from_dict(config)


# ---------------------------------------------------------------------------------------
# Rules between sections
# ---------------------------------------------------------------------------------------
def _check_across_sections(exp: Experiment) -> None:
  """The rules no section holds alone (docs/algorithms.md §9.1-§9.9; the estimator's
  response format is `Algo.from_dict`'s, before its options): the critic and the update's
  layouts, LoRA and the reference, the training
  options and the sampler."""
  est, t, u = exp.estimator, exp.train, exp.train.update
  if exp.critic.warmup_iterations and not est.needs_critic:
    raise ConfigError(f"config.critic.warmup_iterations={exp.critic.warmup_iterations} needs an "
                      f"estimator with a critic (algo=ppo|hiper); {est.name!r} has none")
  try:
    train_step.check_reference_with_adapters(u, bool(exp.model.lora.config.rank))
  except ValueError as e:
    raise ConfigError(f"config.train.{e} (model.lora.rank={exp.model.lora.rank})") from None
  for name in ("pack_rows", "group_by_length"):
    if getattr(u, name) and est.needs_critic:
      raise ConfigError(f"config.train.{name} lays out the actor update of critic-free estimators; "
                        f"{est.name!r} trains a critic on the unpacked rows: set it to false")
  if t.max_staleness and est.needs_critic:
    raise ConfigError(f"config.train.max_staleness={t.max_staleness} plays rollouts ahead for "
                      f"critic-free estimators; {est.name!r} estimates with a critic whose "
                      f"values would be of a later policy than the rows: set it to 0")
  if t.filter_groups:
    if est.needs_critic:
      raise ConfigError(f"config.train.filter_groups drops groups of equal outcomes for "
                        f"group-based estimators; {est.name!r} has a critic and no groups: "
                        f"set it to false")
    if exp.rollout.group_size < 2:
      raise ConfigError(f"config.train.filter_groups needs rollout.group_size >= 2 (a group of "
                        f"one is always uniform), got {exp.rollout.group_size}")
  slots = exp.rollout.num_groups * exp.rollout.group_size
  if exp.eval.group_repeats and exp.eval.repeats > 1 and slots % exp.eval.repeats:
    raise ConfigError(f"config.eval.group_repeats plays a task's eval.repeats="
                      f"{exp.eval.repeats} evaluations as one group in the rollout's {slots} "
                      f"env slots (rollout.num_groups x group_size): repeats must divide them")
  loss = u.loss
  corrected = loss.rollout_is != "none" or loss.rollout_rs != "none"
  if t.constrained_logprobs:
    if not exp.rollout.constrained:
      raise ConfigError("config.train.constrained_logprobs scores the constrained policy; it "
                        "needs rollout.constrained=true")
    if corrected:
      raise ConfigError(f"config.train.constrained_logprobs with rollout_is={loss.rollout_is!r} / "
                        f"rollout_rs={loss.rollout_rs!r}: the sampler's log-probs are the "
                        f"unconstrained ones; set both to 'none'")
  for name in ("pack_rows", "group_by_length"):
    if getattr(u, name) and corrected:
      raise ConfigError(f"config.train.{name} with rollout_is={loss.rollout_is!r} / rollout_rs="
                        f"{loss.rollout_rs!r}: the rollout correction reads the sampler's log-probs "
                        f"in the plain row layout; set {name} to false")
  if u.pack_rows and loss.policy_loss == "gspo":
    raise ConfigError("config.train.pack_rows with policy_loss='gspo': GSPO's ratio is one per "
                      "step's response, a row of the plain layout; set pack_rows to false")
  k = getattr(exp.algo.options, "k", exp.rollout.history_length)
  if k != exp.rollout.history_length:
    raise ConfigError(
        f"config.algo.options.k={k} differs from config.rollout.history_length="
        f"{exp.rollout.history_length}; HGPO's depth K is the prompt memory window H "
        f"(docs/algorithms.md §6): set both, e.g. with the config argument k={k}")
  if est.needs_critic:
    exp.critic_update  # raises for the critic's optimizer keys


# ---------------------------------------------------------------------------------------
# What the trainer derives from the settings
# ---------------------------------------------------------------------------------------
BF16_LOST_STEP_LR = 1e-4
"""Below this learning rate, AdamW steps on bf16 parameters round away for most weights."""


def precision_warnings(exp: Experiment) -> list[str]:
  """Settings that run but do not do what they say, one line each (the trainer logs them,
  `launch.plan` prints them).

  bf16 parameters keep 8 significant bits, so a weight w moves only under a step larger
  than about |w| x 2^-9; AdamW's step is about the learning rate per weight. At the
  papers' lr 1e-6, a +-1e-6 step changes 1.9 % of N(0, 0.02) bf16 weights (docs/
  performance.md, "bf16 parameters"): the policy barely trains. float32 parameters with
  bf16 compute (`model.compute_dtype=bfloat16`) are the mixed precision of the papers.
  """
  out = []
  if exp.model.dtype == "bfloat16":
    for name, lr, used in (("train.lr", exp.train.update.lr, True),
                           ("critic.lr", exp.critic.lr, exp.estimator.needs_critic)):
      if lr < BF16_LOST_STEP_LR and used:
        out.append(f"model.dtype=bfloat16 with {name}={lr:g}: AdamW's steps (~lr per weight) "
                   f"are below bf16's spacing for most weights and round away; keep float32 "
                   f"parameters and set model.compute_dtype=bfloat16 (docs/performance.md)")
  return out


def cpu_refusal(exp: Experiment, *, platform: str, num_devices: int,
                distributed: bool) -> str | None:
  """Why `exp` cannot be meant for the devices JAX found when they are CPUs (one line,
  naming `--config.allow_cpu=true`), or None: on a host whose GPU/TPU JAX cannot see (a CPU
  `jaxlib` only, a missing plugin) the trainer would otherwise run a pod's job on the CPU.

  Refused on CPUs unless `allow_cpu`: a pretrained preset that needs weights (`model.path`,
  1.5B/7B) whose path exists (a path that does not exist fails on its own line when the
  model loads), a mesh (`mesh.data * mesh.fsdp * mesh.tensor`, the positive sizes, plus
  `mesh.rollout_devices`) asking
  for more devices than found, and a multi-process run (`--distributed`).
  """
  if platform != "cpu" or exp.allow_cpu:
    return None
  reasons = []
  name, path = exp.model.name, exp.model.path
  if name in model_config.PRESETS_WITH_PATH and path and os.path.exists(path):
    reasons.append(f"model {name} is meant for accelerators")
  m = exp.mesh
  sizes = {"data": m.data, "fsdp": m.fsdp, "tensor": m.tensor}
  asked = math.prod(v for v in sizes.values() if v > 0) + m.rollout_devices
  if asked > num_devices:
    mesh = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1)
    if m.rollout_devices:
      mesh += f"{' + ' if mesh else ''}{m.rollout_devices} for the sampler"
    reasons.append(f"config.mesh asks for {asked} devices ({mesh})")
  if distributed:
    reasons.append("--distributed starts a multi-host run")
  if not reasons:
    return None
  return (f"{'; '.join(reasons)}, but JAX found only CPUs ({num_devices} device"
          f"{'s' if num_devices != 1 else ''}): install JAX for the accelerator (make venv "
          "ACCEL=cuda12 or ACCEL=tpu) or pass --config.allow_cpu=true to run on the CPUs")


def groups_per_process(rollout: rollout_params.RolloutParams,
                       num_processes: int | None = None) -> int:
  """`rollout.num_groups` is global; each process plays an equal contiguous share."""
  nproc = jax.process_count() if num_processes is None else num_processes
  if rollout.num_groups % nproc:
    raise ConfigError(f"config.rollout.num_groups={rollout.num_groups} must be a multiple "
                      f"of the number of processes ({nproc}): each process plays an equal share")
  return rollout.num_groups // nproc


def model_settings(model: Model, cfg: model_config.ModelConfig,
                   mesh=None) -> model_config.ModelConfig:
  """`cfg` with the run's numerics: activations and matmul inputs in `model.compute_dtype`
  (`model_config.resolve_compute_dtype` for the platform of `mesh`'s devices, of the local
  devices without a mesh: "auto" is bfloat16 on TPUs and GPUs and `model.dtype` on CPUs;
  "bfloat16" over float32 parameters is mixed precision: f32 weights, optimizer and
  gradients, bf16 products summed in f32), `model.remat`, `model.attn_query_chunk` and
  `model.attention_impl` ("auto" resolved by the platform of `mesh`'s devices when a mesh
  is given, `attention.resolve_impl`; on CPU it stays "auto" and each attention call picks
  by its own sequence length)."""
  impl = model.attention_impl
  target = platform.target_platform(jax.local_devices() if mesh is None else mesh)
  dtype = model_config.resolve_compute_dtype(model.compute_dtype, model.dtype, target)
  if mesh is not None:
    impl = attention.resolve_impl(impl, mesh, dtype)
  lora = model.lora.config
  # with LoRA the frozen base is stored in the compute dtype (the adapters are float32)
  try:
    return cfg.replace(dtype=dtype, lora=lora,
                       param_dtype=dtype if lora.rank else cfg.param_dtype,
                       remat=bool(model.remat),
                       attn_query_chunk=model.attn_query_chunk, attention_impl=impl,
                       decode_attention_impl=model.decode_attention_impl,
                       adapted_layers=model.adapted_layers)
  except ValueError as e:  # a setting the model cannot take (model.lora.top_layers)
    raise ConfigError(f"config.{e.args[0]}") from None
