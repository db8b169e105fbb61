"""The typed, validated settings of a run: `validate(config) -> RunConfig`.

Every check that can fail on a config runs here, before any model, env server or compile:
an error names the key and what to set, in one line (`ConfigError`). The field checks live
in the settings dataclasses' `__post_init__` (`UpdateConfig`, `LossConfig`,
`ValueLossConfig`, `RolloutParams`, `SamplingParams`); this module converts the config's
sections into them and checks what no dataclass holds (env, iteration count, server count,
processes) and the rules across sections.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import ml_collections

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


def estimator_and_options(config: ml_collections.ConfigDict):
  """The registered estimator and its validated options (the registry is the name list)."""
  try:
    est = registry.get(config.algo.name)
  except KeyError as e:
    raise ConfigError(str(e.args[0])) from None
  if est.needs_critic and est.name not in CRITIC_HEADS:
    raise ConfigError(f"estimator {config.algo.name!r} needs a critic but the trainer reads "
                      f"critic values only for {sorted(CRITIC_HEADS)}")
  if est.name == "hae" and config.rollout.response_format != "hiper":
    raise ConfigError("estimator 'hae' needs the HiPER response format: set "
                      "config.rollout.response_format='hiper' (configs: algo=hiper)")
  try:
    opts = est.options(**config.algo.options.to_dict())
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.algo.options for {config.algo.name!r}: {e}") from None
  return est, opts


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The typed parts of a config, built and validated once by `validate`; their field
  names are the config's (`train.lr` -> `UpdateConfig.lr`, `rollout.*` -> `RolloutParams`)."""

  estimator: registry.Estimator
  options: Any
  """The estimator's options dataclass (`config.algo.options`)."""
  update: train_step.UpdateConfig
  """The actor update (`config.train`)."""
  critic_update: train_step.UpdateConfig | None
  """The critic update (`config.critic` lr/weight_decay/grad_clip, the actor's batching);
  None for critic-free estimators."""
  value_loss: critic_step.ValueLossConfig | None
  rollout: rollout_params.RolloutParams
  sampling: sampling_types.SamplingParams
  """Training rollouts (`config.rollout.temperature`)."""
  eval_sampling: sampling_types.SamplingParams
  """Evaluation (`config.eval.temperature`)."""
  metric_writers: tuple[str, ...]
  """Names of `metrics_lib.WRITERS` the trainer writes with besides metrics.jsonl
  (`config.metrics.writers`)."""
  writer_settings: metrics_lib.WriterSettings
  """What those writers read (`config.metrics`)."""


def _fields(cls, *sections: ml_collections.ConfigDict) -> dict[str, Any]:
  """The entries of the config sections that share a name with a field of `cls` (later
  sections win)."""
  names = {f.name for f in dataclasses.fields(cls)}
  return {k: v for s in sections for k, v in s.to_dict().items() if k in names}


def _typed(section: str, build, *args, **kwargs):
  """`build(*args, **kwargs)`; its ValueError/TypeError becomes a ConfigError naming the section."""
  try:
    return build(*args, **kwargs)
  except (TypeError, ValueError) as e:
    raise ConfigError(f"config.{section}: {e}") from None


BF16_LOST_STEP_LR = 1e-4
"""Below this learning rate, AdamW steps on bf16 parameters round away for most weights."""


def precision_warnings(config: ml_collections.ConfigDict) -> list[str]:
  """Settings that run but do not do what they say, one line each (the trainer logs them,
  `launch.plan` prints them).

  bf16 parameters keep 8 significant bits, so a weight w moves only under a step larger
  than about |w| x 2^-9; AdamW's step is about the learning rate per weight. At the
  papers' lr 1e-6, a +-1e-6 step changes 1.9 % of N(0, 0.02) bf16 weights (docs/
  performance.md, "bf16 parameters"): the policy barely trains. float32 parameters with
  bf16 compute (`model.compute_dtype=bfloat16`) are the mixed precision of the papers.
  """
  out = []
  if config.model.dtype == "bfloat16":
    for name in ("train.lr", "critic.lr"):
      section, key = name.split(".")
      lr = config[section][key]
      if lr < BF16_LOST_STEP_LR and (section == "train" or _needs_critic(config)):
        out.append(f"model.dtype=bfloat16 with {name}={lr:g}: AdamW's steps (~lr per weight) "
                   f"are below bf16's spacing for most weights and round away; keep float32 "
                   f"parameters and set model.compute_dtype=bfloat16 (docs/performance.md)")
  return out


def _needs_critic(config: ml_collections.ConfigDict) -> bool:
  try:
    return estimator_and_options(config)[0].needs_critic
  except Exception:  # noqa: BLE001  (validate reports a bad estimator with its own line)
    return False


