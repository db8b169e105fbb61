"""Set-up of a run: `build(exp, workdir) -> Run`, everything the loop reads.

One function turns an experiment (`experiment.Experiment`, the typed settings checked
before any expensive work) into the live objects of a run, in this order: random streams, mesh, the policy and
tokenizer, the jitted programs (`programs.build`: learner, critic, sampler), the train
state (from scratch or resumed from a checkpoint), the checkpointer and metrics writer,
the env pool and the task samplers. The trainer (`hgpo_jax/train.py`) and the
evaluation-only entry (`launch/evaluate.py`, `build(..., train=False)`: no learner, no
checkpoint) share it, so both load, place and sample the model the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding

from hgpo_jax.envs import launcher
from hgpo_jax.models import lora as lora_lib
from hgpo_jax.envs import pool as pool_lib
from hgpo_jax.models import critic as critic_lib
from hgpo_jax.models import loading
from hgpo_jax.models import sharding
from hgpo_jax.rollout import tasks as tasks_lib
from hgpo_jax.sampling import sampler as sampler_lib
from hgpo_jax.training import async_rollout
from hgpo_jax.training import checkpoint as checkpoint_lib
from hgpo_jax.training import critic_step
from hgpo_jax.training import experiment as experiment_lib
from hgpo_jax.training import losses
from hgpo_jax.training import metrics as metrics_lib
from hgpo_jax.training import processes
from hgpo_jax.training import programs
from hgpo_jax.training import train_step


@dataclasses.dataclass
class Streams:
  """Independent random streams derived from config.seed."""

  model_seed: int
  sampler: jax.Array
  eval: jax.Array
  task_seed: int


def streams(seed: int) -> Streams:
  """The run's random streams: model init, per-iteration sampling, evaluation, tasks."""
  root = jax.random.key(seed)
  # Three keys although two are used: the split stays the same, so do the streams.
  sampler, _, evaluation = jax.random.split(jax.random.fold_in(root, 1), 3)
  return Streams(model_seed=seed, sampler=sampler, eval=evaluation, task_seed=seed)


def make_mesh(m: experiment_lib.Mesh) -> jax.sharding.Mesh:
  """The training mesh of `config.mesh`; an explicit mesh smaller than the machine uses its
  first devices (single process only: every process of a multi-process run needs all its
  devices). With split placement the devices the sampler takes are not in it
  (`programs.training_devices`)."""
  try:
    devices = programs.training_devices(m, jax.devices())
    if m.split:
      programs.sampler_devices(m, jax.local_devices())
  except ValueError as e:
    raise experiment_lib.ConfigError(str(e)) from None
  if m.data != -1 and jax.process_count() == 1:
    size = m.data * m.fsdp * m.tensor
    if size > len(devices):
      held = f" besides the sampler's {m.rollout_devices}" if m.split else ""
      raise experiment_lib.ConfigError(f"config.mesh {m.data}x{m.fsdp}x{m.tensor} needs {size} "
                                   f"devices{held}; {len(devices)} available")
    devices = devices[:size]
  return sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)


LOCAL_RETRIEVER = "local"
"""`env.args.retriever` value for a retriever process that the env pool starts beside its
env servers (the search env; `launcher.LocalServers.retriever_corpus`)."""


def make_pool(env: experiment_lib.Env, num_slots: int) -> pool_lib.EnvPool:
  """This process's env pool: `env.endpoints`, or local env servers it starts."""
  if env.endpoints:
    servers = list(env.endpoints)  # this process's own (launch.pod.render deals them)
  else:
    args = dict(env.args)
    args.setdefault("max_steps", env.max_steps)
    retriever_corpus = retriever_model = ""
    if args.get("retriever") == LOCAL_RETRIEVER:  # one retriever process the pool owns
      from env_servers.search import dataset as search_data
      retriever_corpus = search_data.corpus_path(args.get("data_dir", ""), args.get("corpus", ""))
      del args["retriever"]  # the pool passes its endpoint
      retriever_model = args.pop("retriever_model", "")  # the retriever process embeds
    servers = launcher.LocalServers(env=env.name,
                                    num_servers=min(env.num_servers, num_slots),
                                    env_args=args, retriever_corpus=retriever_corpus,
                                    retriever_model=retriever_model,
                                    step_latency_ms=env.step_latency_ms)
  token = tls_root_cert = None
  if env.endpoints and env.token_file:
    with open(env.token_file, encoding="utf-8") as f:
      token = f.read().strip()
  if env.endpoints and env.tls_root_cert:
    with open(env.tls_root_cert, "rb") as f:
      tls_root_cert = f.read()
  return pool_lib.EnvPool(servers, num_slots, deadline_s=env.deadline_s, token=token,
                          tls_root_cert=tls_root_cert)


