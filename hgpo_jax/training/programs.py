"""Program registry: every jitted program of an experiment, with abstract arguments and shardings.

`build(exp, mesh)` constructs the objects whose jitted methods the trainer calls — the
actor `Learner` (update, log-probs), the `CriticLearner` for critic estimators (values,
update), the rollout `Sampler` (its own generate program: prefill + decode loop) and the
registered estimator — from an experiment (`experiment.Experiment`) and a mesh, with no weights: parameters, optimizer
state and batches are `ShapeDtypeStruct`s carrying their target shardings. Each `Program`
is one of those jitted objects plus the abstract arguments of the call the trainer makes
at the config's largest shapes, and how many times one training iteration calls it.
`launch.plan`, the FLOP accounting and the TPU compile tests take their programs from here,
so they compile exactly the functions the trainer runs (no copies that can drift).

Target platform: the mesh's devices decide (`target_platform(mesh)`), never
`jax.default_backend()`: a CPU host compiling for TPU topology devices gets TPU programs.

Shapes (the paper setting's worst case, each an upper bound of what a run compiles):
  update, logprobs   [train.mini_batch_rows, max_prompt_tokens + max_new_tokens] rows,
                     (with `train.reference_dtype` or `train.reference_memory=host` set,
                     "logprobs" is the reference's pass, in that dtype or copying it from
                     host memory, and "logprobs_old" the old policy's, if it has one),
                     the unpacked layout (length-grouped or packed layouts compile smaller
                     micro-batches of the same rows);
  generate           this process's rollout rows (groups per process x group size, rounded
                     up to the sampler's batch bucket) x the largest prompt bucket, decoding
                     of max_new_tokens with the rollout's stop strings, each row
                     prefilled; constrained with tries of `rollout.max_trie_nodes` when the
                     config constrains and fixes it (else free decoding: a constrained
                     call's trie shapes then depend on its data);
  generate_shared    the same call at an episode's first turn: each group's prompt is
                     prefilled once and its cache rows copied to the group's rows;
                     (`Registry.rollout_programs()` lists every smaller bucket's program
                     too: `rollout_calls`, what `rollout.precompile` compiles);
  critic_values, critic_update   the critic's (PPO, HiPER) on the update's rows;
  advantages         the estimator on the iteration's row capacity (critic-free only).
With several processes the training programs span the whole slice and the sampler runs on
each process's own devices (`sampling_mesh`), as the trainer does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from hgpo_jax.advantages import grouping
from hgpo_jax.models import config as model_config
from hgpo_jax.models import critic as critic_lib
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding as sharding_lib
from hgpo_jax.models.platform import target_platform
from hgpo_jax.cost import targets
from hgpo_jax.sampling import constrained
from hgpo_jax.sampling import inputs as inputs_lib
from hgpo_jax.sampling import sampler as sampler_lib
from hgpo_jax.rollout.params import RolloutParams
from hgpo_jax.sampling import types
from hgpo_jax.training import critic_step
from hgpo_jax.training import experiment as experiment_lib
from hgpo_jax.training import train_batch as train_batch_lib
from hgpo_jax.training import train_step



def training_devices(m: experiment_lib.Mesh, devices) -> list:
  """The devices the training mesh may use: all of `devices` (shared placement), or all
  but each process's last `m.rollout_devices` (split placement: `sampler_devices`)."""
  devices = list(devices)
  if not m.split:
    return devices
  held = {id(d) for p in {d.process_index for d in devices}
          for d in sampler_devices(m, [d for d in devices if d.process_index == p])}
  return [d for d in devices if id(d) not in held]


def sampler_devices(m: experiment_lib.Mesh, local_devices) -> list:
  """One process's devices the sampler runs on with split placement: its last
  `m.rollout_devices`. Raises ValueError when the process has no device left to train."""
  local_devices = list(local_devices)
  n = m.rollout_devices
  if n >= len(local_devices):
    raise ValueError(f"config.mesh.rollout_devices={n} leaves none of a process's "
                     f"{len(local_devices)} devices to the learner")
  return local_devices[-n:]