def validate(config: ml_collections.ConfigDict) -> RunConfig:
  """Fails fast, with one line, on configs that cannot run; returns their typed parts.

  The field checks live in the dataclasses' `__post_init__`; only the keys no dataclass
  holds (env, iteration count, server count) and cross-section rules are checked here.
  """
  est, opts = estimator_and_options(config)
  if config.env.name not in env_registry.ENVS:
    raise ConfigError(f"unknown env {config.env.name!r}; registered: {sorted(env_registry.ENVS)}")
  for name, value in (("env.max_steps", config.env.max_steps),
                      ("train.num_iterations", config.train.num_iterations)):
    if value < 1:
      raise ConfigError(f"config.{name} must be >= 1, got {value}")
  if config.critic.warmup_iterations < 0:
    raise ConfigError(f"config.critic.warmup_iterations must be >= 0, got {config.critic.warmup_iterations}")
  if config.critic.warmup_iterations and not est.needs_critic:
    raise ConfigError(f"config.critic.warmup_iterations={config.critic.warmup_iterations} needs an "
                      f"estimator with a critic (algo=ppo|hiper); {est.name!r} has none")
  if config.model.attn_query_chunk < 0:
    raise ConfigError(f"config.model.attn_query_chunk={config.model.attn_query_chunk} must be >= 0 (0: off)")
  if config.model.decode_attention_impl not in attention.DECODE_CHOICES:
    raise ConfigError(f"config.model.decode_attention_impl={config.model.decode_attention_impl!r}: "
                      f"use one of {attention.DECODE_CHOICES}")
  if config.model.attention_impl not in attention.CHOICES:
    raise ConfigError(f"config.model.attention_impl={config.model.attention_impl!r}: use one of "
                      f"{attention.CHOICES}")
  if config.model.dtype not in model_config.DTYPES:
    raise ConfigError(f"config.model.dtype={config.model.dtype!r}: use one of "
                      f"{tuple(model_config.DTYPES)}")
  if config.model.compute_dtype not in model_config.COMPUTE_DTYPES:
    raise ConfigError(f"config.model.compute_dtype={config.model.compute_dtype!r}: use one of "
                      f"{model_config.COMPUTE_DTYPES} (auto: bfloat16 on TPU/GPU, model.dtype "
                      f"on CPU; \"\": model.dtype)")
  lora = lora_config(config)
  if lora.rank and (config.train.reference_memory != "device"
                    or config.train.reference_dtype not in ("", "auto")):
    raise ConfigError(f"config.train.reference_memory={config.train.reference_memory!r} / "
                      f"reference_dtype={config.train.reference_dtype!r} do not apply with "
                      f"model.lora.rank={lora.rank}: the reference is the frozen base with the "
                      f"adapters off (no copy); leave them at device / auto")
  if config.model.get("lora") and config.model.lora.path and not os.path.isdir(
      config.model.lora.path):
    raise ConfigError(f"config.model.lora.path={config.model.lora.path!r} is not a directory "
                      f"(a PEFT adapter: adapter_config.json + adapter_model.safetensors)")
  if not config.env.endpoints and config.env.num_servers < 1:
    raise ConfigError("config.env.num_servers must be >= 1 when no env.endpoints are given")
  if config.env.args.get("retriever") == "local" and config.env.endpoints:
    raise ConfigError("config.env.args.retriever='local' starts a retriever beside env servers "
                      "this trainer starts; with env.endpoints give the retriever's host:port "
                      "to those servers instead")
  for name in ("pack_rows", "group_by_length"):
    if config.train[name] and est.needs_critic:
      raise ConfigError(f"config.train.{name} lays out the actor update of critic-free estimators; "
                        f"{est.name!r} trains a critic on the unpacked rows: set it to false")
  _check_train_options(config, est)
  rollout = _typed("rollout", rollout_params.RolloutParams, **config.rollout.to_dict())
  if getattr(opts, "k", rollout.history_length) != rollout.history_length:
    raise ConfigError(
        f"config.algo.options.k={opts.k} differs from config.rollout.history_length="
        f"{rollout.history_length}; HGPO's depth K is the prompt memory window H "
        f"(docs/algorithms.md §6): set both, e.g. with the config argument k={opts.k}")
  writers, writer_settings = metric_writers(config)
  critic = est.needs_critic
  return RunConfig(
      estimator=est, options=opts, update=_typed("train", update_config, config),
      critic_update=_typed("critic", critic_update_config, config) if critic else None,
      value_loss=_typed("critic", critic_step.ValueLossConfig,
                        **_fields(critic_step.ValueLossConfig, config.critic)) if critic else None,
      rollout=rollout, sampling=_typed("rollout", rollout.sampling),
      eval_sampling=_typed("eval.temperature", rollout.sampling, config.eval.temperature),
      metric_writers=writers, writer_settings=writer_settings)