class SamplerWeights:
  """The policy the sampler plays, from the training params, device to device.

  Shared placement, one process: the training params themselves (the sampler runs on the
  training mesh). Split placement (`mesh.rollout_devices`), one process: the params moved
  onto the sampler's own mesh with the training specs (`jax.device_put` between disjoint
  device sets: a device-to-device copy, its seconds in `transfer_s`). Several processes:
  each process samples its own rows on a mesh of its own devices (`programs.sampling_mesh`:
  all of them, or its sampler devices with split placement), so each needs the whole
  policy in that layout. The params are resharded onto the rollout mesh
  (`programs.rollout_mesh`: every process's block side by side along "data", the training
  specs, which never split "data"; a block is the process's sampling mesh, or with split
  placement a mesh over its training devices), an on-device transfer (all-gathers over
  the devices that split a parameter); each process then takes its own devices' shards as
  arrays on its block without a copy (`jax.make_array_from_single_device_arrays`), and
  with split placement moves them to its sampler's devices.
  Nothing passes through host memory (the former `process_allgather` moved the whole
  policy through every host each iteration: ~30 GB per host for Qwen2.5-7B in float32).
  """

  def __init__(self, learner: train_step.Learner, sample_mesh: jax.sharding.Mesh,
               rollout_mesh: jax.sharding.Mesh | None = None,
               block_mesh: jax.sharding.Mesh | None = None, split: bool = False):
    self.graphdef = learner.graphdef
    self.rollout = rollout_mesh is not None
    self.split = split
    self.transfer_s = 0.0
    """Seconds of the last move to the sampler's devices (split placement; waited for)."""
    specs = lambda mesh: jax.tree.map(lambda s: NamedSharding(mesh, s.spec),
                                      learner.param_shardings)
    self.local_shardings = specs(sample_mesh)
    if self.rollout:  # this process's block of the rollout mesh (`programs.process_block`:
      # its sampling mesh unless the placement is split)
      self.global_shardings = specs(rollout_mesh)
      self.block_shardings = specs(block_mesh or sample_mesh)

  def stored(self, params, *, copy: bool = False) -> Any:
    """`params` in the form the sampler takes them from (`merge`): the training arrays
    (shared placement, one process: the same ones, or a copy with `copy`), or new
    global arrays on the sampler's mesh (split placement, one process) or on the rollout
    mesh (several processes), a device-to-device move issued here, in the learner's
    thread (a reshard across processes is a collective). Never buffers of `params` with
    `copy`: what the rollout thread keeps while the next update donates `params`, and
    what a checkpoint saves (`async_rollout.Rollouter.pending_versions`)."""
    if not (self.rollout or self.split):
      return async_rollout.copy_params(params) if copy else params
    start = time.perf_counter()
    target = self.global_shardings if self.rollout else self.local_shardings
    out = jax.device_put(params, target, may_alias=False if copy else None)
    if self.split:
      jax.block_until_ready(out)
      self.transfer_s = time.perf_counter() - start
    return out

  def copy(self, params) -> Any:
    """`stored(params, copy=True)`: a version for `async_rollout.Rollouter`."""
    return self.stored(params, copy=True)

  def merge(self, stored) -> nnx.Module:
    """The policy the sampler plays from `stored` params: with several processes this
    process's shards of the rollout mesh's arrays, on its sampling mesh without a copy
    (split placement: moved from its training devices to its sampler's, within the
    process)."""
    if self.rollout:
      stored = jax.tree.map(_own_shards, stored, self.block_shardings)
      if self.split:
        stored = jax.device_put(stored, self.local_shardings)
    return nnx.merge(self.graphdef, stored)

  def __call__(self, params) -> nnx.Module:
    return self.merge(self.stored(params))


def _sampler_weights(m: experiment_lib.Mesh, learner: train_step.Learner,
                     mesh: jax.sharding.Mesh, sample_mesh: jax.sharding.Mesh) -> SamplerWeights:
  """The run's `SamplerWeights`: with several processes through the rollout mesh."""
  n = jax.process_count()
  if n == 1:
    return SamplerWeights(learner, sample_mesh, split=m.split)
  return SamplerWeights(learner, sample_mesh, programs.rollout_mesh(m, mesh, n),
                        programs.process_block(m, mesh, jax.local_devices(), n), split=m.split)