def sampling_mesh(m: experiment_lib.Mesh, mesh: jax.sharding.Mesh, local_devices,
                  num_processes: int) -> jax.sharding.Mesh:
  """The sampler's mesh. Split placement (`m.rollout_devices` > 0): the process's
  `sampler_devices`, `rollout_fsdp` x `rollout_tensor`, data the rest. Shared: the
  training mesh with one process; with several, a mesh over one process's own devices
  (generation is data parallel and each process samples its own prompts): `m`'s
  (`config.mesh`) tensor size, fsdp as far as the local devices allow, data the rest.
  Raises ValueError when the tensor size does not divide a process's devices."""
  if m.split:
    return sharding_lib.make_mesh(-1, m.rollout_fsdp, m.rollout_tensor,
                                  devices=sampler_devices(m, local_devices))
  if num_processes == 1:
    return mesh
  tensor = m.tensor
  if len(local_devices) % tensor:
    raise ValueError(f"config.mesh.tensor={tensor} must divide the {len(local_devices)} devices "
                     "of each process (the sampler runs on each process's own devices)")
  fsdp = math.gcd(m.fsdp, len(local_devices) // tensor)
  return sharding_lib.make_mesh(-1, fsdp, tensor, devices=list(local_devices))


def process_block(m: experiment_lib.Mesh, mesh: jax.sharding.Mesh, local_devices,
                  num_processes: int) -> jax.sharding.Mesh:
  """One process's block of the rollout mesh (`rollout_mesh`): its sampling mesh with
  shared placement; with split placement the same rule over its training devices (the
  whole policy gathered there, then moved to its sampler's devices: cross-process
  reshards need one device set on both sides)."""
  if not m.split:
    return sampling_mesh(m, mesh, local_devices, num_processes)
  shared = dataclasses.replace(m, rollout_devices=0, rollout_fsdp=1, rollout_tensor=1)
  return sampling_mesh(shared, mesh, training_devices(m, local_devices), num_processes)


def rollout_mesh(m: experiment_lib.Mesh, mesh: jax.sharding.Mesh, num_processes: int
                 ) -> jax.sharding.Mesh:
  """Every process's block (`process_block` over `jax.local_devices(process_index=p)`,
  the list each process's own `jax.local_devices()` is) side by side along "data": the
  global mesh onto which the policy is resharded device to device for sampling
  (`run.SamplerWeights`); a process's block of it is its sampling mesh (shared placement)
  or a mesh over its training devices (split placement)."""
  blocks = [process_block(m, mesh, jax.local_devices(process_index=p), num_processes).devices
            for p in range(num_processes)]
  return jax.sharding.Mesh(np.concatenate(blocks, axis=0), sharding_lib.MESH_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * len(sharding_lib.MESH_AXES))


@dataclasses.dataclass
class Program:
  """One jitted program and the abstract arguments of the call the trainer makes."""
  name: str
  jitted: Any
  args: tuple
  static: dict
  calls: int  # calls in one training iteration (upper bound: every episode runs to max_steps)
  persistent: int  # per-device bytes of the arguments that stay allocated (params, moments)
  # weight of a loop without a fixed trip count (decode loop), or one per nesting depth
  unknown_trip_count: int | tuple[float, ...] = 1
  note: str = ""
  # generate programs: decode steps per iteration of that loop (a lockstep chunk)
  steps_per_iteration: int = 1

  def lower(self):
    return self.jitted.lower(*self.args, **self.static)


@dataclasses.dataclass
class Registry:
  """The programs of one experiment on one mesh and the persistent bytes per device."""
  experiment: experiment_lib.Experiment
  mesh: jax.sharding.Mesh
  sample_mesh: jax.sharding.Mesh
  model_cfg: model_config.ModelConfig
  learner: train_step.Learner
  critic: Optional[critic_step.CriticLearner]
  sampler: sampler_lib.Sampler
  programs: dict[str, Program]
  params_bytes: int
  opt_bytes: int
  reference_bytes: int  # on the devices (0 when the reference is offloaded)
  reference_host_bytes: int  # per device, in its host memory (train.reference_memory=host)
  critic_bytes: int  # critic params + moments (0 without a critic)
  num_processes: int
  rollout_rows: int  # sampler rows per call on one process

  @property
  def persistent(self) -> int:
    """Bytes per device that live through the whole iteration: actor params and AdamW
    moments, the frozen reference, and the critic's params and moments."""
    return self.params_bytes + self.opt_bytes + self.reference_bytes + self.critic_bytes

  @property
  def platform(self) -> str:
    return target_platform(self.mesh)

  def rollout_programs(self) -> list[Program]:
    """Every generate program a run can call on one process (`rollout_calls`), as
    `Program`s of the registry's sampler (the "generate" entries are its largest two)."""
    sampler = self.sampler
    return [Program(name, sampler.generate_program, (sampler.model,) + args, static, 0,
                    self.programs["generate"].persistent,
                    unknown_trip_count=sampler.decode_loop_weights(
                        args[0].tokens.shape[0], static["flags"].max_new_tokens),
                    steps_per_iteration=sampler.decode_steps_per_iteration(
                        args[0].tokens.shape[0], static["flags"].max_new_tokens))
            for name, args, static in rollout_calls(self.experiment, sampler, self.rollout_rows)]


def sharded_bytes(tree) -> int:
  """Per-device bytes of a tree of ShapeDtypeStructs with shardings (largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
    # Typed PRNG keys (extended dtypes) report their own itemsize (threefry: 8 bytes).
    total += int(np.prod(shape, dtype=np.int64)) * int(leaf.dtype.itemsize)
  return total


def uses_reference(train: experiment_lib.Train) -> bool:
  """Whether a run keeps the frozen reference policy and runs its log-prob pass: for the
  loss's KL term (`LossConfig.kl_in_loss`: on, with a nonzero coefficient) or for the KL in
  the reward (`train.kl_in_reward`), the two readers of the reference's log-probs."""
  return train.update.loss.kl_in_loss or train.kl_in_reward


def abstract_train_batch(rows: int, seq: int, sharding) -> train_batch_lib.TrainBatch:
  """ShapeDtypeStructs of a TrainBatch of [rows, seq] placed with `sharding`."""
  sds = lambda dtype: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=sharding)
  return train_batch_lib.TrainBatch(
      tokens=sds(jnp.int32), positions=sds(jnp.int32), input_mask=sds(jnp.bool_),
      response_mask=sds(jnp.bool_), advantages=sds(jnp.float32), old_logprobs=sds(jnp.float32),
      ref_logprobs=sds(jnp.float32))


