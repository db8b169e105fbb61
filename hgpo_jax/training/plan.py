"""Compiled plans: per-device memory and FLOPs of the real programs on a mesh, no weights.

`compile_plan(config, mesh_shape)` builds the abstract parameters, optimizer state and
batches of a config (`nnx.eval_shape` / `jax.eval_shape`: shapes and shardings only),
lowers and compiles on the current devices (fake CPU devices from `launch.plan`):
  update    one optimizer step on a [mini_batch_rows, prompt + response] mini-batch,
            micro-batched (the trainer's `Learner.update`, donated state);
  logprobs  old/reference log-probs of the same mini-batch (`Learner.compute_logprobs`);
  prefill   the sampler's prefill of [rollout rows, prompt - 1] into a KV cache of
            prompt + max_new_tokens - 1 slots (as `Sampler._generate_device` does);
  decode    one decode step of the same rows against that cache (donated);
and reads `memory_analysis()` (argument / output / aliased / temporary bytes) and the
FLOPs of each executable (`hgpo_jax.perf.compiled_flops`). Persistent per-device bytes
(parameters, AdamW moments, the frozen reference parameters) come from the shardings.
The peak of a phase is persistent + the phase's non-persistent arguments + outputs not
aliased to an argument + temporaries; the plan fits when the largest phase peak leaves
the requested headroom.

Caveat: XLA:CPU's buffer assignment and fusion differ from TPU/GPU, so the temporary
bytes approximate an accelerator's (persistent bytes are exact).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hgpo_jax import perf
from hgpo_jax.models import config as model_config
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding as sharding_lib
from hgpo_jax.training import train_batch as train_batch_lib
from hgpo_jax.training import train_step

PHASES = ("update", "logprobs", "prefill", "decode")
GiB = 1024 ** 3


def parse_bytes(text: str) -> int:
  """'16GiB', '80GB', '95 GiB', '1.5e9' -> bytes (GiB/MiB binary, GB/MB decimal)."""
  s = text.strip().replace(" ", "")
  units = {"TiB": 1024 ** 4, "GiB": GiB, "MiB": 1024 ** 2, "KiB": 1024,
           "TB": 1e12, "GB": 1e9, "MB": 1e6, "KB": 1e3, "B": 1}
  for unit, scale in units.items():
    if s.endswith(unit):
      return int(float(s[:-len(unit)]) * scale)
  try:
    return int(float(s))
  except ValueError:
    raise ValueError(f"cannot read memory size {text!r}; write e.g. 16GiB, 80GB or 1.7e10.") from None


def parse_mesh(text: str) -> tuple[int, int, int]:
  """'fsdp=8' / 'data=2,fsdp=2,tensor=2' -> (data, fsdp, tensor); data defaults to -1."""
  out = {"data": -1, "fsdp": 1, "tensor": 1}
  for item in filter(None, text.split(",")):
    key, _, value = item.partition("=")
    if key.strip() not in out or not value.strip().lstrip("-").isdigit():
      raise ValueError(f"bad mesh item {item!r}; write e.g. fsdp=8 or data=2,fsdp=2,tensor=2.")
    out[key.strip()] = int(value)
  return out["data"], out["fsdp"], out["tensor"]


@dataclasses.dataclass(frozen=True)
class Shapes:
  """What the programs are compiled for, read from an experiment config."""
  model: model_config.ModelConfig
  mini_batch_rows: int
  micro_batch_rows: int
  prompt: int
  response: int
  rollout_rows: int

  @property
  def seq(self) -> int:
    return self.prompt + self.response


def shapes_from_config(config, micro_batch_rows: Optional[int] = None,
                       rollout_rows: Optional[int] = None) -> Shapes:
  """Model architecture (preset, dtype, remat) and batch shapes of a trainer config.

  The update batch is [train.mini_batch_rows, rollout.max_prompt_tokens +
  rollout.max_new_tokens] (the largest prompt bucket); the sampler sees all
  num_groups x group_size slots of a process at once, as the rollout does.
  """
  from hgpo_jax import train  # the trainer's own model settings (not imported at top: cycle)
  cfg = train.model_settings(
      config, model_config.get_preset(config.model.name).replace(param_dtype=config.model.dtype))
  return Shapes(model=cfg, mini_batch_rows=config.train.mini_batch_rows,
                micro_batch_rows=micro_batch_rows or config.train.micro_batch_rows,
                prompt=config.rollout.max_prompt_tokens, response=config.rollout.max_new_tokens,
                rollout_rows=rollout_rows or config.rollout.num_groups * config.rollout.group_size)


@dataclasses.dataclass
class Phase:
  """Per-device bytes and FLOPs of one compiled program."""
  name: str
  flops: float
  argument: int
  output: int
  alias: int
  temp: int
  persistent_args: int  # bytes of the arguments that are persistent state (params, moments)

  @property
  def transient(self) -> int:
    """Bytes the phase adds on top of the persistent state while it runs."""
    return self.argument - self.persistent_args + self.output - self.alias + self.temp


@dataclasses.dataclass
class Plan:
  """A compiled plan on one mesh (all bytes per device)."""
  mesh: tuple[int, int, int]
  shapes: Shapes
  params: int
  opt_state: int
  reference: int
  phases: dict[str, Phase]

  @property
  def persistent(self) -> int:
    return self.params + self.opt_state + self.reference

  def peak(self, phase: Optional[str] = None) -> int:
    names = [phase] if phase else list(self.phases)
    return self.persistent + max((self.phases[n].transient for n in names), default=0)

  def fits(self, device_memory: int, headroom: float) -> bool:
    return self.peak() <= device_memory * (1.0 - headroom)


def _sharded_bytes(tree) -> int:
  """Per-device bytes of a tree of ShapeDtypeStructs with shardings (largest shard)."""
  total = 0
  for leaf in jax.tree.leaves(tree):
    shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
    # Typed PRNG keys (extended dtypes) report their own itemsize (threefry: 8 bytes).
    total += int(np.prod(shape, dtype=np.int64)) * int(leaf.dtype.itemsize)
  return total


def _phase(name: str, compiled, persistent_args: int) -> Phase:
  mem = perf.memory_bytes(compiled)
  return Phase(name=name, flops=perf.compiled_flops(compiled), argument=mem["argument"],
               output=mem["output"], alias=mem["alias"], temp=mem["temp"],
               persistent_args=persistent_args)


def abstract_batch(rows: int, seq: int, sharding) -> train_batch_lib.TrainBatch:
  """ShapeDtypeStructs of a TrainBatch of [rows, seq] placed with `sharding`."""
  sds = lambda dtype: jax.ShapeDtypeStruct((rows, seq), dtype, sharding=sharding)
  return train_batch_lib.TrainBatch(
      tokens=sds(jnp.int32), positions=sds(jnp.int32), input_mask=sds(jnp.bool_),
      response_mask=sds(jnp.bool_), advantages=sds(jnp.float32), old_logprobs=sds(jnp.float32),
      ref_logprobs=sds(jnp.float32))


def _sampler_programs(cfg, graphdef, param_shardings, mesh, rows: int, prompt: int, new: int):
  """Jitted prefill and decode-step functions with the sampler's shapes and masks."""
  cache_len = prompt + new - 1
  cache_sh = sharding_lib.cache_shardings(cfg, mesh, rows, cache_len)
  row_spec = sharding_lib.logical_to_spec(("batch",), mesh, shape=(rows,))[0]
  row_sh = NamedSharding(mesh, P(row_spec))
  row2_sh = NamedSharding(mesh, P(row_spec, None))
  slot_s = jnp.arange(cache_len)

  def prefill(params, tokens_bp, lengths_b):
    model = nnx.merge(graphdef, params)
    cache = jax.lax.with_sharding_constraint(decoder.init_cache(cfg, rows, cache_len), cache_sh)
    pad_b = prompt - lengths_b
    slot_t = jnp.arange(prompt - 1)
    positions_bt = jnp.maximum(slot_t[None, :] - pad_b[:, None], 0)
    mask_bts = ((slot_s[None, None, :] <= slot_t[None, :, None])
                & (slot_s[None, None, :] >= pad_b[:, None, None]))
    _, cache = model.hidden(tokens_bp[:, :-1], positions_bt, mask_bts, cache=cache, cache_index=0)
    return cache

  def decode(params, cache, prev_b, lengths_b, step):
    model = nnx.merge(graphdef, params)
    slot = prompt - 1 + step
    pad_b = prompt - lengths_b
    positions_b1 = (lengths_b - 1 + step)[:, None]
    mask_b1s = ((slot_s[None, :] <= slot) & (slot_s[None, :] >= pad_b[:, None]))[:, None, :]
    logits_b1v, cache = model(prev_b[:, None], positions_b1, mask_b1s, cache=cache,
                              cache_index=slot)
    logp_bv = jax.nn.log_softmax(logits_b1v[:, 0].astype(jnp.float32), axis=-1)
    token_b = jnp.argmax(logp_bv, axis=-1).astype(jnp.int32)
    return token_b, jnp.take_along_axis(logp_bv, token_b[:, None], axis=1)[:, 0], cache

  rep = NamedSharding(mesh, P())
  prefill_jit = jax.jit(prefill, in_shardings=(param_shardings, row2_sh, row_sh),
                        out_shardings=cache_sh)
  decode_jit = jax.jit(decode, donate_argnums=(1,),
                       in_shardings=(param_shardings, cache_sh, row_sh, row_sh, rep),
                       out_shardings=(row_sh, row_sh, cache_sh))
  i32 = lambda shape, sh: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)
  cache_abs = decoder.KVCache(
      k=jax.ShapeDtypeStruct(decoder.cache_shape(cfg, rows, cache_len), cfg.compute_dtype,
                             sharding=cache_sh.k),
      v=jax.ShapeDtypeStruct(decoder.cache_shape(cfg, rows, cache_len), cfg.compute_dtype,
                             sharding=cache_sh.v))
  prefill_args = (i32((rows, prompt), row2_sh), i32((rows,), row_sh))
  decode_args = (cache_abs, i32((rows,), row_sh), i32((rows,), row_sh), i32((), rep))
  return (prefill_jit, prefill_args), (decode_jit, decode_args)