def _own_shards(x: jax.Array, local: NamedSharding) -> jax.Array:
  """This process's shards of a rollout-mesh array as an array on its sampling mesh."""
  shards = {s.device: s.data for s in x.addressable_shards}
  devices = local.addressable_devices_indices_map(x.shape)
  return jax.make_array_from_single_device_arrays(x.shape, local, [shards[d] for d in devices])


@dataclasses.dataclass
class EvalRun:
  """What evaluation reads (`build(..., train=False)`, `launch.evaluate`): the policy's
  sampler, the env pool and the held-out task samplers."""

  experiment: experiment_lib.Experiment
  workdir: str
  streams: Streams
  mesh: jax.sharding.Mesh
  tokenizer: Any
  sampler: sampler_lib.Sampler
  pool: pool_lib.EnvPool
  writer: metrics_lib.MetricsWriter | metrics_lib.NullWriter
  eval_tasks: dict[str, tasks_lib.TaskSampler]
  """Held-out task samplers by split (`env.eval_splits`)."""
  groups_per_process: int
  compute_dtype: str
  """The activations' dtype (picks the device peak of the perf/* MFU metrics)."""

  def close(self) -> None:
    """Stops the env servers and flushes the writer."""
    self.pool.close()
    self.writer.close()


@dataclasses.dataclass
class Run(EvalRun):
  """The live objects of a training run (`build`). The loop rebinds `state`,
  `critic_state` and `sampler.model` after each update; the rest is fixed for the run."""

  train_tasks: tasks_lib.TaskSampler
  learner: train_step.Learner
  state: train_step.TrainState
  ref_params: Any
  """The frozen initial policy's parameters (the KL anchor; `train_step.ADAPTERS_OFF` with
  LoRA); None when nothing reads its log-probs (`programs.uses_reference`)."""
  critic: critic_step.CriticLearner | None
  """The value model's learner: critic estimators (gae, hae) only."""
  critic_state: train_step.TrainState | None
  sample_mesh: jax.sharding.Mesh
  sampler_weights: SamplerWeights
  checkpointer: checkpoint_lib.Checkpointer
  resume_source: str
  start_iteration: int
  kl_controller: losses.KLController | None
  """The coefficient of the KL in the reward (`train.kl_in_reward`); None when off. Its
  value is saved with each checkpoint's cursor, so a resumed run continues it."""
  sampler_versions: dict[int, Any] | None
  """With `train.max_staleness` > 0 and a resumed run: the weights the pending batches
  are sampled with, by version (`async_rollout.restored_versions`); else None."""

  def update_sampler(self) -> None:
    """Points the sampler at the current (donated, so rebound) actor params."""
    self.sampler.model = self.sampler_weights(self.state.params)

  def checkpoint(self, iteration: int, scalars: dict[str, float], *,
                 sampler_versions: dict[str, Any] | None = None) -> None:
    """Saves the train state after `iteration` finished iterations (asynchronously): the
    actor's TrainState (+ the critic's under "critic", + with `train.max_staleness` the
    weights of the batches played ahead under "sampler_versions", their trained params by
    lag) and the experiment it ran."""
    tree = self.state.to_checkpoint()
    if self.critic_state is not None:
      tree["critic"] = self.critic_state.to_checkpoint()
    if sampler_versions is not None:
      tree["sampler_versions"] = {lag: lora_lib.trainable_params(p)
                                  for lag, p in sampler_versions.items()}
    cursor = {"iteration": iteration}
    if self.kl_controller is not None:
      cursor["kl_reward_coef"] = self.kl_controller.value
    self.checkpointer.save(iteration, tree, cursor=cursor,
                           config=self.experiment.to_dict(), metrics=scalars)

  def close(self) -> None:
    """Stops the env servers and flushes the writer and checkpointer."""
    super().close()
    self.checkpointer.close()


def _load_policy(m: experiment_lib.Model, mesh: jax.sharding.Mesh, seed: int):
  """The policy of `config.model` on `mesh` with the run's numerics
  (`experiment.model_settings`) and its tokenizer."""
  model, tokenizer, _ = loading.load_model(
      m.name if m.name in loading.PRESETS_WITH_PATH or not m.path else m.path,
      path=m.path or None, dtype=m.dtype, mesh=mesh, seed=seed)
  tokenizer.enable_thinking = bool(m.enable_thinking)  # Qwen3's switch
  # Recompute each block's activations in the backward pass: the update's memory drops
  # from ~16 GB to ~3 GB for SmolLM2 at 4 x 816 tokens per micro-batch (+~30% compute).
  model.cfg = experiment_lib.model_settings(m, model.cfg, mesh)
  lora_path = m.lora.path
  if model.cfg.lora.rank or lora_path:  # adapters over the base (hgpo_jax/models/lora.py)
    model = loading.with_lora(model, model.cfg.lora, seed=seed, mesh=mesh,
                              adapter_dir=lora_path or None)
  return model, tokenizer