def abstract_value_batch(rows: int, seq: int, heads: int, sharding) -> critic_step.ValueBatch:
  sds = lambda dtype, *tail: jax.ShapeDtypeStruct((rows, seq) + tail, dtype, sharding=sharding)
  return critic_step.ValueBatch(
      tokens=sds(jnp.int32), positions=sds(jnp.int32), input_mask=sds(jnp.bool_),
      response_mask=sds(jnp.bool_), value_mask=sds(jnp.bool_, heads),
      returns=sds(jnp.float32, heads), old_values=sds(jnp.float32, heads))


class _CompileOnlyTokenizer:
  """What the sampler's program reads from a tokenizer: the EOS ids and the pad id, both
  constants of the program (they change no shape or byte). `build` uses it when no real
  tokenizer is given: a plan needs no vocabulary file."""

  def __init__(self, vocab_size: int):
    self.eos_ids = (vocab_size - 1,)
    self.pad_id = 0

  def token_strings(self):
    raise RuntimeError("a compile-only sampler has no vocabulary; build the registry with the "
                       "model's tokenizer to sample")


def _sampler_args(sampler: sampler_lib.Sampler, rows: int, prompt: int, unique: int,
                  params: types.SamplingParams, fixed_tries: int):
  """Abstract arguments (after the model: the `DecodeInputs`) and static keywords (the
  `DecodeFlags`) of `Sampler.generate_program` for a call of `rows` x `prompt` (`unique`
  prefilled rows: < rows for a shared prefill), placed as `Sampler.generate` places them:
  with `params`' stop strings and flags; constrained with per-row tries of `fixed_tries`
  nodes when > 0, else free."""
  tries = (constrained.build_tries([], rows, fixed_tries) if fixed_tries
           else constrained.build_tries([], 1))
  stops = params.stop_strings
  inputs = inputs_lib.DecodeInputs.abstract(
      rows=rows, prompt=prompt, unique=unique, vocab=sampler.cfg.vocab_size,
      stop_rows=constrained.automaton_rows(stops) if stops else 1,
      tries=inputs_lib.TrieArrays.of(tries), mesh=sampler.mesh)
  flags = inputs_lib.DecodeFlags.of(params, constrained=bool(fixed_tries),
                                    shared_prefill=unique != rows,
                                    slots=sampler.slots_for(rows))
  return (inputs,), dict(flags=flags)