def metric_writers(config: ml_collections.ConfigDict
                   ) -> tuple[tuple[str, ...], metrics_lib.WriterSettings]:
  """`config.metrics`: the writer names, each registered (`metrics_lib.WRITERS`) with its
  package installed, and their settings; ConfigError in one line otherwise."""
  m = config.metrics
  for name in m.writers:
    try:
      missing = metrics_lib.missing_package(name)
    except KeyError as e:
      raise ConfigError(f"config.metrics.writers: {e.args[0]}") from None
    if missing:
      raise ConfigError(f"config.metrics.writers: {missing}")
  settings = _typed("metrics", metrics_lib.WriterSettings, wandb_project=m.wandb_project,
                    wandb_mode=m.wandb_mode)
  return tuple(m.writers), settings


def cpu_refusal(config: ml_collections.ConfigDict, *, platform: str, num_devices: int,
                distributed: bool) -> str | None:
  """Why `config` cannot be meant for the devices JAX found when they are CPUs (one line,
  naming `--config.allow_cpu=true`), or None: on a host whose GPU/TPU JAX cannot see (a CPU
  `jaxlib` only, a missing plugin) the trainer would otherwise run a pod's job on the CPU.

  Refused on CPUs unless `config.allow_cpu`: a pretrained preset that needs weights
  (`model.path`, 1.5B/7B) whose path exists (a path that does not exist fails on its own
  line when the model loads), a mesh (`mesh.data * mesh.fsdp * mesh.tensor`, the positive
  sizes) asking for more devices than found, and a multi-process run (`--distributed`).
  """
  if platform != "cpu" or config.get("allow_cpu", False):
    return None
  reasons = []
  name, path = config.model.name, config.model.path
  if name in model_config.PRESETS_WITH_PATH and path and os.path.exists(path):
    reasons.append(f"model {name} is meant for accelerators")
  sizes = {k: config.mesh[k] for k in ("data", "fsdp", "tensor")}
  asked = math.prod(v for v in sizes.values() if v > 0)
  if asked > num_devices:
    mesh = " x ".join(f"{k} {v}" for k, v in sizes.items() if v > 1)
    reasons.append(f"config.mesh asks for {asked} devices ({mesh})")
  if distributed:
    reasons.append("--distributed starts a multi-host run")
  if not reasons:
    return None
  return (f"{'; '.join(reasons)}, but JAX found only CPUs ({num_devices} device"
          f"{'s' if num_devices != 1 else ''}): install JAX for the accelerator (make venv "
          "ACCEL=cuda12 or ACCEL=tpu) or pass --config.allow_cpu=true to run on the CPUs")


def groups_per_process(config: ml_collections.ConfigDict, num_processes: int | None = None) -> int:
  """config.rollout.num_groups is global; each process plays an equal contiguous share."""
  nproc = jax.process_count() if num_processes is None else num_processes
  if config.rollout.num_groups % nproc:
    raise ConfigError(f"config.rollout.num_groups={config.rollout.num_groups} must be a multiple "
                      f"of the number of processes ({nproc}): each process plays an equal share")
  return config.rollout.num_groups // nproc


def model_settings(config: ml_collections.ConfigDict, cfg: model_config.ModelConfig,
                   mesh=None) -> model_config.ModelConfig:
  """`cfg` with the run's numerics: activations and matmul inputs in `model.compute_dtype`
  (`model_config.resolve_compute_dtype` for the platform of `mesh`'s devices, of the local
  devices without a mesh: "auto" is bfloat16 on TPUs and GPUs and `model.dtype` on CPUs;
  "bfloat16" over float32 parameters is mixed precision: f32 weights, optimizer and
  gradients, bf16 products summed in f32), `model.remat`, `model.attn_query_chunk` and
  `model.attention_impl` ("auto" resolved by the platform of `mesh`'s devices when a mesh
  is given, `attention.resolve_impl`; on CPU it stays "auto" and each attention call picks
  by its own sequence length)."""
  impl = config.model.attention_impl
  target = platform.target_platform(jax.local_devices() if mesh is None else mesh)
  dtype = model_config.resolve_compute_dtype(config.model.compute_dtype, config.model.dtype,
                                             target)
  if mesh is not None:
    impl = attention.resolve_impl(impl, mesh, dtype)
  lora = lora_config(config)
  # with LoRA the frozen base is stored in the compute dtype (the adapters are float32)
  try:
    return cfg.replace(dtype=dtype, lora=lora,
                       param_dtype=dtype if lora.rank else cfg.param_dtype,
                       remat=bool(config.model.remat),
                       attn_query_chunk=config.model.attn_query_chunk, attention_impl=impl,
                       decode_attention_impl=config.model.decode_attention_impl)
  except ValueError as e:  # a setting the model cannot take (model.lora.top_layers)
    raise ConfigError(f"config.{e.args[0]}") from None


