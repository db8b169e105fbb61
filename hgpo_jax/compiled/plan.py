"""Compiled plans: per-device memory, FLOPs and time of the real programs on a mesh, no weights.

`compile_plan(exp, mesh_shape, devices=...)` builds the experiment's programs with the
program registry (`hgpo_jax.training.programs`: the trainer's own jitted update, log-prob,
critic and sampler programs, abstract arguments with their shardings), lowers and compiles
each for the mesh's devices, and reads `memory_analysis()` (argument / output / aliased /
temporary bytes), the matmul FLOPs of the executable (`hgpo_jax.cost.hlo.compiled_flops`, loops
weighted by trip count; the decode loop by max_new_tokens, an upper bound) and, on TPU,
XLA:TPU's own cost-model cycles (`hlo.hlo_estimated_cycles`). For each generate program
it also reads one decode step: its trip-weighted memory traffic and cycles per device
against the step's necessary bytes (`decode_traffic`; launch/plan.py prints them).

The devices decide which compiler runs: TPU topology devices (`hgpo_jax.cost.targets`,
`launch.plan --topology v5e-8`) go through XLA:TPU, whose memory figures are the TPU's and
which refuses a program that does not fit its HBM (reported here as a refused phase with
the bytes it asked for); fake CPU devices (`launch.plan --devices N`) go through XLA:CPU,
whose temporaries only approximate an accelerator's (persistent bytes are exact).

Peak of a program = the persistent state that is not among its arguments (the frozen
reference during the update, the optimizer state during the rollout, ...) + its own
arguments + outputs not aliased to an argument + temporaries. The plan fits when the
largest peak leaves the requested headroom.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Optional, Sequence

import numpy as np

from hgpo_jax.cost import hardware
from hgpo_jax.cost import hlo
from hgpo_jax.cost import targets as targets_lib
from hgpo_jax.cost.hardware import GiB
from hgpo_jax.models import config as model_config
from hgpo_jax.models import sharding as sharding_lib
from hgpo_jax.sampling import decode_traffic
from hgpo_jax.training import programs as programs_lib
from hgpo_jax.training import experiment as experiment_lib

TRAIN_PHASES = ("update", "logprobs")


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
  """What the programs are compiled for, read from an experiment."""
  model: model_config.ModelConfig
  mini_batch_rows: int
  micro_batch_rows: int
  prompt: int
  response: int
  rollout_rows: int

  @property
  def seq(self) -> int:
    return self.prompt + self.response


def shapes_from_config(exp, micro_batch_rows: Optional[int] = None,
                       rollout_rows: Optional[int] = None, devices=None) -> Shapes:
  """Model architecture (preset, dtype, remat) and batch shapes of a trainer config, with
  the numerics of `devices` (default: this process's JAX devices; "auto" settings resolve
  by their platform).

  The update batch is [train.mini_batch_rows, rollout.max_prompt_tokens +
  rollout.max_new_tokens] (the largest prompt bucket); the sampler sees all
  num_groups x group_size slots of a process at once, as the rollout does.
  """
  cfg = experiment_lib.model_settings(
      exp.model, model_config.get_preset(exp.model.name).replace(param_dtype=exp.model.dtype),
      devices)
  u = exp.train.update
  return Shapes(model=cfg, mini_batch_rows=u.mini_batch_rows,
                micro_batch_rows=micro_batch_rows or u.micro_batch_rows,
                prompt=exp.rollout.max_prompt_tokens, response=exp.rollout.max_new_tokens,
                rollout_rows=rollout_rows or exp.rollout.num_groups * exp.rollout.group_size)


@dataclasses.dataclass
class Phase:
  """Per-device bytes, FLOPs and cost of one compiled program (or XLA's refusal)."""
  name: str
  flops: float
  argument: int
  output: int
  alias: int
  temp: int
  persistent_args: int  # bytes of the arguments that are persistent state (params, moments)
  calls: int = 1  # calls in one training iteration
  cycles: float = 0.0  # XLA:TPU's cost-model cycles per call (0 on other backends)
  refused: bool = False  # XLA refused to compile it: out of memory (temp = bytes asked)
  note: str = ""
  # generate programs: one decode step (`decode_traffic.step_cost`), per device
  step: Optional[decode_traffic.StepCost] = None

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
  critic: int = 0
  platform: str = "cpu"
  device_kind: str = "cpu"
  rollout_rows: int = 0
  sample_mesh: tuple[int, int, int] = (0, 0, 0)
  reference_host: int = 0  # the offloaded reference, in each device's host memory
  # what one decode step of the rollout's generate call must move, per device
  decode_necessary: Optional[decode_traffic.Necessary] = None
  # rollout.prefill_chunk_rows the search chose (0: the config's own)
  prefill_chunk_rows: int = 0
  # rollout.decode_slots the search chose (0: the config's own)
  decode_slots: int = 0
  # False where the search dropped the shared first-turn prefill (rollout.share_prefill)
  share_prefill: bool = True

  @property
  def persistent(self) -> int:
    return self.params + self.opt_state + self.reference + self.critic

  def peak(self, phase: Optional[str] = None) -> int:
    names = [phase] if phase else list(self.phases)
    return self.persistent + max((self.phases[n].transient for n in names), default=0)

  def peak_phase(self) -> str:
    return max(self.phases, key=lambda n: self.phases[n].transient)

  def refused(self) -> list[str]:
    return [n for n, p in self.phases.items() if p.refused]

  def fits(self, device_memory: int, headroom: float) -> bool:
    return not self.refused() and self.peak() <= device_memory * (1.0 - headroom)


def _mesh_tuple(mesh) -> tuple[int, int, int]:
  m = mesh.shape
  return (m["data"], m["fsdp"], m["tensor"])


def _phase(program: programs_lib.Program, valid_slots: Optional[float] = None) -> Phase:
  """Compiles one registry program; an out-of-memory refusal becomes a refused Phase.
  `valid_slots`: a row's mean valid cache slots, to credit a generate program's decode
  attention kernels with what they read (`decode_traffic.step_cost`)."""
  try:
    compiled = program.lower().compile()
  except Exception as e:  # noqa: BLE001  (XlaRuntimeError; only OOM is expected here)
    if not targets_lib.is_oom(e):
      raise
    asked = targets_lib.parse_oom(str(e))
    return Phase(name=program.name, flops=0.0, argument=0, output=0, alias=0,
                 temp=asked[0] if asked else 0, persistent_args=0, calls=program.calls,
                 refused=True, note=program.note)
  mem = hlo.memory_bytes(compiled)
  text = compiled.as_text()
  return Phase(name=program.name,
               flops=hlo.compiled_flops(compiled, program.unknown_trip_count, text),
               argument=mem["argument"], output=mem["output"], alias=mem["alias"],
               temp=mem["temp"], persistent_args=program.persistent, calls=program.calls,
               cycles=hlo.hlo_estimated_cycles(text, program.unknown_trip_count),
               note=program.note,
               step=(decode_traffic.step_cost(text, program.unknown_trip_count,
                                              program.steps_per_iteration, valid_slots)
                     if program.name.startswith("generate") else None))


def compile_plan(exp, mesh_shape: Sequence[int], *, micro_batch_rows: Optional[int] = None,
                 rollout_rows: Optional[int] = None, phases: Optional[Sequence[str]] = None,
                 devices=None) -> Plan:
  """Compiles the config's registry programs on a (data, fsdp, tensor) mesh of `devices`
  (default: this process's JAX devices); see module doc.

  Args:
    exp: the run's settings (`experiment.from_config` of a configs/*.py ConfigDict).
    mesh_shape: (data, fsdp, tensor); data=-1 takes the remaining devices.
    micro_batch_rows: override of train.micro_batch_rows.
    rollout_rows: override of the sampler's rows per call on one process.
    phases: which registry programs to compile (default: all of the config's).
    devices: devices of the mesh: fake CPU devices, or TPU topology devices
      (`targets.devices`) to compile with XLA:TPU.
  """
  shapes = shapes_from_config(exp, micro_batch_rows, rollout_rows, devices)
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  registry = programs_lib.build(exp, mesh, micro_batch_rows=shapes.micro_batch_rows,
                                rollout_rows=rollout_rows)
  names = list(registry.programs) if phases is None else list(phases)
  unknown = set(names) - set(registry.programs)
  if unknown:
    raise ValueError(f"unknown programs {sorted(unknown)}; this config has "
                     f"{sorted(registry.programs)}.")
  necessary = (decode_traffic.necessary_bytes(registry.sampler, registry.rollout_rows,
                                              shapes.prompt, shapes.response)
               if any(n.startswith("generate") for n in names) else None)
  out = {n: _phase(registry.programs[n], necessary.valid_slots if necessary else None)
         for n in names}
  device = mesh.devices.flat[0]
  return Plan(mesh=_mesh_tuple(mesh), shapes=dataclasses.replace(
                  shapes, rollout_rows=registry.rollout_rows, model=registry.model_cfg),
              params=registry.params_bytes, opt_state=registry.opt_bytes,
              reference=registry.reference_bytes, critic=registry.critic_bytes, phases=out,
              reference_host=registry.reference_host_bytes,
              platform=registry.platform, device_kind=getattr(device, "device_kind", "cpu"),
              rollout_rows=registry.rollout_rows, sample_mesh=_mesh_tuple(registry.sample_mesh),
              decode_necessary=necessary)


def rollout_programs(exp, mesh_shape: Sequence[int], *, compile_them: bool = False,
                     rollout_rows: Optional[int] = None, devices=None,
                     log=lambda line: None) -> list[tuple[str, Optional[Phase]]]:
  """Every generate program a run of `exp` can call on one process
  (`programs.Registry.rollout_programs`: each batch and prompt bucket, shared and unshared
  prefill, training and evaluation sampling), each compiled for the mesh's devices when
  `compile_them` (else its Phase is None). `log` gets a line per compiled program."""
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  registry = programs_lib.build(exp, mesh, rollout_rows=rollout_rows)
  out = []
  for program in registry.rollout_programs():
    phase = None
    if compile_them:
      start = time.perf_counter()
      phase = _phase(program)
      log(f"  {program.name}: peak {(phase.transient + registry.persistent) / GiB:.2f} GiB"
          f"{' (refused)' if phase.refused else ''}, compiled in "
          f"{time.perf_counter() - start:.0f} s")
    out.append((program.name, phase))
  return out


def candidate_meshes(num_devices: int, cfg: model_config.ModelConfig,
                     devices_per_process: Optional[int] = None) -> list[tuple[int, int, int]]:
  """(data, fsdp, tensor) candidates, most preferred first: least communication first
  (pure data parallel, then FSDP over more and more devices), tensor parallelism last
  (it splits every matmul and needs head counts divisible by it, and the devices of each
  process, over which the sampler runs: `programs.sampling_mesh`; default: all devices in
  one process)."""
  local = devices_per_process or num_devices
  out = []
  fsdp = 1
  while fsdp <= num_devices:
    if num_devices % fsdp == 0:
      out.append((num_devices // fsdp, fsdp, 1))
    fsdp *= 2
  tensor = 2
  while tensor <= num_devices:
    if num_devices % tensor == 0 and cfg.num_kv_heads % tensor == 0 and local % tensor == 0:
      out.append((1, num_devices // tensor, tensor))
    tensor *= 2
  return out


def persistent_bytes(exp, mesh_shape, devices=None) -> int:
  """Bytes per device that live through the iteration (actor params + AdamW moments +
  reference, + the critic's params and moments), from the shardings, without compiling."""
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  dp = int(np.prod([mesh.shape[a] for a in ("data", "fsdp")]))
  return programs_lib.build(exp, mesh, micro_batch_rows=dp).persistent


def micro_batch_candidates(exp, data_parallel: int) -> list[int]:
  """Micro-batches to try, smallest first: the data-parallel size (one row per device),
  then doublings up to the config's micro-batch (each dividing the mini-batch). A config
  written for fewer devices (a smoke variant's 4 rows on 8 devices) gets the data-parallel
  size alone; a mesh wider than the mini-batch gets none."""
  out = []
  m = data_parallel
  while m <= max(exp.train.update.micro_batch_rows, data_parallel):
    if exp.train.update.mini_batch_rows % m == 0:
      out.append(m)
    m *= 2
  return out


def learner_phases(exp) -> tuple[str, ...]:
  """The programs whose temporaries grow with the micro-batch and hold the train step's
  backward residuals: the actor's update, and the critic's when the estimator has one."""
  critic = exp.estimator.needs_critic
  return ("update", "critic_update") if critic else ("update",)


def mesh_label(mesh_shape) -> str:
  return f"mesh data={mesh_shape[0]} fsdp={mesh_shape[1]} tensor={mesh_shape[2]}"


def with_mesh(exp: experiment_lib.Experiment, mesh_shape) -> experiment_lib.Experiment:
  """`exp` whose `mesh` is `mesh_shape`: the sampler's per-host mesh derives from it
  (`programs.sampling_mesh`), as in a run with that mesh."""
  data, fsdp, tensor = (int(x) for x in mesh_shape)
  return dataclasses.replace(exp, mesh=experiment_lib.Mesh(data=data, fsdp=fsdp, tensor=tensor))


def recommend(exp, num_devices: int, device_memory: int, headroom: float = 0.1,
              log=print, devices=None) -> tuple[Optional[Plan], list[tuple[tuple, int, str]]]:
  """The first candidate mesh on which every program of an iteration fits, with the
  largest micro-batch that fits on it.

  On each candidate mesh (`candidate_meshes`, least communication first): candidates whose
  persistent bytes alone do not fit are not compiled; the learners' updates (the actor's
  and the critic's, `learner_phases`) are compiled at each micro-batch, smallest first
  (one row per device), moving on as soon as one does not fit (temporaries grow with the
  micro-batch); then the other programs at the largest micro-batch that fit, one at a time
  until one does not fit: the sampler first (on the per-host sampling mesh the trainer
  derives from this mesh), then the log-probs, critic values and estimator. A sampler
  program that does not fit when it prefills every row at once (a config without
  `rollout.prefill_chunk_rows`) is compiled again with the prefill in row chunks, the
  largest that fits (`prefill_chunk_candidates`; the plan's `prefill_chunk_rows`). A
  shared first-turn prefill (`generate_shared`) that does not fit where `generate` does is
  dropped (`rollout.share_prefill=false`: the first turn prefills every row through
  `generate`, same tokens; the plan's `share_prefill`). The first mesh where all fit is
  returned with the whole plan.

  Only when no mesh fits so, a last resort: on the meshes (in the same order) where only
  the sampler did not fit, continuous batching through fewer KV-cache rows than the call
  has (`rollout.decode_slots`, the most slots that fit: `decode_slot_candidates`; the plan's
  `decode_slots`). Slots decode a call's rows in turns, so they come after every mesh on
  which all rows decode at once; they save at most the cache of the rows they leave out,
  and a mesh whose sampler is over the budget by more than that is not compiled again.
  Returns (plan or None, tried: [(mesh, micro_batch or 0, verdict)]).
  """
  shapes = shapes_from_config(exp, devices=devices)
  budget = device_memory * (1.0 - headroom)
  learners = learner_phases(exp)
  tried = []
  per_process = None
  if devices is not None:
    counts = collections.Counter(d.process_index for d in devices[:num_devices])
    per_process = min(counts.values())
  stuck = []  # (mesh, cfg, micro, plan so far, sampler name, its lowest peak, all-rows plan)
  for mesh_shape in candidate_meshes(num_devices, shapes.model, per_process):
    cfg = with_mesh(exp, mesh_shape)
    persistent = persistent_bytes(cfg, mesh_shape, devices=devices)
    if persistent > budget:
      tried.append((mesh_shape, 0, f"persistent {persistent / GiB:.2f} GiB > budget {budget / GiB:.2f} GiB"))
      log(f"  {mesh_label(mesh_shape)}: {tried[-1][2]}")
      continue
    best = None
    micros = micro_batch_candidates(cfg, mesh_shape[0] * mesh_shape[1])
    if not micros:
      tried.append((mesh_shape, 0, f"no micro-batch: the mini-batch of "
                    f"{cfg.train.update.mini_batch_rows} rows is narrower than the mesh"))
      log(f"  {mesh_label(mesh_shape)}: {tried[-1][2]}")
      continue
    for micro in micros:
      plan = compile_plan(cfg, mesh_shape, micro_batch_rows=micro, phases=learners,
                          devices=devices)
      ok = plan.fits(device_memory, headroom)
      verdict = (f"{' + '.join(learners)} peak {plan.peak() / GiB:.2f} GiB, budget "
                 f"{budget / GiB:.2f} GiB: {'fits' if ok else 'no'}")
      tried.append((mesh_shape, micro, verdict))
      log(f"  {mesh_label(mesh_shape)} micro-batch {micro}: {verdict}")
      if not ok:
        break
      best = plan
    if best is None:
      continue
    micro = best.shapes.micro_batch_rows
    # The sampler first (its cache grows with the rows, not the micro-batch: the program
    # most likely to refuse a mesh), one program at a time, stopping at the first misfit.
    rest = sorted((n for n in program_names(cfg, mesh_shape, devices) if n not in learners),
                  key=lambda n: not n.startswith("generate"))
    full, stuck_at = _fit_programs(cfg, mesh_shape, micro, best, rest, device_memory,
                                   headroom, log, devices)
    if stuck_at is not None:
      stuck.append((mesh_shape, micro, best, rest) + stuck_at)
    if _verdict(full, mesh_shape, micro, device_memory, headroom, tried, log):
      return full, tried
  for mesh_shape, micro, best, rest, cfg, full, name, least, one in stuck:
    # The last resort: decode slots for the sampler that stopped this mesh.
    candidates = decode_slot_candidates(cfg, mesh_shape, devices)
    cache = one.decode_necessary.cache if one.decode_necessary else 0.0
    saving = cache * (1 - min(candidates, default=one.rollout_rows) / one.rollout_rows)
    if not candidates or least - budget > saving:
      log(f"  {mesh_label(mesh_shape)} micro-batch {micro}, {name}: over the budget by "
          f"{(least - budget) / GiB:.2f} GiB, more than decode slots can save (the KV cache "
          f"of {one.rollout_rows} rows is {cache / GiB:.2f} GiB per device)")
      continue
    for rows in candidates:
      slotted = with_decode_slots(cfg, rows)
      tried_one = compile_plan(slotted, mesh_shape, micro_batch_rows=micro, devices=devices,
                               phases=(name,))
      ok = _merged(full, tried_one).fits(device_memory, headroom)
      log(f"  {mesh_label(mesh_shape)} micro-batch {micro}, {name} decoding in {rows} slots: "
          f"temporaries {tried_one.phases[name].temp / GiB:.2f} GiB: {'fits' if ok else 'no'}")
      if ok:
        later = rest[rest.index(name) + 1:]
        done, _ = _fit_programs(slotted, mesh_shape, micro, _merged(full, tried_one), later,
                                device_memory, headroom, log, devices)
        done = dataclasses.replace(done, decode_slots=rows)
        if _verdict(done, mesh_shape, micro, device_memory, headroom, tried, log):
          return done, tried
        break
  return None, tried


def _fit_programs(cfg, mesh_shape, micro, full: Plan, names, device_memory, headroom, log,
                  devices):
  """`full` with `names` compiled on it in order until one does not fit (a sampler that
  does not fit prefilling every row at once tried again in prefill chunks; a shared
  prefill that does not fit dropped). Returns (the plan, with the chosen
  `prefill_chunk_rows` and `share_prefill`; None, or when a sampler stopped it (cfg, the
  plan before it, its name, its lowest peak, its all-rows plan))."""
  chunk = 0
  shared = True
  for name in names:
    one = compile_plan(cfg, mesh_shape, micro_batch_rows=micro, devices=devices,
                       phases=(name,))
    if (name == "generate_shared" and "generate" in full.phases
        and not _merged(full, one).fits(device_memory, headroom)):
      # The first turn's prefill shared by a group is a saving of prefill compute; where
      # its program does not fit, the first turn prefills every row as the other turns do.
      log(f"  {mesh_label(mesh_shape)} micro-batch {micro}, {name}: temporaries "
          f"{one.phases[name].temp / GiB:.2f} GiB: {'refused' if one.phases[name].refused else 'no'}"
          "; the first turn without it (rollout.share_prefill=false)")
      cfg, shared = with_share_prefill(cfg, False), False
      continue
    if (name.startswith("generate") and not cfg.rollout.prefill_chunk_rows
        and not cfg.rollout.decode_slots
        and not _merged(full, one).fits(device_memory, headroom)):
      # A sampler whose prefill of every row at once does not fit: the prefill in row
      # chunks (`rollout.prefill_chunk_rows`), the largest that fits; the decode is the same.
      log(f"  {mesh_label(mesh_shape)} micro-batch {micro}, {name} prefilling all "
          f"{one.rollout_rows} rows at once: temporaries {one.phases[name].temp / GiB:.2f} "
          f"GiB: {'refused' if one.phases[name].refused else 'no'}")
      least = _merged(full, one).peak()
      for rows in prefill_chunk_candidates(cfg, mesh_shape, devices):
        chunked = with_prefill_chunk(cfg, rows)
        tried_one = compile_plan(chunked, mesh_shape, micro_batch_rows=micro,
                                 devices=devices, phases=(name,))
        ok = _merged(full, tried_one).fits(device_memory, headroom)
        least = min(least, _merged(full, tried_one).peak())
        log(f"  {mesh_label(mesh_shape)} micro-batch {micro}, {name} with prefill chunks "
            f"of {rows} rows: temporaries {tried_one.phases[name].temp / GiB:.2f} GiB: "
            f"{'fits' if ok else 'no'}")
        if ok:
          cfg, one, chunk = chunked, tried_one, rows
          break
      else:
        return (dataclasses.replace(_merged(full, one), prefill_chunk_rows=chunk,
                                    share_prefill=shared),
                (cfg, full, name, least, one))
    full = _merged(full, one)
    if not full.fits(device_memory, headroom):
      break
  return dataclasses.replace(full, prefill_chunk_rows=chunk, share_prefill=shared), None


def _verdict(full: Plan, mesh_shape, micro, device_memory, headroom, tried, log) -> bool:
  """Whether every program of `full` fits; records and logs the mesh's verdict."""
  budget = device_memory * (1.0 - headroom)
  ok = full.fits(device_memory, headroom)
  over = [n for n, p in full.phases.items()
          if p.refused or full.persistent + p.transient > budget]
  verdict = (f"every program: peak {full.peak() / GiB:.2f} GiB ({full.peak_phase()}): fits"
             if ok else f"{', '.join(over)} refused or over budget "
             f"(asked {max(full.phases[n].temp for n in over) / GiB:.2f} GiB of temporaries)")
  tried.append((mesh_shape, micro, verdict))
  log(f"  {mesh_label(mesh_shape)} micro-batch {micro}, {verdict}")
  return ok


def _merged(plan: Plan, one: Plan) -> Plan:
  """`one`'s compiled programs added to `plan`'s."""
  return dataclasses.replace(one, phases={**plan.phases, **one.phases})


def with_prefill_chunk(exp: experiment_lib.Experiment, rows: int) -> experiment_lib.Experiment:
  """`exp` whose sampler prefills `rows` rows at a time."""
  return exp.override({"rollout.prefill_chunk_rows": int(rows)})


def with_share_prefill(exp: experiment_lib.Experiment, shared: bool) -> experiment_lib.Experiment:
  """`exp` whose sampler shares (or not) the first turn's prefill of a group."""
  return exp.override({"rollout.share_prefill": bool(shared)})


def with_decode_slots(exp: experiment_lib.Experiment, slots: int) -> experiment_lib.Experiment:
  """`exp` whose sampler decodes a call's rows through `slots` cache rows."""
  return exp.override({"rollout.decode_slots": int(slots)})


def decode_slot_candidates(exp, mesh_shape, devices=None) -> list[int]:
  """Decode slots to try, most first: the same halvings as `prefill_chunk_candidates` (a
  call of fewer rows than its slots decodes in lockstep, so only fewer are candidates)."""
  return prefill_chunk_candidates(exp, mesh_shape, devices)


def prefill_chunk_candidates(exp, mesh_shape, devices=None) -> list[int]:
  """Rows per prefill chunk to try, largest first: halvings of the sampler's rows per call
  that stay multiples of its batch-parallel size (the sampler's rule), down to that size."""
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  dp = int(np.prod([mesh.shape[a] for a in ("data", "fsdp")]))
  registry = programs_lib.build(exp, mesh, micro_batch_rows=dp)
  step, rows = registry.sampler.batch_parallel, registry.rollout_rows
  out = []
  r = rows // 2
  while r >= step:
    if r % step == 0:
      out.append(r)
    r //= 2
  return out


def plan_config(exp: experiment_lib.Experiment, plan: Plan) -> experiment_lib.Experiment:
  """`exp` with what the search chose for `plan`: its mesh (prefill chunk, decode slots)."""
  out = with_mesh(exp, plan.mesh)
  out = with_prefill_chunk(out, plan.prefill_chunk_rows) if plan.prefill_chunk_rows else out
  out = with_share_prefill(out, False) if not plan.share_prefill else out
  return with_decode_slots(out, plan.decode_slots) if plan.decode_slots else out


def program_names(exp, mesh_shape, devices=None) -> list[str]:
  """The names of the config's programs on a mesh (no compile)."""
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  dp = int(np.prod([mesh.shape[a] for a in ("data", "fsdp")]))
  return list(programs_lib.build(exp, mesh, micro_batch_rows=dp).programs)


def largest_rollout_rows(exp, mesh_shape, device_memory: int, headroom: float = 0.1, *,
                         micro_batch_rows: Optional[int] = None, devices=None,
                         log=print) -> int:
  """The most sampler rows per generate call (a batch bucket of the sampler) whose compiled
  program fits next to the persistent state: a bisection over the buckets, each step one
  compile of the sampler's own program; 0 if not even the smallest bucket fits."""
  mesh = sharding_lib.make_mesh(*mesh_shape, devices=devices)
  registry = programs_lib.build(exp, mesh, micro_batch_rows=micro_batch_rows)
  buckets = [b for b in registry.sampler.batch_buckets]
  budget = device_memory * (1.0 - headroom)
  lo, hi, best = 0, len(buckets) - 1, 0
  while lo <= hi:
    mid = (lo + hi) // 2
    plan = compile_plan(exp, mesh_shape, micro_batch_rows=micro_batch_rows,
                        rollout_rows=buckets[mid], phases=("generate",), devices=devices)
    ok = plan.fits(device_memory, headroom)
    log(f"  sampler {buckets[mid]} rows: "
        + (f"refused by XLA (asked {plan.phases['generate'].temp / GiB:.2f} GiB)"
           if plan.refused() else f"peak {plan.peak() / GiB:.2f} GiB of budget "
           f"{budget / GiB:.2f} GiB: {'fits' if ok else 'no'}"))
    if ok:
      best, lo = buckets[mid], mid + 1
    else:
      hi = mid - 1
  return best


def estimated_seconds(plan: Plan, seconds_per_cycle: float) -> dict[str, float]:
  """Per program: calls per iteration x XLA:TPU's cost-model cycles x seconds per cycle
  (`targets.seconds_per_cycle`), and the iteration's total under "iteration". An XLA:TPU
  estimate, not a measurement: collectives, host work and env steps are not in it, and the
  decode loop is counted at max_new_tokens for every row."""
  out = {n: p.calls * p.cycles * seconds_per_cycle for n, p in plan.phases.items()}
  kernel = {n: kernel_seconds(plan, p) for n, p in plan.phases.items()}
  for n, p in plan.phases.items():  # the decode attention kernels: one per decode step
    out[n] += p.calls * plan.shapes.response * kernel[n]
  out["iteration"] = sum(out.values())
  for n, p in plan.phases.items():  # not part of the sum: one decode step of each call
    if p.step is not None:
      out[f"{n} decode step"] = p.step.cycles * seconds_per_cycle + kernel[n]
  return out


def kernel_seconds(plan: Plan, phase: Phase) -> float:
  """Seconds of one decode step's attention-kernel reads (`StepCost.kernel_bytes`) at the
  chip's datasheet bandwidth: XLA:TPU's cost model leaves a custom call's time out."""
  if phase.step is None or not phase.step.kernel_bytes:
    return 0.0
  bandwidth = hardware.memory_bandwidth(plan.device_kind)[1]
  return phase.step.kernel_bytes / bandwidth if bandwidth else 0.0