def _fixed_tries(rollout: RolloutParams) -> int:
  """Trie nodes of the constrained calls when the settings fix them, else 0 (free calls;
  a constrained call's trie shapes then follow its data)."""
  return int(rollout.max_trie_nodes) if rollout.constrained else 0


def rollout_calls(exp: experiment_lib.Experiment, sampler: sampler_lib.Sampler, rows: int
                  ) -> list[tuple[str, tuple, dict]]:
  """Every generate call a run of `exp` can make on one process with at most `rows`
  rows per call: (name, abstract arguments after the model, static keywords) for each
  batch bucket up to `rows`, each prompt bucket, unshared and (when the sampler shares
  with a fixed row count, `Sampler(share_prefill=G)`) shared prefill, at the training and
  the evaluation temperature. `Sampler.precompile` compiles them; a run whose sampler
  precompiled them traces no program mid-run (`rollout.precompile`).

  Raises ValueError when the set is not fixed by the settings: constrained decoding with
  `rollout.max_trie_nodes=0` (trie shapes then follow the data).
  """
  if exp.rollout.constrained and not exp.rollout.max_trie_nodes:
    raise ValueError("rollout.constrained with rollout.max_trie_nodes=0: the constrained "
                     "programs' trie shapes follow the data, so they cannot be listed ahead "
                     "of time; set rollout.max_trie_nodes (e.g. 512)")
  variants = {}  # training and evaluation share a program when their static flags agree
  for label, params in (("train", exp.sampling.train), ("eval", exp.sampling.eval)):
    variants.setdefault((params.greedy, params.filtered), (label, params))
  largest = sampler_lib.bucket_for(rows, sampler.batch_buckets, "batch size")
  tries = _fixed_tries(exp.rollout)
  calls = []
  for label, params in variants.values():
    for b in (b for b in sampler.batch_buckets if b <= largest):
      for p in sampler.prompt_buckets:
        name = f"generate[{label} rows={b} prompt={p}]"
        calls.append((name,) + _sampler_args(sampler, b, p, b, params, tries))
        u = sampler.shared_prefill_rows(b)
        if u is not None and u < b and p > 1:
          calls.append((f"{name[:-1]} shared={u}]",) + _sampler_args(sampler, b, p, u, params, tries))
  return calls


def _share_prefill(rollout: RolloutParams) -> int | bool:
  """The rollout sampler's `share_prefill`: the group size (a group's trajectories share
  their first turn's prefill, in a fixed number of rows per batch bucket); off for
  groups of one and with `rollout.share_prefill=false`."""
  size = rollout.group_size
  return size if size >= 2 and rollout.share_prefill else False