def lora_config(config: ml_collections.ConfigDict) -> lora_lib.LoraConfig:
  """`config.model.lora` as a LoraConfig (rank 0 when the section is absent); raises
  ConfigError naming the bad key."""
  section = config.model.get("lora")
  if section is None:
    return lora_lib.LoraConfig()
  try:
    return lora_lib.from_settings(section.rank, section.alpha, section.targets, section.rslora,
                                  section.get("top_layers", 0))
  except ValueError as e:
    raise ConfigError(f"config.{e.args[0]}") from None


TRAINER_KEYS = ("num_iterations", "filter_groups", "filter_groups_metric",
                "max_generation_batches", "kl_in_reward", "kl_reward_estimator", "kl_reward_coef",
                "kl_ctrl", "kl_target", "kl_horizon", "rollout_mismatch_metrics",
                "constrained_logprobs", "max_choices")
"""The `config.train` keys the trainer loop reads itself (hgpo_jax/train.py, run.py); every
other one is a field of `UpdateConfig` or `LossConfig`."""


def _check_train_options(config: ml_collections.ConfigDict, est) -> None:
  """The rules of the training options that no dataclass holds alone (docs/algorithms.md
  §9.1-§9.7): dynamic sampling, the KL in the reward, and the layouts the sequence-level
  options need."""
  t = config.train
  if t.filter_groups:
    if est.needs_critic:
      raise ConfigError(f"config.train.filter_groups drops groups of equal outcomes for "
                        f"group-based estimators; {est.name!r} has a critic and no groups: "
                        f"set it to false")
    if config.rollout.group_size < 2:
      raise ConfigError(f"config.train.filter_groups needs rollout.group_size >= 2 (a group of "
                        f"one is always uniform), got {config.rollout.group_size}")
    if t.filter_groups_metric not in rollout_lib.FILTER_METRICS:
      raise ConfigError(f"config.train.filter_groups_metric={t.filter_groups_metric!r}: use one "
                        f"of {rollout_lib.FILTER_METRICS}")
    if t.max_generation_batches < 1:
      raise ConfigError(f"config.train.max_generation_batches={t.max_generation_batches} must "
                        f"be >= 1")
  if t.kl_in_reward:
    try:
      losses.KL_ESTIMATORS.get(t.kl_reward_estimator)
    except KeyError as e:
      raise ConfigError(f"config.train.kl_reward_estimator={t.kl_reward_estimator!r}: "
                        f"{e.args[0]}") from None
    _typed("train", losses.KLController, t.kl_reward_coef, t.kl_ctrl, t.kl_target, t.kl_horizon)
  corrected = t.rollout_is != "none" or t.rollout_rs != "none"
  if t.constrained_logprobs:
    if not config.rollout.constrained:
      raise ConfigError("config.train.constrained_logprobs scores the constrained policy; it "
                        "needs rollout.constrained=true")
    if corrected:
      raise ConfigError(f"config.train.constrained_logprobs with rollout_is={t.rollout_is!r} / "
                        f"rollout_rs={t.rollout_rs!r}: the sampler's log-probs are the "
                        f"unconstrained ones; set both to 'none'")
    if t.max_choices < 2:
      raise ConfigError(f"config.train.max_choices={t.max_choices} must be >= 2")
  for name in ("pack_rows", "group_by_length"):
    if t[name] and corrected:
      raise ConfigError(f"config.train.{name} with rollout_is={t.rollout_is!r} / rollout_rs="
                        f"{t.rollout_rs!r}: the rollout correction reads the sampler's log-probs "
                        f"in the plain row layout; set {name} to false")
  if t.pack_rows and t.policy_loss == "gspo":
    raise ConfigError("config.train.pack_rows with policy_loss='gspo': GSPO's ratio is one per "
                      "step's response, a row of the plain layout; set pack_rows to false")


def critic_update_config(config: ml_collections.ConfigDict) -> train_step.UpdateConfig:
  """The critic's optimizer (`config.critic`: its own lr, weight decay, clip, learning-rate
  schedule) and the actor's mini/micro-batches and epochs (`config.train`), as the
  published scripts."""
  return train_step.UpdateConfig(**_fields(train_step.UpdateConfig, config.train, config.critic),
                                 total_iterations=config.train.num_iterations)


def update_config(config: ml_collections.ConfigDict) -> train_step.UpdateConfig:
  """The actor update: the fields of `config.train` named like `UpdateConfig`'s and
  `LossConfig`'s; only the response columns are scored."""
  return train_step.UpdateConfig(
      **_fields(train_step.UpdateConfig, config.train), scored_tail=config.rollout.max_new_tokens,
      total_iterations=config.train.num_iterations,
      loss=losses.LossConfig(**_fields(losses.LossConfig, config.train)))