def _task_samplers(env_name: str, pool: pool_lib.EnvPool, workdir: str,
                   task_seed: int, splits: tuple[str, ...]) -> dict[str, tasks_lib.TaskSampler]:
  """A task sampler per split, over the TFDS datasets of the splits' task ids that process 0
  writes to `workdir/tasks` (the other processes of a shared workdir reuse them)."""
  pid, nproc = jax.process_index(), jax.process_count()
  task_lists = {s: pool.list_tasks(s) for s in splits}
  for turn in ("first", "others"):
    if (turn == "first") == (pid == 0):
      dataset_dir = tasks_lib.build_task_datasets(env_name, task_lists,
                                                  os.path.join(workdir, "tasks"))
    processes.barrier(f"task dataset {turn}")
  return {s: tasks_lib.TaskSampler(tasks_lib.load_split(dataset_dir, s), s, task_seed, pid, nproc)
          for s in splits}


def metrics_writer(exp: experiment_lib.Experiment, workdir: str, *, train: bool
                   ) -> metrics_lib.MetricsWriter | metrics_lib.NullWriter:
  """The run's metrics writer: on process 0, `metrics.jsonl` and, when training, the
  writers of `metrics.writers` (evaluation writes its record only); elsewhere nothing."""
  if jax.process_index() != 0:
    return metrics_lib.NullWriter()
  return metrics_lib.MetricsWriter(workdir, exp.metrics.writers if train else (),
                                   exp.metrics.settings(run_config=exp.to_dict()))


def build(exp: experiment_lib.Experiment, workdir: str, *, train: bool = True
          ) -> Run | EvalRun:
  """The run of `exp` in `workdir`: mesh, model, programs, train state (resumed: workdir >
  `checkpoint.resume_from` > scratch), checkpointer, metrics writer, env pool, task
  samplers and sampler.

  With `train=False` (evaluation only): an `EvalRun`, the loaded policy and a plain sampler
  over it, the eval splits' tasks and a JSONL-only writer; no learner, train state or
  checkpoint. Raises ConfigError (one line) on settings this machine cannot run (the
  process count), before any expensive work.
  """
  if not isinstance(exp, experiment_lib.Experiment):
    raise TypeError(f"run.build takes an experiment.Experiment (experiment.from_config), "
                    f"got {type(exp).__name__}")
  for line in experiment_lib.precision_warnings(exp):
    logging.warning("%s", line)
  os.makedirs(workdir, exist_ok=True)
  rng = streams(exp.seed)
  # Evaluation plays every slot on every process (its tasks are dealt round-robin).
  groups = (experiment_lib.groups_per_process(exp.rollout) if train
            else exp.rollout.num_groups)
  # The first collective, while the processes are still in step: on CPU, gloo gives a new
  # communicator 30 s for all processes to arrive; later collectives wait as long as needed.
  processes.barrier("train_and_evaluate start")

  mesh = make_mesh(exp.mesh)
  model, tokenizer = _load_policy(exp.model, mesh, rng.model_seed)
  if train:
    fields = _train_state(exp, workdir, mesh, model, tokenizer)
  else:
    fields = dict(sampler=sampler_lib.Sampler.from_settings(model, tokenizer, exp.rollout, mesh))
  compute_dtype = model.cfg.dtype
  del model
  writer = metrics_writer(exp, workdir, train=train)
  pool = make_pool(exp.env, groups * exp.rollout.group_size)  # this process's env slots
  try:
    splits = ((exp.env.train_split,) if train else ()) + exp.env.eval_splits
    tasks = _task_samplers(exp.env.name, pool, workdir, rng.task_seed, splits)
  except BaseException:
    pool.close()
    writer.close()
    if train:
      fields["checkpointer"].close()
    raise
  common = dict(experiment=exp, workdir=workdir, streams=rng, mesh=mesh, tokenizer=tokenizer,
                pool=pool, writer=writer, eval_tasks={s: tasks[s] for s in exp.env.eval_splits},
                groups_per_process=groups, compute_dtype=compute_dtype)
  if not train:
    return EvalRun(**common, **fields)
  run = Run(**common, train_tasks=tasks[exp.env.train_split], **fields)
  run.update_sampler()
  if exp.rollout.precompile:
    _precompile_sampler(run)
  return run