def build(exp: experiment_lib.Experiment, mesh: jax.sharding.Mesh, *, micro_batch_rows: Optional[int] = None,
          rollout_rows: Optional[int] = None, local_devices=None, num_processes: Optional[int] = None,
          tokenizer=None, model_cfg: Optional[model_config.ModelConfig] = None,
          model=None) -> Registry:
  """The registry of `exp` on `mesh` (see module doc).

  Args:
    exp: the run's settings (`experiment.from_config` of a configs/*.py ConfigDict).
    mesh: the training mesh (real devices, fake CPU devices or TPU topology devices).
    micro_batch_rows: override of train.micro_batch_rows: the micro-batch of every
      learner (the actor's and the critic's, which a run shares).
    rollout_rows: override of the sampler's rows per call on one process.
    local_devices: one process's devices (default: the mesh's devices of process 0; for TPU
      topology devices the same chips as a one-host topology, `targets.one_host_devices`).
    num_processes: processes of the job (default: the processes of the mesh's devices).
    tokenizer: the model's tokenizer (default: a compile-only stand-in, see
      `_CompileOnlyTokenizer`).
    model_cfg: the model's architecture (default: `model.name`'s preset in
      `model.dtype` with the run's numerics, attention resolved for `mesh`).
    model: the loaded policy (the trainer's; default: its abstract structure from
      `model_cfg`); only its graph and parameter shardings are read.
  """
  devs = list(mesh.devices.flat)
  if num_processes is None:
    num_processes = len({d.process_index for d in devs})
  if local_devices is None:
    local_devices = _first_process_devices(exp, mesh)
  if model_cfg is None:
    preset = model_config.get_preset(exp.model.name).replace(param_dtype=exp.model.dtype)
    model_cfg = experiment_lib.model_settings(exp.model, preset, mesh)
  update, critic_update = exp.train.update, exp.critic_update
  if micro_batch_rows:  # every learner's (the critic's micro-batch is the actor's, as in a run)
    update = dataclasses.replace(update, micro_batch_rows=micro_batch_rows)
    if critic_update is not None:
      critic_update = dataclasses.replace(critic_update, micro_batch_rows=micro_batch_rows)
  if model is None:
    model = nnx.eval_shape(lambda: decoder.Decoder(model_cfg, rngs=nnx.Rngs(0)))
  learner = train_step.Learner(model, mesh, update)
  state = learner.abstract_state()
  seq = exp.rollout.max_prompt_tokens + exp.rollout.max_new_tokens
  batch = abstract_train_batch(update.mini_batch_rows, seq, learner.row_sharding)
  capacity = exp.rollout.num_groups * exp.rollout.group_size * exp.env.max_steps
  num_mini = -(-capacity // update.mini_batch_rows)
  updates = update.ppo_epochs * num_mini
  programs, reference_b, reference_host_b = _actor_programs(
      exp, learner, state, batch, num_mini, updates, update.on_policy(capacity))

  critic, critic_b = None, 0
  if exp.estimator.needs_critic:
    critic, critic_programs = _critic_programs(exp, model_cfg, mesh, critic_update, seq,
                                               num_mini, updates)
    critic_b = critic_programs["critic_update"].persistent
    programs.update(critic_programs)
  else:
    programs["advantages"] = _estimator_program(exp.estimator, exp.algo.options, capacity)

  sample_mesh = sampling_mesh(exp.mesh, mesh, local_devices, num_processes)
  sampler, rows, sampler_programs = _sampler_programs(
      exp, learner, state, sample_mesh, tokenizer or _CompileOnlyTokenizer(model_cfg.vocab_size),
      rollout_rows or (experiment_lib.groups_per_process(exp.rollout, num_processes)
                       * exp.rollout.group_size))
  programs.update(sampler_programs)
  return Registry(experiment=exp, mesh=mesh, sample_mesh=sample_mesh, model_cfg=model_cfg,
                  learner=learner, critic=critic, sampler=sampler, programs=programs,
                  params_bytes=sharded_bytes(state.params),
                  opt_bytes=sharded_bytes(state.opt_state),
                  reference_bytes=reference_b, reference_host_bytes=reference_host_b,
                  critic_bytes=critic_b,
                  num_processes=num_processes, rollout_rows=rows)


def _first_process_devices(exp: experiment_lib.Experiment, mesh: jax.sharding.Mesh) -> list:
  """`build`'s default `local_devices`: the mesh's devices of its first process (for TPU
  topology devices the same chips as a one-host topology, `targets.one_host_devices`)."""
  if exp.mesh.split:  # the sampler's devices are not the training mesh's
    raise ValueError("config.mesh.rollout_devices: the registry needs the process's own "
                     "devices (local_devices), of which the sampler takes the last ones")
  devs = list(mesh.devices.flat)
  if target_platform(mesh) == "tpu":
    return targets.one_host_devices(devs)
  return [d for d in devs if d.process_index == devs[0].process_index]


def _actor_programs(exp: experiment_lib.Experiment, learner: train_step.Learner, state, batch,
                    num_mini: int, updates: int, on_policy: bool
                    ) -> tuple[dict[str, Program], int, int]:
  """The actor's update and log-prob programs, and the frozen reference's bytes per device
  on the devices and in their host memory.

  The trainer computes log pi_old in the update itself when an iteration is one optimizer
  step (`UpdateConfig.on_policy`); the frozen reference policy is kept for a KL term (loss
  or reward). With LoRA it is the base with the adapters off: no copy, its own pass."""
  params_b = sharded_bytes(state.params)
  use_reference = uses_reference(exp.train)
  reference = learner.abstract_reference(state.params)
  reference_b = sharded_bytes(reference) if use_reference and not learner.adapters else 0
  # An offloaded reference (train.reference_memory=host) lives in the devices' host memory:
  # no device bytes between passes; its pass copies it onto the devices (temporaries).
  on_host = exp.train.update.reference_memory == "host"
  reference_host_b, reference_b = (reference_b, 0) if on_host else (0, reference_b)
  same_dtype = jax.tree.leaves(reference) and all(
      r.dtype == p.dtype for r, p in zip(jax.tree.leaves(reference), jax.tree.leaves(state.params)))
  update_args = (state, batch, True) if on_policy else (state, batch)  # a positional static flag
  programs = {"update": Program("update", learner.update, update_args, {}, updates,
                                sharded_bytes(state))}
  one_pass = (same_dtype and not on_host) or not use_reference
  if learner.adapters and use_reference:  # the base's log-probs (adapters off), then old
    programs["logprobs"] = Program(
        "logprobs", learner.compute_reference_logprobs, (state.params, batch), {}, num_mini,
        params_b, note="reference log-probs of one mini-batch (the base, adapters off)")
    one_pass = False
  elif one_pass:  # old (and reference): one program
    programs["logprobs"] = Program(
        "logprobs", learner.compute_logprobs, (state.params, batch), {},
        num_mini * (int(not on_policy) + int(use_reference)), params_b,
        note=f"old{' and reference' if use_reference else ''} log-probs of one mini-batch")
  else:  # the reference in its own dtype or memory: a program of its own
    what = ([f"{learner.reference_dtype} parameters"] if not same_dtype else []) + (
        ["copied from host memory"] if on_host else [])
    programs["logprobs"] = Program(
        "logprobs", learner.compute_reference_logprobs, (reference, batch), {}, num_mini,
        reference_b, note=f"reference log-probs of one mini-batch ({', '.join(what)})")
  if not one_pass and not on_policy:
    programs["logprobs_old"] = Program(
        "logprobs_old", learner.compute_logprobs, (state.params, batch), {}, num_mini,
        params_b, note="old log-probs of one mini-batch")
  return programs, reference_b, reference_host_b


def _critic_programs(exp: experiment_lib.Experiment, model_cfg, mesh: jax.sharding.Mesh,
                     critic_update, seq: int, num_mini: int, updates: int
                     ) -> tuple[critic_step.CriticLearner, dict[str, Program]]:
  """The value model's learner and its programs (critic estimators)."""
  heads = experiment_lib.CRITIC_HEADS[exp.estimator.name]
  critic = critic_step.CriticLearner(critic_lib.abstract_critic(model_cfg, heads), mesh,
                                     critic_update, exp.critic.value_loss)
  cstate = critic.abstract_state()
  vbatch = abstract_value_batch(critic.config.mini_batch_rows, seq, heads, critic.row_sharding)
  return critic, {
      "critic_values": Program("critic_values", critic.compute_values, (cstate.params, vbatch),
                               {}, num_mini, sharded_bytes(cstate.params)),
      "critic_update": Program("critic_update", critic.update, (cstate, vbatch), {}, updates,
                               sharded_bytes(cstate)),
  }


def _sampler_programs(exp: experiment_lib.Experiment, learner: train_step.Learner, state,
                      sample_mesh: jax.sharding.Mesh, tokenizer, rows_per_process: int
                      ) -> tuple[sampler_lib.Sampler, int, dict[str, Program]]:
  """The sampler on one process's devices (`sample_mesh`), its rows per call (the bucket
  of `rows_per_process`) and its generate programs."""
  local_shardings = jax.tree.map(lambda s: NamedSharding(sample_mesh, s.spec),
                                 learner.param_shardings)
  sample_params = jax.tree.map(
      lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), state.params,
      local_shardings)
  sampler = sampler_lib.Sampler.from_settings(
      nnx.merge(learner.graphdef, sample_params), tokenizer, exp.rollout, sample_mesh,
      share_prefill=_share_prefill(exp.rollout))
  rows = sampler_lib.bucket_for(rows_per_process, sampler.batch_buckets, "batch size")
  prompt, decode_steps = exp.rollout.max_prompt_tokens, exp.rollout.max_new_tokens
  sample_params_b = sharded_bytes(sample_params)

  def generate(name: str, unique: int, calls: int, note: str) -> Program:
    args, static = _sampler_args(sampler, rows, prompt, unique, exp.sampling.train,
                                 _fixed_tries(exp.rollout))
    slots = f" in {static['flags'].slots} slots" if static["flags"].slots else ""
    return Program(
        name, sampler.generate_program, (sampler.model,) + args, static, calls,
        sample_params_b, unknown_trip_count=sampler.decode_loop_weights(rows, decode_steps),
        steps_per_iteration=sampler.decode_steps_per_iteration(rows, decode_steps),
        note=note.format(slots=slots))

  programs = {"generate": generate(
      "generate", rows, max(exp.env.max_steps - 1, 1),
      f"{rows} rows x prompt {prompt}, prefill + up to {decode_steps} decode steps{{slots}}")}
  unique = sampler.shared_prefill_rows(rows)
  if unique is not None and unique < rows:
    programs["generate_shared"] = generate(
        "generate_shared", unique, 1, f"first turn: {unique} prompts prefilled, copied to "
        f"{rows} rows")
  return sampler, rows, programs


def _estimator_program(estimator, options, capacity: int) -> Program:
  """The estimator on an abstract RowBatch of the iteration's capacity (replicated: the
  trainer runs it on the host's default device, one call per iteration)."""
  levels = getattr(options, "k", 0) + 1
  one = dict(group=[0], traj=[0], step=[0], anchor_obs=["o"], reward=[0.0], valid=[True],
             done=[True])
  grouped = grouping.build_row_batch(one, num_levels=levels, capacity=capacity,
                                     **grouping.grouping_options(options))
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype),
                          grouped.batch)
  fn: Callable = estimator.fn
  return Program("advantages", fn, (abstract, options), {}, 1, 0,
                 note=f"{estimator.name} over {capacity} rows")
