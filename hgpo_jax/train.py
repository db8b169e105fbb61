"""The trainer: `train_and_evaluate(config, workdir)`.

One iteration (docs/architecture.md "The data flow of one iteration"; its programs come
from the registry of hgpo_jax/training/programs.py):
  tasks (TFDS, deterministic in seed/iteration/process) -> rollout through the env
  servers and the jit sampler -> host grouping -> jit advantage estimator -> token
  batch -> old/reference log-probs -> sharded, donated PPO updates -> metrics,
  checkpoint, periodic evaluation.

Reproducibility: `config.seed` gives the model-init key, the sampler key (per
iteration `fold_in(key, iteration)`), the task-shuffle seed and the env seeds
(`tasks.group_seed(seed, iteration, group)`); the iteration number is the whole task
cursor. Same seed and config on the same machine give the same metrics, and resuming
from a checkpoint continues exactly like an uninterrupted run (tested). Wall-clock
timings (`time/*`) are the only metrics that differ between such runs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np
import tqdm
from flax import nnx
from jax.experimental import multihost_utils

from hgpo_jax import perf
from hgpo_jax.advantages import dump as dump_lib
from hgpo_jax.advantages import grouping
from hgpo_jax.advantages import registry
from hgpo_jax.envs import launcher
from hgpo_jax.envs import pool as pool_lib
from hgpo_jax.models import attention
from hgpo_jax.models import config as model_config
from hgpo_jax.models import critic as critic_lib
from hgpo_jax.models import loading
from hgpo_jax.models import sharding
from hgpo_jax.rollout import params as rollout_params
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.rollout import tasks as tasks_lib
from hgpo_jax.sampling import sampler as sampler_lib
from hgpo_jax.training import checkpoint as checkpoint_lib
from hgpo_jax.training import critic_step
from hgpo_jax.training import losses
from hgpo_jax.training import metrics as metrics_lib
from hgpo_jax.training import packing
from hgpo_jax.training import processes
from hgpo_jax.training import programs
from hgpo_jax.training import progress as phases
from hgpo_jax.training import train_batch as train_batch_lib
from hgpo_jax.training import train_step
from hgpo_jax.training import value_targets

# Critic-based estimators the trainer supports -> number of value heads.
CRITIC_HEADS = programs.CRITIC_HEADS  # value heads per critic estimator (the registry's)
PROMPT_BUCKETS = programs.PROMPT_BUCKETS  # the sampler's prompt buckets (the registry's)
# Presets whose weights live in a user directory (config.model.path).
MODELS_WITH_PATH = loading.PRESETS_WITH_PATH  # presets whose weights are a local directory


class ConfigError(ValueError):
  """A config that cannot run; raised before any expensive work starts."""


# ---------------------------------------------------------------------------------------
# Config validation
# ---------------------------------------------------------------------------------------
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
  sampling: sampler_lib.SamplingParams
  """Training rollouts (`config.rollout.temperature`)."""
  eval_sampling: sampler_lib.SamplingParams
  """Evaluation (`config.eval.temperature`)."""


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


def validate(config: ml_collections.ConfigDict) -> RunConfig:
  """Fails fast, with one line, on configs that cannot run; returns their typed parts.

  The field checks live in the dataclasses' `__post_init__`; only the keys no dataclass
  holds (env, iteration count, server count) and cross-section rules are checked here.
  """
  est, opts = estimator_and_options(config)
  from env_servers import registry as env_registry
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
  if config.model.attention_impl not in attention.CHOICES:
    raise ConfigError(f"config.model.attention_impl={config.model.attention_impl!r}: use one of "
                      f"{attention.CHOICES}")
  for name in ("dtype", "compute_dtype"):
    value = config.model[name]
    if value not in model_config.DTYPES and not (name == "compute_dtype" and value == ""):
      raise ConfigError(f"config.model.{name}={value!r}: use one of {tuple(model_config.DTYPES)}"
                        + (' or "" (= model.dtype)' if name == "compute_dtype" else ""))
  if not config.env.endpoints and config.env.num_servers < 1:
    raise ConfigError("config.env.num_servers must be >= 1 when no env.endpoints are given")
  for name in ("pack_rows", "group_by_length"):
    if config.train[name] and est.needs_critic:
      raise ConfigError(f"config.train.{name} lays out the actor update of critic-free estimators; "
                        f"{est.name!r} trains a critic on the unpacked rows: set it to false")
  rollout = _typed("rollout", rollout_params.RolloutParams, **config.rollout.to_dict())
  if getattr(opts, "k", rollout.history_length) != rollout.history_length:
    raise ConfigError(
        f"config.algo.options.k={opts.k} differs from config.rollout.history_length="
        f"{rollout.history_length}; HGPO's depth K is the prompt memory window H "
        f"(docs/algorithms.md §6): set both, e.g. with the config argument k={opts.k}")
  critic = est.needs_critic
  return RunConfig(
      estimator=est, options=opts, update=_typed("train", update_config, config),
      critic_update=_typed("critic", critic_update_config, config) if critic else None,
      value_loss=_typed("critic", critic_step.ValueLossConfig,
                        **_fields(critic_step.ValueLossConfig, config.critic)) if critic else None,
      rollout=rollout, sampling=_typed("rollout", rollout.sampling),
      eval_sampling=_typed("eval.temperature", rollout.sampling, config.eval.temperature))


def model_settings(config: ml_collections.ConfigDict, cfg: model_config.ModelConfig,
                   mesh=None) -> model_config.ModelConfig:
  """`cfg` with the run's numerics: activations and matmul inputs in `model.compute_dtype`
  ("" = `model.dtype`, the parameters' dtype; "bfloat16" over float32 parameters is mixed
  precision: f32 weights, optimizer and gradients, bf16 products summed in f32),
  `model.remat`, `model.attn_query_chunk` and `model.attention_impl` ("auto" resolved by the
  platform of `mesh`'s devices when a mesh is given, `attention.resolve_impl`)."""
  impl = config.model.attention_impl
  dtype = config.model.compute_dtype or config.model.dtype
  if mesh is not None:
    impl = attention.resolve_impl(impl, mesh, dtype)
  return cfg.replace(dtype=dtype,
                     remat=bool(config.model.remat), attn_query_chunk=config.model.attn_query_chunk,
                     attention_impl=impl)


def critic_update_config(config: ml_collections.ConfigDict) -> train_step.UpdateConfig:
  """The critic's optimizer (`config.critic`: its own lr, weight decay, clip) and the actor's
  mini/micro-batches and epochs (`config.train`), as the published scripts."""
  return train_step.UpdateConfig(**_fields(train_step.UpdateConfig, config.train, config.critic))


def update_config(config: ml_collections.ConfigDict) -> train_step.UpdateConfig:
  """The actor update: the fields of `config.train` named like `UpdateConfig`'s and
  `LossConfig`'s; only the response columns are scored."""
  return train_step.UpdateConfig(
      **_fields(train_step.UpdateConfig, config.train), scored_tail=config.rollout.max_new_tokens,
      loss=losses.LossConfig(**_fields(losses.LossConfig, config.train)))


def collect(pool, sampler, tokenizer, tasks, group_size: int, config: ml_collections.ConfigDict,
            run: RunConfig, *, sampling: sampler_lib.SamplingParams, rng: jax.Array,
            on_step=None) -> rollout_lib.Rollout:
  """One batched rollout with the config's env and rollout settings: the training rollout
  (`run.sampling`) and evaluation (`run.eval_sampling`) both play through here."""
  r = run.rollout
  return rollout_lib.collect(
      pool, sampler, tokenizer, tasks, group_size, env_name=config.env.name,
      max_steps=config.env.max_steps, history_length=r.history_length, sampling=sampling, rng=rng,
      max_prompt_tokens=r.max_prompt_tokens, constrained=r.constrained,
      fallback_chars=r.fallback_chars, response_format=r.response_format,
      free_query_tokens=r.free_query_tokens, subgoal_tokens=r.subgoal_tokens,
      format_instructions=r.format_instructions, history_drop_chars=r.history_drop_chars,
      on_step=on_step)


# ---------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------
def compute_advantages(rows, est, opts, *, gamma: float, invalid_penalty: float, capacity: int):
  """Row advantages (input order) and grouping statistics for the rollout's rows."""
  num_levels = getattr(opts, "k", 0) + 1
  grouped = grouping.build_row_batch(rollout_lib.advantage_columns(rows), num_levels=num_levels,
                                     gamma=gamma, invalid_penalty=invalid_penalty,
                                     capacity=capacity, **grouping.grouping_options(opts))
  out = est(jax.device_put(grouped.batch), opts)
  adv = grouped.rejoin(rows, np.asarray(out.advantage))  # by (traj, step), not position
  ret = grouped.rejoin(rows, np.asarray(grouped.batch.returns))
  return adv, ret, group_statistics(grouped)


def group_statistics(grouped) -> dict[str, float]:
  """Step-group sizes per level (GiGPO §5.5): mean size and singleton fraction."""
  b, n = grouped.batch, grouped.num_rows
  out = {}
  for k in range(b.context_group.shape[0]):
    ids = np.asarray(b.context_group[k][:n])
    ids = ids[ids >= 0]
    if ids.size == 0:
      continue
    sizes = np.bincount(ids)[ids]  # group size seen by each row of this level
    out[f"groups/level{k}_mean_size"] = float(sizes.mean())
    out[f"groups/level{k}_singleton_frac"] = float(np.mean(sizes == 1))
  return out


# ---------------------------------------------------------------------------------------
# Multi-process: every process plays its own groups on its own devices and env servers;
# then every process holds all rows, so advantages, batch and metrics are one process's
# (docs/scaling.md "Several processes")
# ---------------------------------------------------------------------------------------
def _groups_per_process(config) -> int:
  """config.rollout.num_groups is global; each process plays an equal contiguous share."""
  nproc = jax.process_count()
  if config.rollout.num_groups % nproc:
    raise ConfigError(f"config.rollout.num_groups={config.rollout.num_groups} must be a multiple "
                      f"of the number of processes ({nproc}): each process plays an equal share")
  return config.rollout.num_groups // nproc


def _global_train_batch(rows, adv, buckets, config, pad_id: int) -> train_batch_lib.TrainBatch:
  """The token batch of all rows (after `processes.gather_rollout`: identical on every process),
  padded to a multiple of the mini-batch."""
  mini = config.train.mini_batch_rows
  prompt_len = train_batch_lib.pick_bucket(max(len(r.prompt_ids) for r in rows), buckets, "prompt")
  batch, _ = train_batch_lib.build_train_batch(
      [r.prompt_ids for r in rows], [r.response_ids for r in rows], adv.astype(np.float32),
      prompt_buckets=(prompt_len,), response_buckets=(config.rollout.max_new_tokens,),
      row_multiple=mini, pad_id=pad_id, row_buckets=(-(-len(rows) // mini) * mini,))
  return batch


def _packed_train_batches(batch: train_batch_lib.TrainBatch, config,
                          pad_id: int) -> list[packing.PackedBatch]:
  """`batch`'s mini-batches packed (`config.train.pack_rows`, hgpo_jax/training/packing.py)."""
  return packing.pack_batch(batch, mini_batch_rows=config.train.mini_batch_rows,
                            micro_batch_rows=config.train.micro_batch_rows,
                            score_multiple=config.rollout.max_new_tokens, pad_id=pad_id,
                            loss_unit_rows=config.train.loss_unit_rows)


def _grouped_train_batches(batch: train_batch_lib.TrainBatch, config,
                           pad_id: int) -> list[tuple[packing.PackedBatch, ...]]:
  """`batch`'s mini-batches as length-grouped micro-batches (`config.train.group_by_length`,
  hgpo_jax/training/packing.py)."""
  return packing.group_batch(batch, mini_batch_rows=config.train.mini_batch_rows,
                             micro_batch_rows=config.train.micro_batch_rows,
                             length_multiple=config.train.length_multiple,
                             score_multiple=config.rollout.max_new_tokens, pad_id=pad_id,
                             loss_unit_rows=config.train.loss_unit_rows)


def _sampling_model(learner, params, mesh: jax.sharding.Mesh):
  """The policy for the sampler: the training params themselves with one process; with
  several, a copy gathered to every process and placed on its sampling mesh."""
  if jax.process_count() == 1:
    return nnx.merge(learner.graphdef, params)
  host = multihost_utils.process_allgather(params, tiled=True)
  # The training layout's specs on the local mesh: its fsdp divides the training fsdp and
  # its tensor size is the same, so every split dimension stays divisible.
  local = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s.spec), learner.param_shardings)
  return nnx.merge(learner.graphdef, jax.device_put(host, local))


# ---------------------------------------------------------------------------------------
# Critic (estimators with needs_critic: gae = PPO, hae = HiPER)
# ---------------------------------------------------------------------------------------
def make_critic(config, run: RunConfig, model, policy_params, learner: critic_step.CriticLearner):
  """(CriticLearner, TrainState): a separate value model initialised from the policy's
  weights (the published PPO and HiPER scripts' critic), its own optimizer; `learner` is
  the registry's (`programs.build`)."""
  num_heads = CRITIC_HEADS[run.estimator.name]
  params = critic_lib.params_from_policy(policy_params, model.cfg, num_heads, config.seed)
  return learner, learner.init_state(params)


def checkpoint_tree(state, critic_state) -> dict:
  """The `state` item of a checkpoint: the actor's TrainState (+ the critic's)."""
  tree = state.to_checkpoint()
  if critic_state is not None:
    tree["critic"] = critic_state.to_checkpoint()
  return tree


def critic_advantages(rows, est, opts, critic_learner, critic_params, buckets, config,
                      pad_id: int, capacity: int):
  """Critic values -> estimator -> the actor's token batch and the critic's value batch.

  `rows` are all processes' rows (`processes.gather_rollout`), so every process computes the
  same values, targets and batches.

  Returns:
    (TrainBatch with token advantages and the estimator's loss mask as response_mask,
     ValueBatch, CriticTargets of the rows).
  """
  num_heads = CRITIC_HEADS[est.name]
  batch = _global_train_batch(rows, np.zeros(len(rows), np.float32), buckets, config, pad_id)
  values = critic_step.compute_values(critic_learner, critic_params,
                                      critic_step.token_layout_batch(batch, num_heads))
  num_rows = batch.num_rows
  num_tokens = config.rollout.max_new_tokens
  p = batch.seq_len - num_tokens
  targets = value_targets.critic_targets(
      rows, rollout_lib.advantage_columns(rows), est, opts, values[:len(rows)],
      prompt_len=p, num_tokens=num_tokens, gamma=config.algo.gamma,
      invalid_penalty=config.rollout.invalid_penalty, capacity=capacity)
  n, seq = len(rows), batch.seq_len
  adv = np.zeros((num_rows, seq), np.float32)
  loss_mask = np.zeros((num_rows, seq), bool)
  value_mask = np.zeros((num_rows, seq, num_heads), bool)
  returns = np.zeros((num_rows, seq, num_heads), np.float32)
  adv[:n, p:] = targets.token_advantage
  loss_mask[:n, p:] = targets.loss_mask
  value_mask[:n, p:] = targets.value_mask
  returns[:n, p:] = targets.returns
  batch = batch.replace(advantages=adv, response_mask=loss_mask)
  return batch, critic_step.value_batch(batch, value_mask, returns, values), targets


def critic_dump_fields(est_name: str, fields: dict, i: int, num_tokens: int) -> dict:
  """The dump-format critic fields of row i (`python -m hgpo_jax.advantages` reads them)."""
  if est_name == "gae":
    return {"token_values": [float(v) for v in fields["token_values"][i][fields["response_mask"][i]]]}
  del num_tokens  # HiPER rows dump their switch, subgoal and token_tags themselves
  return {"values": {"low": float(fields["values"][i][0]), "high": float(fields["values"][i][1]),
                     "term": float(fields["values"][i][2])}}


# ---------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------
def evaluate(pool, sampler, tokenizer, task_sampler, config, run: RunConfig,
             rng, dump_path: str | None = None) -> dict[str, float]:
  """Success on a fixed task set at `config.eval.temperature`, one trajectory per task.

  dump_path: if set, this process's evaluated steps are written there as a rollout dump
  (`hgpo_jax.advantages.dump`; `group` and `traj` = the task's index in the eval set), to
  read what a policy did on held-out tasks.
  """
  eval_tasks = task_sampler.evaluation_tasks(config.eval.num_tasks)
  # (global task index, won, return, length, type, invalid flags of its rows) per task
  results = []
  dumped = []
  slots = pool.num_slots
  for start in range(0, len(eval_tasks), slots):
    chunk = eval_tasks[start:start + slots]
    padded = chunk + [chunk[-1]] * (slots - len(chunk))  # extra slots play, are not counted
    ro = collect(
        pool, sampler, tokenizer, padded, 1, config, run, sampling=run.eval_sampling,
        rng=jax.random.fold_in(rng, start), on_step=lambda t, T, n: phases.phase(
            "evaluation", f"{task_sampler.split} tasks {start + 1}-{start + len(chunk)}: step {t + 1}/{T}"))
    results += [(task.group_index, ro.won[j], ro.returns[j], ro.lengths[j], ro.task_types[j],
                 [not r.valid for r in ro.rows if r.traj == j]) for j, task in enumerate(chunk)]
    if dump_path is not None:
      dumped += [dict(r.dump_record(), group=chunk[r.traj].group_index,
                      traj=chunk[r.traj].group_index, split=task_sampler.split)
                 for r in ro.rows if r.traj < len(chunk)]
  if dump_path is not None:
    os.makedirs(os.path.dirname(dump_path) or ".", exist_ok=True)
    dump_lib.write_rows(dump_path, dumped)
  # All processes' tasks (dealt round-robin) back in task order: the metrics of one process.
  results = sorted((r for part in processes.allgather_objects(results) for r in part), key=lambda r: r[0])
  _, won, returns, lengths, types, invalid = (list(c) for c in zip(*results)) if results else ([],) * 6
  invalid = [flag for flags in invalid for flag in flags]
  m = rollout_lib.episode_metrics([], np.array(won), np.array(returns), np.array(lengths), types)
  m["invalid_rate"] = float(np.mean(invalid)) if invalid else 0.0
  m["num_tasks"] = float(len(won))
  del m["num_rows"]
  return m


def eval_dump_path(workdir: str, split: str, iteration: int) -> str:
  """Where `rollout.dump` writes an evaluation's steps: one file per split, iteration
  (the trainer's count of finished iterations; 0 for `launch.evaluate`) and process."""
  suffix = f"_p{jax.process_index()}" if jax.process_count() > 1 else ""
  return os.path.join(workdir, "rollouts", f"eval_{split}_{iteration:06d}{suffix}.jsonl")


# ---------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Streams:
  """Independent random streams derived from config.seed."""

  model_seed: int
  sampler: jax.Array
  eval: jax.Array
  task_seed: int


def _streams(seed: int) -> _Streams:
  root = jax.random.key(seed)
  # Three keys although two are used: the split stays the same, so do the streams.
  sampler, _, evaluation = jax.random.split(jax.random.fold_in(root, 1), 3)
  return _Streams(model_seed=seed, sampler=sampler, eval=evaluation, task_seed=seed)


def _summary(config, workdir: str, final: dict[str, float]) -> str:
  """The closing report: training curve endpoints, final evaluation, where things are."""
  lines = metrics_lib.read_jsonl(os.path.join(workdir, metrics_lib.JSONL_NAME))
  train_lines = [l for l in lines if "rollout/success" in l]
  out = [f"== {config.env.name} / {config.algo.name} / {config.model.name}: "
         f"{len(train_lines)} iterations =="]
  if train_lines:
    first, last = train_lines[0], train_lines[-1]
    out.append(f"train success  first {first['rollout/success']:.3f} -> last "
               f"{last['rollout/success']:.3f}   invalid-action rate {first['rollout/invalid_rate']:.3f}"
               f" -> {last['rollout/invalid_rate']:.3f}")
    total = sum(l.get("time/iteration_s", 0.0) for l in train_lines)
    out.append(f"time per iteration {total / len(train_lines):.1f} s (generation "
               f"{np.mean([l['time/generation_s'] for l in train_lines]):.1f} s, update "
               f"{np.mean([l['time/update_s'] for l in train_lines]):.1f} s)")
  for key in sorted(k for k in final if k.endswith("/success") and k.count("/") == 2):
    split = key.split("/")[1]
    out.append(f"eval {split:>13}: success {final[key]:.3f} over {int(final[f'eval/{split}/num_tasks'])}"
               f" tasks (T={config.eval.temperature}), invalid-action rate "
               f"{final[f'eval/{split}/invalid_rate']:.3f}")
  out.append(f"metrics: {os.path.join(workdir, metrics_lib.JSONL_NAME)}   checkpoints: "
             f"{os.path.join(workdir, 'checkpoints')}")
  return "\n".join(out)


def _make_mesh(config) -> jax.sharding.Mesh:
  """The config's mesh; an explicit mesh smaller than the machine uses its first devices
  (single process only: every process of a multi-process run needs all its devices)."""
  m = config.mesh
  devices = jax.devices()
  if m.data != -1 and jax.process_count() == 1:
    size = m.data * m.fsdp * m.tensor
    if size > len(devices):
      raise ConfigError(f"config.mesh {m.data}x{m.fsdp}x{m.tensor} needs {size} devices; "
                        f"{len(devices)} available")
    devices = devices[:size]
  return sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


def _make_pool(config, num_slots: int) -> pool_lib.EnvPool:
  if config.env.endpoints:
    servers = list(config.env.endpoints)  # this process's own (launch.pod.render deals them)
  else:
    args = dict(config.env.args.to_dict())
    args.setdefault("max_steps", config.env.max_steps)
    servers = launcher.LocalServers(env=config.env.name,
                                    num_servers=min(config.env.num_servers, num_slots),
                                    env_args=args)
  token = tls_root_cert = None
  if config.env.endpoints and config.env.get("token_file"):
    with open(config.env.token_file, encoding="utf-8") as f:
      token = f.read().strip()
  if config.env.endpoints and config.env.get("tls_root_cert"):
    with open(config.env.tls_root_cert, "rb") as f:
      tls_root_cert = f.read()
  return pool_lib.EnvPool(servers, num_slots, deadline_s=config.env.deadline_s, token=token,
                          tls_root_cert=tls_root_cert)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains, evaluates and checkpoints; returns the last iteration's and final eval metrics."""
  run = validate(config)
  est, opts = run.estimator, run.options
  os.makedirs(workdir, exist_ok=True)
  streams = _streams(config.seed)
  pid, nproc = jax.process_index(), jax.process_count()
  groups_per_process = _groups_per_process(config)
  # The first collective, while the processes are still in step: on CPU, gloo gives a new
  # communicator 30 s for all processes to arrive; later collectives wait as long as needed.
  processes.barrier("train_and_evaluate start")

  # ---- Mesh, model, learner ------------------------------------------------------------
  mesh = _make_mesh(config)
  model, tokenizer, _ = loading.load_model(
      config.model.name if config.model.name in MODELS_WITH_PATH or not config.model.path
      else config.model.path, path=config.model.path or None, dtype=config.model.dtype,
      mesh=mesh, seed=streams.model_seed)
  # Recompute each block's activations in the backward pass: the update's memory drops
  # from ~16 GB to ~3 GB for SmolLM2 at 4 x 816 tokens per micro-batch (+~30% compute).
  model.cfg = model_settings(config, model.cfg, mesh)
  compute_dtype = model.cfg.dtype  # picks the device peak of the perf/* MFU metrics
  # Every jitted program (update, log-probs, critic, sampler) comes from the registry that
  # `launch.plan` compiles for a pod (hgpo_jax/training/programs.py): one construction.
  registry = programs.build(config, mesh, tokenizer=tokenizer, model_cfg=model.cfg, model=model,
                            local_devices=jax.local_devices(), num_processes=nproc)
  learner = registry.learner
  init_params = nnx.state(model, nnx.Param)
  state = learner.init_state(init_params)
  ref_params = learner.reference_params(state)  # the frozen initial policy (KL anchor)
  critic_learner = critic_state = None
  if est.needs_critic:
    critic_learner, critic_state = make_critic(config, run, model, init_params, registry.critic)
  del model, init_params

  # ---- Resume: workdir > explicit path > scratch ----------------------------------------
  ckpt_dir = os.path.join(workdir, "checkpoints")
  target = learner.abstract_state(state.params).to_checkpoint()
  if critic_learner is not None:
    target["critic"] = critic_learner.abstract_state(critic_state.params).to_checkpoint()
  resumed = checkpoint_lib.resume(
      ckpt_dir, target,
      resume_path=config.checkpoint.resume_from or None)
  start = 0
  if resumed.restored is not None:
    state = train_step.TrainState.from_checkpoint(resumed.restored.state)
    if critic_learner is not None:
      critic_state = train_step.TrainState.from_checkpoint(resumed.restored.state["critic"])
    start = int(resumed.restored.cursor["iteration"])
    if pid == 0 and resumed.source == "workdir":
      checkpoint_lib.set_aside_steps_after(ckpt_dir, resumed.restored.step)
  if pid == 0:  # the files of a shared workdir are process 0's to change
    # Metric lines past the starting iteration were written after the last readable
    # checkpoint (also with none: a kill before the first asynchronous save finished).
    metrics_lib.truncate_jsonl(os.path.join(workdir, metrics_lib.JSONL_NAME), start)
  processes.barrier("resumed")
  logging.info("resume source: %s (%s); starting at iteration %d", resumed.source,
               resumed.path, start)

  ckpt = checkpoint_lib.Checkpointer(ckpt_dir, max_to_keep=config.checkpoint.keep,
                                     keep_period=config.checkpoint.keep_period or None)
  writer = metrics_lib.MetricsWriter(workdir) if pid == 0 else metrics_lib.NullWriter()
  num_slots = groups_per_process * config.rollout.group_size  # this process's env slots
  pool = _make_pool(config, num_slots)
  # A second live line naming the phase of the iteration (rollout step t/T, log-probs,
  # update mini-batch i/n, checkpoint, evaluation): drawn on a terminal only, so CI logs
  # get nothing extra. Library code reports through `phases.phase(...)`.
  reporter = phases.PhaseReporter(enabled=None if pid == 0 else False).__enter__()
  try:
    # ---- Tasks ---------------------------------------------------------------------------
    splits = (config.env.train_split,) + tuple(config.env.eval_splits)
    task_lists = {s: pool.list_tasks(s) for s in splits}
    for turn in ("first", "others"):  # process 0 writes a shared workdir's dataset; others reuse it
      if (turn == "first") == (pid == 0):
        dataset_dir = tasks_lib.build_task_datasets(config.env.name, task_lists,
                                                    os.path.join(workdir, "tasks"))
      processes.barrier(f"task dataset {turn}")
    train_tasks = tasks_lib.TaskSampler(tasks_lib.load_split(dataset_dir, config.env.train_split),
                                        config.env.train_split, streams.task_seed, pid, nproc)
    eval_tasks = {s: tasks_lib.TaskSampler(tasks_lib.load_split(dataset_dir, s), s,
                                           streams.task_seed, pid, nproc)
                  for s in config.env.eval_splits}

    # ---- Sampler -------------------------------------------------------------------------
    buckets = programs.prompt_buckets(config.rollout.max_prompt_tokens)
    sample_mesh = registry.sample_mesh
    sampler = registry.sampler
    sampler.model = _sampling_model(learner, state.params, sample_mesh)
    # static (no recompilation across iterations); the estimator sees all processes' rows
    capacity = config.rollout.num_groups * config.rollout.group_size * config.env.max_steps

    def run_eval(iteration: int) -> dict[str, float]:
      out = {}
      for split, ts in eval_tasks.items():
        m = evaluate(pool, sampler, tokenizer, ts, config, run,
                     jax.random.fold_in(streams.eval, iteration),
                     dump_path=eval_dump_path(workdir, split, iteration) if config.rollout.dump else None)
        out.update({f"eval/{split}/{k}": v for k, v in m.items()})
      return out

    last: dict[str, Any] = {}
    flops = perf.LearnerFlops(learner)  # compiled FLOPs per call, per batch shape
    profile = perf.ProfileWindow(workdir, start, config.profile.iterations, config.profile.skip)
    progress = tqdm.tqdm(range(start, config.train.num_iterations), initial=start,
                         total=config.train.num_iterations, desc="iterations", unit="it",
                         disable=pid != 0, dynamic_ncols=True)
    for it in progress:
      reporter.start_iteration()
      profile.before(it)
      t0 = time.perf_counter()
      # -- rollout
      groups = train_tasks.groups(it, groups_per_process)
      ro = collect(
          pool, sampler, tokenizer, groups, config.rollout.group_size, config, run,
          sampling=run.sampling, rng=jax.random.fold_in(streams.sampler, it),
          on_step=lambda t, T, n: phases.phase("rollout", f"step {t + 1}/{T} ({n} slots active)"))
      ro = processes.gather_rollout(ro, groups_per_process, config.rollout.group_size)
      # -- advantages
      t1 = time.perf_counter()
      phases.phase("advantages")
      critic_metrics, extra = {}, [{} for _ in ro.rows]
      if critic_learner is None:
        adv, ret, group_stats = compute_advantages(
            ro.rows, est, opts, gamma=config.algo.gamma,
            invalid_penalty=config.rollout.invalid_penalty, capacity=capacity)
      else:
        batch, value_batch, targets = critic_advantages(
            ro.rows, est, opts, critic_learner, critic_state.params, buckets, config,
            tokenizer.pad_id, capacity)
        adv = targets.advantage
        ret = targets.grouped.rejoin(ro.rows, np.asarray(targets.grouped.batch.returns))
        group_stats = {}
        critic_metrics = value_targets.metrics(targets, critic_lib.LEVELS[CRITIC_HEADS[est.name]])
        if config.rollout.dump:
          extra = [critic_dump_fields(est.name, targets.fields, i, config.rollout.max_new_tokens)
                   for i in range(len(ro.rows))]
      if config.rollout.dump and pid == 0:
        os.makedirs(os.path.join(workdir, "rollouts"), exist_ok=True)
        dump_lib.write_rows(os.path.join(workdir, "rollouts", f"iter_{it:06d}.jsonl"),
                            [dict(r.dump_record(), **e, **{"return": float(x), "advantage": float(a)})
                             for r, e, x, a in zip(ro.rows, extra, ret, adv)])
      # -- update
      t2 = time.perf_counter()
      if critic_learner is None:
        batch = _global_train_batch(ro.rows, adv, buckets, config, tokenizer.pad_id)
      # verl's trainer.critic_warmup: the first iterations train only the critic
      actor_updated = critic_learner is None or it >= config.critic.warmup_iterations
      update_metrics = {}
      # One optimizer step from the rollout's params: the update takes log pi_old from
      # its own forward pass (UpdateConfig.reuse_on_policy_logprobs)
      on_policy = run.update.on_policy(batch.num_rows)
      # real (non-pad) share of the update's [rows, prompt bucket + response] tokens
      token_fill, update_rows = float(np.mean(batch.input_mask)), batch.num_rows
      if run.update.pack_rows or run.update.group_by_length:
        layout = _packed_train_batches if run.update.pack_rows else _grouped_train_batches
        batch = layout(batch, config, tokenizer.pad_id)
        token_fill, update_rows = packing.token_fill(batch), packing.num_rows(batch)
      if actor_updated:
        phases.phase("log-probs")
        batch = train_step.fill_logprobs(learner, state.params, ref_params, batch, old=not on_policy)
      t3 = time.perf_counter()
      if actor_updated:
        state, update_metrics = train_step.train_iteration(learner, state, batch, on_policy=on_policy)
        update_metrics["on_policy_logprobs"] = float(on_policy)
        sampler.model = _sampling_model(learner, state.params, sample_mesh)  # donated: rebind
      t4 = time.perf_counter()
      if critic_learner is not None:  # independent of the actor's update (same targets)
        critic_state, cm = train_step.train_iteration(critic_learner, critic_state, value_batch)
        critic_metrics.update({f"critic/{k}": v for k, v in cm.items()})
        critic_metrics["time/critic_update_s"] = time.perf_counter() - t4

      metrics = {f"rollout/{k}": v for k, v in ro.metrics().items()}
      metrics.update({f"train/{k}": v for k, v in update_metrics.items()})
      metrics.update(group_stats)
      metrics.update(critic_metrics)
      metrics["train/token_fill"] = token_fill
      metrics["train/update_rows"] = float(update_rows)  # rows per epoch (fewer when packed)
      metrics["advantage/mean"] = float(np.mean(adv))
      metrics["advantage/std"] = float(np.std(adv))
      metrics["advantage/zero_frac"] = float(np.mean(adv == 0))
      if config.eval.every and (it + 1) % config.eval.every == 0:
        metrics.update(run_eval(it + 1))
      metrics.update({"time/generation_s": ro.timings["generation_s"],
                      "time/env_s": ro.timings["env_s"], "time/advantages_s": t2 - t1,
                      "time/logprobs_s": t3 - t2, "time/update_s": t4 - t3,
                      "time/iteration_s": time.perf_counter() - t0})
      if actor_updated:
        passes = int(not on_policy) + int(ref_params is not None)
        metrics.update(perf.iteration_metrics(flops, batch, logprob_passes=passes,
                                              logprobs_s=t3 - t2, update_s=t4 - t3,
                                              dtype=compute_dtype))
      if critic_learner is not None:
        metrics["train/actor_updated"] = float(actor_updated)
      env_keys = ("failed_calls", "replayed_episodes", "restarts")  # summed over processes
      env_counts = processes.allgather(np.array([[pool.metrics()[k] for k in env_keys]])).sum(axis=0)
      metrics.update({f"env/{k}": float(v) for k, v in zip(env_keys, env_counts)})
      scalars = writer.write(it + 1, metrics)
      if pid == 0:
        progress.write(metrics_lib.format_summary(it + 1, scalars, keys=(
            "rollout/success", "rollout/episode_return", "rollout/invalid_rate",
            "rollout/episode_length", "train/pg_loss", "train/kl", "groups/level0_mean_size",
            "time/generation_s", "time/env_s", "time/advantages_s", "time/update_s")))
      if (it + 1) % config.checkpoint.every == 0 or it + 1 == config.train.num_iterations:
        phases.phase("checkpoint")
        ckpt.save(it + 1, checkpoint_tree(state, critic_state), cursor={"iteration": it + 1},
                  config=json.loads(config.to_json()), metrics=scalars)
      last = scalars
      profile.after(it)
    profile.close()

    final = {}
    if config.eval.at_end:
      final = run_eval(config.train.num_iterations)
      writer.write(config.train.num_iterations + 1, final)
    ckpt.wait()
    reporter.__exit__(None, None, None)  # removes the phase line before the summary
    if pid == 0:
      print(_summary(config, workdir, final), flush=True)
    return {"last": last, "final_eval": final, "resume_source": resumed.source,
            "start_iteration": start}
  finally:
    reporter.__exit__(None, None, None)  # idempotent
    pool.close()
    writer.close()
    ckpt.close()