def _precompile_sampler(run: "Run") -> None:
  """Compiles every generate program the run can call (`rollout.precompile`)."""
  rows = run.groups_per_process * run.experiment.rollout.group_size
  calls = programs.rollout_calls(run.experiment, run.sampler, rows)
  start = time.perf_counter()
  num = run.sampler.precompile([call[1:] for call in calls])
  logging.info("precompiled %d sampler programs in %.0f s", num, time.perf_counter() - start)


def _train_state(exp: experiment_lib.Experiment, workdir: str, mesh, model,
                 tokenizer) -> dict[str, Any]:
  """The training fields of a `Run`: programs, train state (resumed), checkpointer."""
  pid = jax.process_index()
  # Every jitted program (update, log-probs, critic, sampler) comes from the registry that
  # `launch.plan` compiles for a pod (hgpo_jax/training/programs.py): one construction.
  registry = programs.build(exp, mesh, tokenizer=tokenizer, model_cfg=model.cfg, model=model,
                            local_devices=jax.local_devices(), num_processes=jax.process_count())
  learner = registry.learner
  init_params = nnx.state(model, nnx.Param)
  state = learner.init_state(init_params)
  # the frozen initial policy (KL anchor); none without a KL term (no reference pass and no
  # copy): KL loss off or at coefficient 0, and no KL in the reward
  ref_params = (learner.reference_params(state)
                if programs.uses_reference(exp.train) else None)
  critic = critic_state = None
  if exp.estimator.needs_critic:
    # A separate value model initialised from the policy's weights (the published PPO and
    # HiPER scripts' critic), with its own optimizer.
    critic = registry.critic
    critic_state = critic.init_state(critic_lib.params_from_policy(
        init_params, model.cfg, experiment_lib.CRITIC_HEADS[exp.estimator.name], exp.seed))
  del init_params

  # ---- Resume: workdir > explicit path > scratch ----------------------------------------
  ckpt_dir = os.path.join(workdir, "checkpoints")
  target = learner.abstract_state(state.params).to_checkpoint()
  if critic is not None:
    target["critic"] = critic.abstract_state(critic_state.params).to_checkpoint()
  k = exp.train.max_staleness
  if k:
    target["sampler_versions"] = {f"lag{j}": target["params"] for j in range(1, k + 1)}
  resumed = checkpoint_lib.resume(ckpt_dir, target,
                                  resume_path=exp.checkpoint.resume_from or None)
  start = 0
  kl_controller = exp.train.kl_controller() if exp.train.kl_in_reward else None
  sampler_versions = None
  if resumed.restored is not None:
    if kl_controller is not None:
      kl_controller.value = float(resumed.restored.cursor.get("kl_reward_coef",
                                                              kl_controller.value))
    state = train_step.TrainState.from_checkpoint(resumed.restored.state, like=state)
    if critic is not None:
      critic_state = train_step.TrainState.from_checkpoint(resumed.restored.state["critic"],
                                                           like=critic_state)
    start = int(resumed.restored.cursor["iteration"])
    if k:
      sampler_versions = async_rollout.restored_versions(
          {lag: lora_lib.with_frozen(p, state.params)
           for lag, p in resumed.restored.state["sampler_versions"].items()},
          start, k, state.params)
    if pid == 0 and resumed.source == "workdir":
      checkpoint_lib.set_aside_steps_after(ckpt_dir, resumed.restored.step)
  if pid == 0:  # the files of a shared workdir are process 0's to change
    # Metric lines past the starting iteration were written after the last readable
    # checkpoint (also with none: a kill before the first asynchronous save finished).
    for name in (metrics_lib.JSONL_NAME, metrics_lib.TASK_RESULTS_JSONL_NAME):
      metrics_lib.truncate_jsonl(os.path.join(workdir, name), start)
  processes.barrier("resumed")
  logging.info("resume source: %s (%s); starting at iteration %d", resumed.source,
               resumed.path, start)
  checkpointer = checkpoint_lib.Checkpointer(ckpt_dir, max_to_keep=exp.checkpoint.keep,
                                             keep_period=exp.checkpoint.keep_period or None)
  return dict(learner=learner, state=state, ref_params=ref_params, critic=critic,
              critic_state=critic_state, sampler=registry.sampler,
              sample_mesh=registry.sample_mesh, checkpointer=checkpointer,
              sampler_weights=_sampler_weights(exp.mesh, learner, mesh, registry.sample_mesh),
              resume_source=resumed.source, start_iteration=start, kl_controller=kl_controller,
              sampler_versions=sampler_versions)