def compile_plan(config, mesh_shape: Sequence[int], *, micro_batch_rows: Optional[int] = None,
                 rollout_rows: Optional[int] = None, phases: Sequence[str] = PHASES,
                 devices=None, update_config=None) -> Plan:
  """Compiles the config's programs on a (data, fsdp, tensor) mesh; see module doc.

  Args:
    config: an experiment ConfigDict (configs/*.py).
    mesh_shape: (data, fsdp, tensor); data=-1 takes the remaining devices.
    micro_batch_rows: override of config.train.micro_batch_rows.
    rollout_rows: override of the sampler's rows (num_groups x group_size).
    phases: which programs to compile (a subset of PHASES).
    devices: devices of the mesh (default all).
    update_config: a `train_step.UpdateConfig` (default: the trainer's, from `config`).
  """
  unknown = set(phases) - set(PHASES)
  if unknown:
    raise ValueError(f"unknown phases {sorted(unknown)}; choose from {PHASES}.")
  shapes = shapes_from_config(config, micro_batch_rows, rollout_rows)
  cfg = shapes.model
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  if update_config is None:
    from hgpo_jax import train as train_lib
    update_config = train_lib.update_config(config)
  update_config = dataclasses.replace(update_config, micro_batch_rows=shapes.micro_batch_rows)
  abstract_model = nnx.eval_shape(lambda: decoder.Decoder(cfg, rngs=nnx.Rngs(0)))
  learner = train_step.Learner(abstract_model, mesh, update_config)
  state = learner.abstract_state()
  params_b = _sharded_bytes(state.params)
  opt_b = _sharded_bytes(state.opt_state)
  state_b = _sharded_bytes(state)
  batch = abstract_batch(shapes.mini_batch_rows, shapes.seq, learner.row_sharding)
  out: dict[str, Phase] = {}
  if "update" in phases:
    out["update"] = _phase("update", learner.update.lower(state, batch).compile(), state_b)
  if "logprobs" in phases:
    out["logprobs"] = _phase("logprobs", learner.compute_logprobs.lower(state.params, batch).compile(),
                             params_b)
  if {"prefill", "decode"} & set(phases):
    rows = shapes.rollout_rows
    dp = learner.data_parallel
    rows = -(-rows // dp) * dp  # the sampler rounds its batch buckets up the same way
    (pre, pre_args), (dec, dec_args) = _sampler_programs(
        cfg, learner.graphdef, learner.param_shardings, mesh, rows, shapes.prompt, shapes.response)
    if "prefill" in phases:
      out["prefill"] = _phase("prefill", pre.lower(state.params, *pre_args).compile(), params_b)
    if "decode" in phases:
      out["decode"] = _phase("decode", dec.lower(state.params, *dec_args).compile(), params_b)
  m = mesh.shape
  return Plan(mesh=(m["data"], m["fsdp"], m["tensor"]), shapes=shapes, params=params_b,
              opt_state=opt_b, reference=params_b, phases=out)


def candidate_meshes(num_devices: int, cfg: model_config.ModelConfig) -> list[tuple[int, int, int]]:
  """(data, fsdp, tensor) candidates, most preferred first: least communication first
  (pure data parallel, then FSDP over more and more devices), tensor parallelism last
  (it splits every matmul and needs head counts divisible by it)."""
  out = []
  fsdp = 1
  while fsdp <= num_devices:
    if num_devices % fsdp == 0:
      out.append((num_devices // fsdp, fsdp, 1))
    fsdp *= 2
  tensor = 2
  while tensor <= num_devices:
    if num_devices % tensor == 0 and cfg.num_kv_heads % tensor == 0:
      out.append((1, num_devices // tensor, tensor))
    tensor *= 2
  return out


def persistent_bytes(config, mesh_shape, devices=None) -> int:
  """Parameters + AdamW moments + reference parameters per device, without compiling."""
  shapes = shapes_from_config(config)
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  abstract_model = nnx.eval_shape(lambda: decoder.Decoder(shapes.model, rngs=nnx.Rngs(0)))
  dp_rows = int(np.prod([mesh.shape[a] for a in ("data", "fsdp")]))
  learner = train_step.Learner(abstract_model, mesh, train_step.UpdateConfig(
      mini_batch_rows=dp_rows, micro_batch_rows=dp_rows))
  state = learner.abstract_state()
  return 2 * _sharded_bytes(state.params) + _sharded_bytes(state.opt_state)


def micro_batch_candidates(config, data_parallel: int) -> list[int]:
  """Micro-batches to try, smallest first: the data-parallel size (one row per device),
  then doublings up to the config's micro-batch (each dividing the mini-batch)."""
  out = []
  m = data_parallel
  while m <= config.train.micro_batch_rows:
    if config.train.mini_batch_rows % m == 0:
      out.append(m)
    m *= 2
  return out


TRAIN_PHASES = ("update", "logprobs")


def recommend(config, num_devices: int, device_memory: int, headroom: float = 0.1,
              log=print) -> tuple[Optional[Plan], list[tuple[tuple, int, str]]]:
  """The first candidate mesh whose train step (update, then log-probs) fits, with the
  largest micro-batch that fits on it.

  Candidates whose persistent bytes alone do not fit are not compiled; on each mesh the
  micro-batches are tried smallest first (one row per device) and the search moves to
  the next mesh as soon as one does not fit (temporaries grow with the micro-batch).
  Returns (plan or None, tried: [(mesh, micro_batch or 0, verdict)]).
  """
  shapes = shapes_from_config(config)
  budget = device_memory * (1.0 - headroom)
  tried = []
  for mesh_shape in candidate_meshes(num_devices, shapes.model):
    persistent = persistent_bytes(config, mesh_shape)
    if persistent > budget:
      tried.append((mesh_shape, 0, f"persistent {persistent / GiB:.2f} GiB > budget {budget / GiB:.2f} GiB"))
      log(f"  mesh data={mesh_shape[0]} fsdp={mesh_shape[1]} tensor={mesh_shape[2]}: {tried[-1][2]}")
      continue
    best = None
    for micro in micro_batch_candidates(config, mesh_shape[0] * mesh_shape[1]):
      # The update holds the largest temporaries of the train step (the log-prob pass
      # keeps no backward residuals); the log-probs are compiled for the winner below.
      plan = compile_plan(config, mesh_shape, micro_batch_rows=micro, phases=("update",))
      ok = plan.fits(device_memory, headroom)
      verdict = f"peak {plan.peak() / GiB:.2f} GiB, budget {budget / GiB:.2f} GiB: {'fits' if ok else 'no'}"
      tried.append((mesh_shape, micro, verdict))
      log(f"  mesh data={mesh_shape[0]} fsdp={mesh_shape[1]} tensor={mesh_shape[2]} "
          f"micro-batch {micro}: {verdict}")
      if not ok:
        break
      best = plan
    if best is not None:
      best = compile_plan(config, mesh_shape, micro_batch_rows=best.shapes.micro_batch_rows,
                          phases=TRAIN_PHASES)
      if best.fits(device_memory, headroom):
        return best, tried
      tried.append((mesh_shape, best.shapes.micro_batch_rows, "log-probs do not fit"))
  return None, tried


def sampler_rows_line(plan: Plan, device_memory: int, headroom: float = 0.1) -> str:
  """How many sampler rows per call fit, from the prefill's bytes (linear in rows: the
  KV cache, the [rows, prompt, cache] mask and the attention scores all are)."""
  if "prefill" not in plan.phases:
    return "sampler: not compiled"
  budget = device_memory * (1.0 - headroom)
  rows = plan.shapes.rollout_rows
  per_row = max(plan.phases[p].transient for p in ("prefill", "decode") if p in plan.phases) / rows
  dp = plan.mesh[0] * plan.mesh[1]
  fit = int((budget - plan.persistent) // per_row) if per_row > 0 else rows
  fit = max(fit // dp * dp, 0)
  verdict = "fits" if fit >= rows else "does NOT fit"
  return (f"sampler: {rows} rows x prompt {plan.shapes.prompt} {verdict}; about {fit} rows per "
          f"generate call fit next to the persistent state (linear estimate from the prefill)")


def format_plan(plan: Plan, device_memory: Optional[int] = None, headroom: float = 0.1) -> str:
  """A human-readable table of one plan (GiB per device)."""
  g = lambda b: f"{b / GiB:8.2f}"
  s = plan.shapes
  lines = [
      f"mesh data={plan.mesh[0]} fsdp={plan.mesh[1]} tensor={plan.mesh[2]}; model "
      f"{s.model.num_layers}L d={s.model.hidden_dim} {s.model.dtype} remat={s.model.remat}; "
      f"update [{s.mini_batch_rows} x {s.seq}] micro-batch {s.micro_batch_rows}; sampler "
      f"{s.rollout_rows} rows x prompt {s.prompt} + {s.response} new",
      f"per device: params {g(plan.params)} GiB, optimizer {g(plan.opt_state)} GiB, "
      f"reference {g(plan.reference)} GiB (persistent {g(plan.persistent)} GiB)",
      f"{'phase':9s} {'GFLOP':>12s} {'args':>8s} {'output':>8s} {'aliased':>8s} {'temp':>8s} {'peak':>8s}  (GiB)",
  ]
  for p in plan.phases.values():
    lines.append(f"{p.name:9s} {p.flops / 1e9:12.1f} {g(p.argument)} {g(p.output)} {g(p.alias)} "
                 f"{g(p.temp)} {g(plan.persistent + p.transient)}")
  if device_memory:
    budget = device_memory * (1.0 - headroom)
    peak = plan.peak()
    verdict = "FITS" if peak <= budget else "DOES NOT FIT"
    lines.append(f"{verdict}: peak {peak / GiB:.2f} GiB of {device_memory / GiB:.2f} GiB "
                 f"({headroom:.0%} headroom kept: budget {budget / GiB:.2f} GiB, "
                 f"left {(budget - peak) / GiB:.2f} GiB)")
    over = [p.name for p in plan.phases.values() if plan.persistent + p.transient > budget]
    if over:
      lines.append(f"over budget: {', '.join(over)}")
  return "\n".join(lines)
