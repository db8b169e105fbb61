r"""Compiled plan for a pod: per-device memory, FLOPs, time and a mesh search, no weights.

  python -m launch.plan --config=configs/alfworld.py:algo=hgpo,model=qwen2.5-1.5b \
      --topology v5e-8 [--mesh data=1,fsdp=4,tensor=2] [--micro-batch 8] [--search]

Builds every program of the config with the program registry (hgpo_jax/training/programs.py:
the trainer's own update, log-prob, critic, sampler and estimator programs; abstract
parameters, optimizer state and batches, no weights) and compiles each for the target:

* `--topology NAME` (v4-8, v5e-8, v5e-16, v5e-32, v5p-8, v5p-16, v6e-8, v6e-16, or a
  topology string such as v5e:2x4): the devices of that TPU slice, all hosts, from
  `jax.experimental.topologies` on this CPU-only host, compiled by the real XLA:TPU compiler
  of the `libtpu` wheel. Memory figures are the TPU's; a program XLA:TPU refuses is reported
  as not fitting with the bytes it asked for. The device memory defaults to XLA:TPU's own
  usable HBM per chip. Also prints XLA:TPU's estimated time per iteration (its cost model,
  not a measurement).
* `--topology h100-8` or `h100-1` (experimental): 8 x H100 SXM, or one (the shape of
  `launch.benchmarks.rollout`), compiled by XLA:GPU without a GPU, through
  the CUDA plugin's compile-only topology (needs `jax-cuda12-plugin[with-cuda]==0.10.2`,
  not installed by default; no autotuning, so temporaries can differ from a real compile).
* `--devices N` without a topology: N fake CPU devices compiled by XLA:CPU, a labelled
  approximation of an accelerator's temporaries (persistent bytes are exact).

Prints per device each program's argument / output / aliased / temporary / peak bytes and
FLOPs per call; `--rollout-programs list|compile` lists (or compiles) every sampler
program a run can call, each batch and prompt bucket (`rollout.precompile` compiles them).
`--micro-batch N` is every learner's micro-batch (the actor's and the critic's, the run's
`--config.train.micro_batch_rows`); without it a config written for fewer devices gets its
micro-batch raised to the mesh's data-parallel size. `--no-compile` checks the config, the
mesh and the micro-batch and lowers every program, without XLA (seconds).

`--search` tries candidate meshes, least communication first: on each, every learner's
update (the critic's too) at growing micro-batches, then the other programs (the sampler
on the per-host sampling mesh the trainer derives from that mesh) at the largest that fit,
a sampler that does not fit prefilling every row at once again with its prefill in row
chunks (`--config.rollout.prefill_chunk_rows`, the largest that fits, unless the config
sets one), a shared first-turn prefill that does not fit dropped
(`--config.rollout.share_prefill=false`) and, only when no mesh fits so, continuous batching
through fewer KV-cache rows (`--config.rollout.decode_slots`, the most that fit); it ends
with the winner's plan, its `launch.main` and `launch.plan` command lines, the most sampler
rows per call that fit there, and its verdict (`does not fit` only when no
candidate fits). Without `--mesh`/`--micro-batch` the config's own mesh is not compiled.

  python -m launch.plan --table [--out docs/plan_table.md] [--figure docs/figures/plan_memory.png]
  python -m launch.plan --render   # the Markdown and the figure again from the CSV, no compile

`--table` runs the search for the paper settings of Qwen2.5-1.5B and -7B on v5e-8, v5p-8
and v6e-8 (`--table-models`, `--table-targets` pick a subset or other presets, such as
qwen3-1.7b and qwen3-8b in the same setting) and writes docs/plan_table.md,
docs/plan_table.csv and the per-device memory figure docs/figures/plan_memory.png; rows of
earlier runs that this run does not recompile stay in the table, so it can be built one row
at a time.

The last line reads `fits: peak X GiB of Y GiB per device on <target> (<program>)` or
`does not fit: ...`; the exit status is 0 iff every program fits, 2 for bad input (one line
`launch.plan: error: ...` naming the flag to change).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Optional, Sequence

from configs import common
from hgpo_jax.cost.hardware import GiB

if TYPE_CHECKING:
  from hgpo_jax.compiled.plan import Plan


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", default="", help="configs/<family>.py[:variant args]")
  ap.add_argument("--topology", default="", help="TPU target compiled by XLA:TPU, e.g. v5e-8, "
                  "v5p-8, v6e-16 or v5e:2x4 (needs the libtpu wheel)")
  ap.add_argument("--devices", type=int, default=8,
                  help="without --topology: fake CPU devices (XLA:CPU approximation)")
  ap.add_argument("--mesh", default="", help="mesh to report, e.g. fsdp=8 or data=2,fsdp=2,tensor=2 "
                  "(default: the config's --config.mesh.*)")
  ap.add_argument("--device-memory", default="", help="memory of one device, e.g. 16GiB, 80GB "
                  "(default: XLA:TPU's usable HBM with --topology, else 16GiB)")
  ap.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free")
  ap.add_argument("--micro-batch", type=int, default=0, help="override config.train.micro_batch_rows")
  ap.add_argument("--rollout-rows", type=int, default=0,
                  help="sampler rows per call (default: this process's groups x group_size)")
  ap.add_argument("--programs", default="", help="comma-separated subset of the programs")
  ap.add_argument("--rollout-programs", choices=("list", "compile"), default="",
                  help="list every sampler program a run can call (each batch and prompt "
                  "bucket, shared and unshared prefill, training and evaluation sampling: "
                  "what --config.rollout.precompile=true compiles) and exit, or compile them "
                  "after the plan")
  ap.add_argument("--no-compile", action="store_true", help="check the config, mesh and "
                  "micro-batch and lower every program (trace and shardings) without compiling; "
                  "prints the persistent bytes per device (exact without a compile)")
  ap.add_argument("--search", action="store_true", help="search meshes, micro-batches and "
                  "sampler rows per call that fit (several compiles)")
  ap.add_argument("--table", action="store_true", help="compile the plan table of the paper "
                  "settings (1.5B and 7B) on each target with --search: --out's Markdown, a CSV "
                  "beside it and the memory figure (--figure)")
  ap.add_argument("--render", action="store_true", help="rewrite --out's Markdown and the "
                  "figure from the CSV beside it (rows of earlier --table runs), no compile")
  ap.add_argument("--out", default="docs/plan_table.md", help="--table: the Markdown file")
  ap.add_argument("--figure", default="docs/figures/plan_memory.png", help="--table: the figure")
  ap.add_argument("--table-targets", default="v5e-8,v5p-8,v6e-8", help="--table: targets")
  ap.add_argument("--table-models", default="qwen2.5-1.5b,qwen2.5-7b",
                  help="--table: models (M+loraR: M with --config.model.lora.rank=R)")
  ap.add_argument("--no-recommend", action="store_true", help="(kept for old command lines: "
                  "the search runs only with --search)")
  args, rest = ap.parse_known_args(argv)
  bad = [r for r in rest if not r.startswith("--config.")]
  if bad:
    ap.error(f"unrecognised arguments: {bad}")
  return args, rest


class PlanError(Exception):
  """Bad input to the plan tool: reported as one line and exit status 2."""


# Where a library message names the trainer's flag, the plan tool's own flag to change.
_FLAG_HINTS = (
    ("--config.mesh", "--mesh data=D,fsdp=F,tensor=T (or --search)"),
    ("micro_batch_rows", "--micro-batch N (or --search)"),
)


def _one_line(error: BaseException) -> str:
  text = " ".join(str(error.args[0] if isinstance(error, KeyError) and error.args else error)
                  .split())
  hints = [flag for key, flag in _FLAG_HINTS if key in text and flag not in text]
  return text + (f"; launch.plan: {hints[0]}" if hints else "")


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  try:
    if args.table:
      return table_main(args)
    if args.render:
      rows = read_table(_csv_path(args.out))
      write_table(rows, args.out, args.figure, args.headroom)
      print(f"wrote {args.out} and {args.figure} from {len(rows)} rows of {_csv_path(args.out)}")
      return 0
    if not args.config:
      raise PlanError("--config is required (e.g. --config=configs/alfworld.py:algo=hgpo), "
                      "or --table")
    return plan_main(args, overrides)
  except (PlanError, ValueError, KeyError) as e:
    # Bad input (a config the mesh or micro-batch cannot hold, a wrong flag value): one
    # line naming the flag to change. ConfigError is a ValueError.
    print(f"launch.plan: error: {_one_line(e)}", file=sys.stderr, flush=True)
    return 2


def _setup(args, topology: str):
  """(target or None, devices, label, device memory) with JAX set up for them; runs before
  JAX initialises its backends."""
  from hgpo_jax.cost import targets
  if topology:
    try:
      target = targets.resolve(topology)
    except ValueError as e:
      raise PlanError(f"--topology: {e}") from None
    reason = targets.compiler_available(target)
    if reason:
      raise PlanError(f"--topology {topology}: {reason}")
    targets.prepare_environment()
  else:
    if args.devices < 1:
      raise PlanError("--devices must be >= 1")
    # The fake device count is fixed when JAX initialises: set it before importing jax.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  from hgpo_jax import runtime
  from hgpo_jax.compiled import plan as plan_lib
  if topology:
    devices = targets.devices(target)
    label = f"{target.name} ({target.topology}, {len(devices)} chips, " \
            f"{targets.process_count(devices)} hosts)"
    memory = (plan_lib.parse_bytes(args.device_memory) if args.device_memory
              else targets.available_hbm(target))
  else:
    # Candidate meshes recompile the same programs: the persistent cache makes repeats
    # cheap. (XLA:TPU executables of a compile-only client cannot be read back from it.)
    runtime.enable_compilation_cache()
    target = None
    devices = jax.devices()[:args.devices]
    assert len(devices) == args.devices, jax.devices()
    label = f"{args.devices} fake CPU devices (XLA:CPU approximation)"
    memory = plan_lib.parse_bytes(args.device_memory or "16GiB")
  return target, devices, label, memory


def _micro_batch(exp, mesh, devices, requested: int) -> int | None:
  """The micro-batch of every learner (actor and critic) on `mesh`: `--micro-batch`,
  checked against the mesh and the mini-batch, or the config's, raised to the mesh's
  data-parallel size when it is not a multiple of it (a smoke config on 8 devices)."""
  from hgpo_jax.models import sharding as sharding_lib
  m = sharding_lib.make_mesh(*mesh, devices=devices)
  dp = m.shape["data"] * m.shape["fsdp"]
  mini = exp.train.update.mini_batch_rows
  where = f"mesh data={m.shape['data']} fsdp={m.shape['fsdp']} tensor={m.shape['tensor']}"
  if requested:
    if requested < 1 or requested % dp or mini % requested:
      raise PlanError(f"--micro-batch {requested} must be a multiple of the data-parallel size "
                      f"{dp} ({where}) that divides the mini-batch of {mini} rows; change "
                      "--micro-batch or --mesh (or --search)")
    return requested
  micro = exp.train.update.micro_batch_rows
  if micro % dp == 0:
    return None
  if mini % dp:
    raise PlanError(f"the mini-batch of {mini} rows cannot be split over the {dp} data-parallel "
                    f"devices of {where}; change --mesh (more fsdp/tensor, or --search) or "
                    "--config.train.mini_batch_rows")
  print(f"note: micro-batch of every learner raised from {micro} to {dp} rows (one per "
        f"data-parallel device of {where})")
  return dp


def plan_main(args, overrides) -> int:
  target, devices, label, memory = _setup(args, args.topology)
  from hgpo_jax.compiled import plan as plan_lib
  from hgpo_jax.training import experiment
  from hgpo_jax.cost import targets

  exp = experiment.from_config(common.load(args.config, overrides))  # errors before compiles
  if exp.mesh.split:
    raise PlanError(f"config.mesh.rollout_devices={exp.mesh.rollout_devices}: the plan "
                    "compiles the shared placement (the sampler on the training mesh); "
                    "plan the learner and the sampler with the split's device counts as "
                    "two shared meshes")
  mesh = (plan_lib.parse_mesh(args.mesh) if args.mesh
          else (exp.mesh.data, exp.mesh.fsdp, exp.mesh.tensor))
  # --mesh is the run's --config.mesh.*: the sampler's per-host mesh derives from it too.
  exp = plan_lib.with_mesh(exp, mesh)
  where = args.topology or label

  def show(plan, t0):
    seconds = None
    if target is not None and target.platform == "tpu":  # a calibration compile: only here
      seconds = plan_lib.estimated_seconds(plan, targets.seconds_per_cycle(target))
    print(format_plan(plan, memory, args.headroom, seconds))
    print(f"(compiled in {time.perf_counter() - t0:.0f} s)", flush=True)

  if args.search and not (args.mesh or args.micro_batch):
    # The search compiles its own candidates; the config's default mesh is not compiled.
    print(f"plan: {args.config} {' '.join(overrides)} on {label}, "
          f"{memory / GiB:.2f} GiB per device; model {exp.model.name}", flush=True)
    return _search(args, overrides, exp, devices, memory, where, show)
  micro = _micro_batch(exp, mesh, devices, args.micro_batch)
  if micro:  # every learner's micro-batch, as the run's --config.train.micro_batch_rows
    exp = exp.override({"train.micro_batch_rows": micro})
  shapes = plan_lib.shapes_from_config(exp, micro, args.rollout_rows or None, devices)
  print(f"plan: {args.config} {' '.join(overrides)} on {label}, {memory / GiB:.2f} GiB "
        f"per device; model {exp.model.name} ({shapes.model.dtype})", flush=True)
  for line in experiment.precision_warnings(exp):
    print(f"warning: {line}", flush=True)
  if args.rollout_programs == "list":  # nothing to compile
    listed = plan_lib.rollout_programs(exp, mesh, rollout_rows=args.rollout_rows or None,
                                       devices=devices)
    print("\n".join(f"  {name}" for name, _ in listed))
    print(f"{len(listed)} sampler programs a run can call (per process)", flush=True)
    return 0
  if args.no_compile:
    return _lower_only(args, exp, mesh, micro, devices, where)
  t0 = time.perf_counter()
  plan = plan_lib.compile_plan(
      exp, mesh, micro_batch_rows=micro, rollout_rows=args.rollout_rows or None,
      phases=[p for p in args.programs.split(",") if p] or None, devices=devices)
  show(plan, t0)
  if args.rollout_programs:
    print(f"sampler programs of a run ({args.rollout_programs}):", flush=True)
    t1 = time.perf_counter()
    listed = plan_lib.rollout_programs(
        exp, mesh, compile_them=args.rollout_programs == "compile",
        rollout_rows=args.rollout_rows or None, devices=devices,
        log=lambda line: print(line, flush=True))
    if listed:
      worst = max(listed, key=lambda e: e[1].transient)
      refused = [name for name, phase in listed if phase.refused]
      print(f"{len(listed)} sampler programs compiled in {time.perf_counter() - t1:.0f} s; "
            f"largest transient {worst[1].transient / GiB:.2f} GiB per device "
            f"({worst[0]}); refused by the compiler: {refused or 'none'}", flush=True)
  if args.search:
    print(verdict_line(plan, memory, args.headroom, where), flush=True)
    return _search(args, overrides, exp, devices, memory, where, show)
  print(verdict_line(plan, memory, args.headroom, where), flush=True)
  return 0 if plan.fits(memory, args.headroom) else 1


def _lower_only(args, exp, mesh, micro, devices, where) -> int:
  """--no-compile: every program of the experiment built and lowered on the mesh, no XLA."""
  from hgpo_jax.models import sharding as sharding_lib
  from hgpo_jax.training import programs as programs_lib
  t0 = time.perf_counter()
  registry = programs_lib.build(exp, sharding_lib.make_mesh(*mesh, devices=devices),
                                micro_batch_rows=micro, rollout_rows=args.rollout_rows or None)
  names = [p for p in args.programs.split(",") if p] or list(registry.programs)
  unknown = sorted(set(names) - set(registry.programs))
  if unknown:
    raise PlanError(f"--programs: unknown programs {unknown}; this config has "
                    f"{sorted(registry.programs)}")
  for name in names:
    registry.programs[name].lower()
  d, f, t = (registry.mesh.shape[a] for a in ("data", "fsdp", "tensor"))
  print(f"lowered without compiling ({time.perf_counter() - t0:.0f} s): {', '.join(names)} on "
        f"mesh data={d} fsdp={f} tensor={t}, micro-batch "
        f"{registry.learner.config.micro_batch_rows}; persistent "
        f"{registry.persistent / GiB:.2f} GiB per device on {where}", flush=True)
  return 0


def _search(args, overrides, exp, devices, memory, where, show) -> int:
  """Searches meshes and micro-batches where every program fits; prints the winner's plan,
  its command lines and its verdict (or why none fits). 0 iff a candidate fits."""
  from hgpo_jax.compiled import plan as plan_lib
  print("searching candidate meshes and micro-batches (every learner's update first, then "
        "the other programs on the mesh that fits):", flush=True)
  t0 = time.perf_counter()
  best, tried = plan_lib.recommend(exp, len(devices), memory, args.headroom,
                                   log=lambda s: print(s, flush=True), devices=devices)
  if best is None:
    hint = "bfloat16 (--config.model.dtype=bfloat16), " if exp.model.dtype == "float32" else ""
    from hgpo_jax.training import programs, train_step
    # a reference copy kept on the devices (none with LoRA: the base with the adapters off)
    update = exp.train.update
    if (update.reference_memory == "device" and not exp.model.lora.rank
        and programs.uses_reference(exp.train)):
      compute = plan_lib.shapes_from_config(exp, devices=devices).model.dtype
      rounded = train_step.resolve_reference_dtype(update.reference_dtype,
                                                   compute) == "bfloat16"
      hint += ("the reference model in host memory (--config.train.reference_memory=host)"
               + ("" if rounded else " or in bfloat16 (--config.train.reference_dtype=bfloat16)")
               + ", ")
    last = tried[-1][2] if tried else "no candidate mesh"
    print(f"recommended: none of the candidate meshes fits; use {hint}more devices (a larger "
          "--topology), or a shorter prompt/response (--config.rollout.max_prompt_tokens, "
          "--config.rollout.max_new_tokens)")
    print(f"does not fit: no candidate mesh and micro-batch fits on {where} (last tried: "
          f"{last})", flush=True)
    return 1
  print(f"recommended: {' '.join(run_flags(best))}", flush=True)
  show(best, t0)
  cfg = plan_lib.plan_config(exp, best)
  print(f"searching sampler rows per generate call on the recommended mesh {best.mesh} "
        f"(sampler mesh {best.sample_mesh}):", flush=True)
  rows = plan_lib.largest_rollout_rows(cfg, best.mesh, memory, args.headroom,
                                       micro_batch_rows=best.shapes.micro_batch_rows,
                                       devices=devices, log=lambda s: print(s, flush=True))
  print(f"sampler: at most {rows} rows per generate call fit (the rollout asks for "
        f"{best.rollout_rows})")
  print(f"run:  {run_command(args.config, overrides, best)}")
  print(f"plan: {plan_command(args.config, overrides, best, args.topology)}")
  print(verdict_line(best, memory, args.headroom, where), flush=True)
  return 0


# ---- the plan table of the paper settings (--table) ---------------------------------------
TABLE_CONFIG = "configs/alfworld.py:algo=hgpo,model={model}"
TABLE_PROGRAMS = ("update", "logprobs", "logprobs_old", "critic_values", "critic_update",
                  "advantages", "generate", "generate_shared")
TABLE_FIELDS = ("model", "target", "chips", "usable_hbm_gib", "mesh", "micro_batch_rows",
                "prefill_chunk_rows", "decode_slots", "share_prefill",
                "peak_gib", "peak_program", "verdict", "est_s_per_iteration", "persistent_gib",
                *(f"peak_gib_{p}" for p in TABLE_PROGRAMS), "search_s", "commit", "why")


# ---------------------------------------------------------------------------------------
# A plan as the command line prints it
# ---------------------------------------------------------------------------------------

def _chunk_flags(plan: Plan) -> list[str]:
  """The prefill chunk, decode slots and unshared first-turn prefill the search chose, as
  flags (none when it chose none)."""
  return ([f"--config.rollout.prefill_chunk_rows={plan.prefill_chunk_rows}"]
          if plan.prefill_chunk_rows else []) + (
      [f"--config.rollout.decode_slots={plan.decode_slots}"] if plan.decode_slots else []) + (
      [] if plan.share_prefill else ["--config.rollout.share_prefill=false"])


def run_flags(plan: Plan) -> list[str]:
  """The trainer's flags of `plan`'s mesh and micro-batch (every learner's), and its
  prefill chunk and decode slots where the search chose them."""
  d, f, t = plan.mesh
  return [f"--config.mesh.data={d}", f"--config.mesh.fsdp={f}", f"--config.mesh.tensor={t}",
          f"--config.train.micro_batch_rows={plan.shapes.micro_batch_rows}",
          *_chunk_flags(plan)]


def _without_run_flags(overrides: Sequence[str], plan: Optional[Plan] = None) -> list[str]:
  chosen = (("--config.rollout.prefill_chunk_rows=",) if plan and plan.prefill_chunk_rows
            else ()) + (("--config.rollout.decode_slots=",) if plan and plan.decode_slots
                        else ()) + (("--config.rollout.share_prefill=",)
                                    if plan and not plan.share_prefill else ())
  return [o for o in overrides
          if not o.startswith(("--config.mesh.", "--config.train.micro_batch_rows=", *chosen))]


def plan_command(config_spec: str, overrides: Sequence[str], plan: Plan, target: str) -> str:
  """The `launch.plan` command line that compiles `plan` again (its mesh and micro-batch)."""
  d, f, t = plan.mesh
  return " ".join(["python -m launch.plan", f"--config={config_spec}",
                   *_without_run_flags(overrides, plan), *_chunk_flags(plan),
                   *([f"--topology {target}"] if target else []),
                   f"--mesh data={d},fsdp={f},tensor={t}",
                   f"--micro-batch {plan.shapes.micro_batch_rows}"])


def run_command(config_spec: str, overrides: Sequence[str], plan: Plan) -> str:
  """The trainer's command line with `plan`'s mesh and micro-batch."""
  return " ".join(["python -m launch.main", f"--config={config_spec}",
                   *_without_run_flags(overrides, plan), *run_flags(plan), "--workdir=DIR"])


def decode_step_lines(plan: Plan, seconds: Optional[dict[str, float]] = None) -> list[str]:
  """Per generate program: one decode step's trip-weighted HLO traffic per device against
  the step's necessary bytes (`decode_traffic`), XLA:TPU's estimated time of the step
  when `seconds` (from `plan_lib.estimated_seconds`) has it, and on GPUs the kernels the step
  launches (`hgpo_jax.cost.hlo.hlo_launches`: a one-row step is bound by them, docs/performance.md)."""
  from hgpo_jax.compiled import plan as plan_lib
  need = plan.decode_necessary
  lines = []
  for p in plan.phases.values():
    if p.step is None or need is None:
      continue
    est = (seconds or {}).get(f"{p.name} decode step")
    kernel_s = plan_lib.kernel_seconds(plan, p)
    lines.append(
        f"decode step of {p.name} ({plan.rollout_rows} rows), per device: HLO reads+writes "
        f"{p.step.traffic / 1e6:.1f} MB (loops weighted by trip count"
        + (f"; the attention kernels' valid blocks {p.step.kernel_bytes / 1e6:.1f} MB"
           if p.step.kernel_bytes else "")
        + f") vs necessary "
        f"{need.total / 1e6:.1f} MB (weights {need.weights / 1e6:.1f} as laid out + valid KV "
        f"{need.kv / 1e6:.1f} at 3/4 of the prompt bucket): {p.step.traffic / need.total:.2f}x"
        + (f"; XLA:TPU estimate {1e3 * est:.2f} ms per step" if est else "")
        + (f" (the kernels' {1e3 * kernel_s:.2f} ms at the datasheet bandwidth included)"
           if est and kernel_s else "")
        + (f"; {p.step.launches:.0f} kernels per step" if plan.platform == "gpu" else ""))
  return lines


def _attention_label(impl: str, seq: int) -> str:
  """The attention a plan's update runs: "auto" on CPU picks by length (`attention`)."""
  if impl != "auto":
    return impl
  from hgpo_jax.models import attention
  from_len = attention.CPU_CHUNKED_MIN_LENGTH
  return f"auto ({'chunked' if seq >= from_len else 'xla'} at {seq} tokens)"


def format_plan(plan: Plan, device_memory: Optional[int] = None, headroom: float = 0.1,
                seconds: Optional[dict[str, float]] = None) -> str:
  """A human-readable table of one plan (GiB per device); `seconds` from
  `plan_lib.estimated_seconds` adds XLA:TPU's estimated time per iteration of each program."""
  g = lambda b: f"{b / GiB:8.2f}"
  s = plan.shapes
  compiler = {"tpu": "XLA:TPU", "gpu": "XLA:GPU"}.get(plan.platform, "XLA:CPU (approximation)")
  lines = [
      f"compiled by {compiler} for {plan.device_kind}; mesh data={plan.mesh[0]} "
      f"fsdp={plan.mesh[1]} tensor={plan.mesh[2]} (sampler data={plan.sample_mesh[0]} "
      f"fsdp={plan.sample_mesh[1]} tensor={plan.sample_mesh[2]}); model "
      f"{s.model.num_layers}L d={s.model.hidden_dim} {s.model.dtype} remat={s.model.remat} "
      f"attention={_attention_label(getattr(s.model, 'attention_impl', 'xla'), s.seq)}; "
      f"update [{s.mini_batch_rows} x {s.seq}] micro-batch {s.micro_batch_rows}; sampler "
      f"{plan.rollout_rows or s.rollout_rows} rows x prompt {s.prompt} + {s.response} new",
      f"per device: params {g(plan.params)} GiB, optimizer {g(plan.opt_state)} GiB, "
      f"reference {g(plan.reference)} GiB"
      + (f" (+{plan.reference_host / GiB:.2f} GiB in host memory)" if plan.reference_host else "")
      + f", critic {g(plan.critic)} GiB (persistent {g(plan.persistent)} GiB)",
      f"{'program':16s} {'calls':>5s} {'GFLOP/call':>12s} {'args':>8s} {'output':>8s} "
      f"{'aliased':>8s} {'temp':>8s} {'peak':>8s}  (GiB per device)"
      + ("  est. s/iteration" if seconds else ""),
  ]
  for p in plan.phases.values():
    if p.refused:
      lines.append(f"{p.name:16s} {p.calls:5d} {'-':>12s} {'-':>8s} {'-':>8s} {'-':>8s} "
                   f"{g(p.temp)} {'-':>8s}  refused by the compiler: asked {p.temp / GiB:.2f} "
                   "GiB of temporaries")
      continue
    lines.append(f"{p.name:16s} {p.calls:5d} {p.flops / 1e9:12.1f} {g(p.argument)} {g(p.output)} "
                 f"{g(p.alias)} {g(p.temp)} {g(plan.persistent + p.transient)}"
                 + (f"  {seconds[p.name]:10.1f}" if seconds else ""))
  if getattr(s.model, "attention_impl", "xla") in ("splash", "cudnn"):
    lines.append(f"(GFLOP/call leaves out the attention inside the {s.model.attention_impl} kernel: "
                 "a custom call whose FLOPs the HLO does not show)")
  if seconds:
    lines.append(f"estimated iteration time (XLA:TPU cost model, not a measurement): "
                 f"{seconds['iteration']:.1f} s of device compute")
  lines += decode_step_lines(plan, seconds)
  if device_memory:
    budget = device_memory * (1.0 - headroom)
    over = [p.name for p in plan.phases.values()
            if p.refused or plan.persistent + p.transient > budget]
    if over:
      lines.append(f"over budget ({budget / GiB:.2f} GiB = {device_memory / GiB:.2f} GiB less "
                   f"{headroom:.0%} headroom): {', '.join(over)}")
  return "\n".join(lines)


def verdict_line(plan: Plan, device_memory: int, headroom: float, target: str) -> str:
  """The plan's last line: `fits: peak X GiB of Y GiB per device on T (program)` or
  `does not fit: ...`."""
  refused = plan.refused()
  if refused:
    asked = max(plan.phases[n].temp for n in refused)
    return (f"does not fit: {', '.join(refused)} refused by the compiler on {target} (asked "
            f"{asked / GiB:.2f} GiB of temporaries; {device_memory / GiB:.2f} GiB per device)")
  name = plan.peak_phase()
  peak = plan.peak()
  head = f"(with {headroom:.0%} headroom)" if headroom else ""
  if plan.fits(device_memory, headroom):
    return (f"fits: peak {peak / GiB:.2f} GiB of {device_memory / GiB:.2f} GiB per device on "
            f"{target} ({name}) {head}".rstrip())
  return (f"does not fit: peak {peak / GiB:.2f} GiB of {device_memory / GiB:.2f} GiB per device on "
          f"{target} ({name}) {head}".rstrip())


def _table_inputs(args) -> tuple[list[str], list[str], list]:
  """(--table-targets' names, --table-models' names, the resolved targets), checked: at
  least one name each, known targets, one platform."""
  names = [t for t in args.table_targets.split(",") if t]
  models = [m for m in args.table_models.split(",") if m]
  if not names or not models:
    raise PlanError("--table-targets and --table-models need at least one name each")
  from hgpo_jax.cost import targets
  resolved = []
  for name in names:
    try:
      t = targets.resolve(name)
    except ValueError as e:
      raise PlanError(f"--table-targets: {e}") from None
    resolved.append(t)
  platforms = sorted({t.platform for t in resolved})
  if len(platforms) > 1:
    raise PlanError(f"--table-targets: {args.table_targets} mixes TPU and GPU targets; one "
                    "table run compiles with one compiler (run the GPU targets separately)")
  return names, models, resolved


def _no_fit_fields(config, devices, tried: list) -> dict:
  """The table fields of a (model, target) on which no candidate fits: the smallest
  persistent state of the tried meshes and why the last one failed."""
  from hgpo_jax.compiled import plan as plan_lib
  persistent = min(plan_lib.persistent_bytes(config, m, devices=devices)
                   for m, _, _ in tried) if tried else 0
  last = (f"last tried {plan_lib.mesh_label(tried[-1][0])}"
          + (f" micro-batch {tried[-1][1]}" if tried[-1][1] else "")
          + f": {tried[-1][2]}") if tried else "no candidate mesh"
  return dict(mesh="-", micro_batch_rows="", peak_gib="", peak_program="",
              verdict="does not fit", est_s_per_iteration="",
              persistent_gib=round(persistent / GiB, 2), why=last)


def _fit_fields(best: Plan, target) -> dict:
  """The table fields of the plan that fits: its mesh, micro-batch, sampler settings, peak,
  estimated time (TPU only) and each program's per-device peak."""
  from hgpo_jax.compiled import plan as plan_lib
  from hgpo_jax.cost import targets
  # XLA:GPU writes no cost-model cycles: a GPU row has no estimated time
  seconds = (plan_lib.estimated_seconds(best, targets.seconds_per_cycle(target))
             if target.platform == "tpu" else {"iteration": None})
  d, f, t = best.mesh
  fields = dict(mesh=f"data={d},fsdp={f},tensor={t}",
                micro_batch_rows=best.shapes.micro_batch_rows,
                prefill_chunk_rows=best.prefill_chunk_rows or "",
                decode_slots=best.decode_slots or "",
                share_prefill="" if best.share_prefill else "false",
                peak_gib=round(best.peak() / GiB, 2),
                peak_program=best.peak_phase(), verdict="fits",
                est_s_per_iteration=("" if seconds["iteration"] is None
                                     else round(seconds["iteration"], 1)),
                persistent_gib=round(best.persistent / GiB, 2))
  for name, phase in best.phases.items():
    fields[f"peak_gib_{name}"] = round((best.persistent + phase.transient) / GiB, 2)
  return fields


def _search_row(args, model: str, spec: str, config, target) -> dict:
  """The table row of `model` (its config `config`, from `spec`) on `target`: `--search`'s
  winner, or why nothing fits."""
  from hgpo_jax.compiled import plan as plan_lib
  from hgpo_jax.cost import targets
  devices = targets.devices(target)
  memory = targets.available_hbm(target)
  print(f"table: {spec} on {target.name} ({memory / GiB:.2f} GiB per chip):",
        flush=True)
  t0 = time.perf_counter()
  best, tried = plan_lib.recommend(config, len(devices), memory, args.headroom,
                                   log=lambda s: print(s, flush=True), devices=devices)
  outputs = (args.out, _csv_path(args.out), args.figure)
  row = {"model": model, "target": target.name, "chips": len(devices),
         "commit": _commit(outputs),
         "usable_hbm_gib": round(memory / GiB, 2),
         "search_s": round(time.perf_counter() - t0)}
  if best is None:
    row.update(_no_fit_fields(config, devices, tried))
  else:
    row.update(_fit_fields(best, target))
  return row


def table_main(args) -> int:
  """--table: `--search` for each (model, target); rewrites the Markdown, the CSV and the
  figure after each row, so an interrupted run keeps the rows it finished."""
  from hgpo_jax.training import experiment
  names, models, resolved = _table_inputs(args)
  _setup(args, names[0])
  # Rows of earlier runs stay unless this run recompiles their (model, target): one row can
  # be (re)compiled at a time with --table-models / --table-targets.
  try:
    rows = read_table(_csv_path(args.out))
  except PlanError:
    rows = []
  for model in models:
    base, lora, rank = model.partition("+lora")  # M+loraR: LoRA adapters of rank R
    if lora and not rank.isdigit():
      raise PlanError(f"--table-models: {model!r}: write M+loraR with R a rank, e.g. "
                      "qwen2.5-7b+lora64")
    spec = TABLE_CONFIG.format(model=base)
    for target in resolved:
      config = common.load(spec)
      if lora:
        config.model.lora.rank = int(rank)
      row = _search_row(args, model, spec, experiment.from_config(config), target)
      print(f"table row: {row}", flush=True)
      rows = [r for r in rows if (r["model"], r["target"]) != (model, target.name)] + [row]
      rows.sort(key=_table_order)
      write_table(rows, args.out, args.figure, args.headroom)
  print(f"wrote {args.out}, {_csv_path(args.out)} and {args.figure}")
  return 0


def _table_order(row: dict) -> tuple:
  """Rows by model size (the billions ending the preset's name: qwen2.5-1.5b, qwen3-1.7b,
  qwen2.5-7b, qwen3-8b), a LoRA row after its base, then target name: the order a reader
  scans the table in."""
  size = re.search(r"(\d+(?:\.\d+)?)b$", row["model"].partition("+lora")[0])
  return (float(size.group(1)) if size else float("inf"), row["model"], row["target"])


def _commit(outputs: tuple[str, ...] = (), repo: str | None = None) -> str:
  """The short HEAD commit of `repo` (default: this file's) with a `+` when its work tree
  has changes other than `outputs` (the files the table run itself rewrites), or "?"."""
  import subprocess
  here = repo or os.path.dirname(os.path.abspath(__file__))
  try:
    git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True, check=True,
                                    cwd=here).stdout
    head = git("rev-parse", "--short", "HEAD").strip()
    top = git("rev-parse", "--show-toplevel").strip()
    changed = [line[3:].strip() for line in
               git("status", "--porcelain", "--untracked-files=no").splitlines() if line.strip()]
  except (OSError, subprocess.CalledProcessError):
    return "?"
  mine = {os.path.realpath(p) for p in outputs}
  dirty = [p for p in changed if os.path.realpath(os.path.join(top, p)) not in mine]
  return head + ("+" if dirty else "")


def _csv_path(md_path: str) -> str:
  return os.path.splitext(md_path)[0] + ".csv"


def read_table(csv_path: str) -> list[dict]:
  """The rows of a plan-table CSV, numbers as numbers."""
  import csv
  try:
    with open(csv_path, encoding="utf-8") as f:
      rows = list(csv.DictReader(f))
  except OSError as e:
    raise PlanError(f"--render: cannot read {csv_path} ({e.strerror}); run --table first") from None
  for row in rows:
    for key, value in row.items():
      if key in ("chips", "micro_batch_rows", "prefill_chunk_rows", "decode_slots",
                 "search_s") and value:
        row[key] = int(value)
      elif (key.endswith("_gib") or key.startswith("peak_gib") or key == "est_s_per_iteration") \
          and value:
        row[key] = float(value)
  return rows


def _model_names(rows: list[dict]) -> str:
  """The base presets of `rows` (in table order): 'qwen2.5-1.5b, qwen3-1.7b and qwen3-8b'."""
  names = list(dict.fromkeys(r["model"].partition("+lora")[0] for r in rows))
  return " and ".join(filter(None, (", ".join(names[:-1]), names[-1]))) if names else "none yet"


def _write_csv(rows: list[dict], md_path: str) -> None:
  """Writes `rows` (TABLE_FIELDS each) to the CSV beside `md_path`, creating its folder."""
  import csv
  os.makedirs(os.path.dirname(md_path) or ".", exist_ok=True)
  with open(_csv_path(md_path), "w", newline="", encoding="utf-8") as f:
    w = csv.DictWriter(f, fieldnames=TABLE_FIELDS, lineterminator="\n")
    w.writeheader()
    for row in rows:
      w.writerow({k: row.get(k, "") for k in TABLE_FIELDS})


def _libtpu_version() -> str:
  """The installed libtpu wheel's version, or "?"."""
  try:
    import libtpu
    return getattr(libtpu, "__version__", "?")
  except ImportError:
    return "?"


def _table_head(rows: list[dict], md_path: str, headroom: float) -> list[str]:
  """The Markdown's lines above the table rows: the title, how each row is made, the
  compiler versions and the CSV's link, and the table's header."""
  import jax
  libtpu_version = _libtpu_version()
  return [
      "# Compiled plans of the paper settings",
      "",
      "Generated by `python -m launch.plan --table` (do not edit by hand): for each model "
      f"({_model_names(rows)}; `{TABLE_CONFIG}`, the ALFWorld paper setting of Qwen2.5-1.5B "
      "and -7B, with any preset in their place: 16 groups x 8 trajectories, prompts "
      "of 4096 + 512 new tokens, mini-batch 256; float32 parameters and optimizer, bfloat16 "
      "compute and reference, the configs' `auto` on TPUs and GPUs) and target, "
      "`launch.plan --search` on "
      "XLA:TPU's compile-only devices, no TPU needed (an h100 target: XLA:GPU's compile-only "
      "topology of the CUDA plugin, no GPU needed; experimental: no autotuning, no cost model, "
      "so no time estimate): the first mesh (least communication "
      "first) on which every program of an iteration fits, with the largest micro-batch that "
      "fits (and, where the sampler's prefill of all rows at once does not, the largest "
      "`rollout.prefill_chunk_rows` that does; '-': all rows at once; where no chunk does, "
      "the most `rollout.decode_slots` that fit: continuous batching of the call's rows "
      "through fewer KV-cache rows; '-': every row in lockstep; where the first turn's "
      "prefill shared by a group does not fit, `rollout.share_prefill=false`: 'unshared'), "
      f"at {headroom:.0%} headroom of XLA:TPU's usable HBM per chip (a GPU's device memory). "
      "Peak = the "
      "persistent state (parameters, AdamW moments, reference) + the largest program's "
      "arguments, outputs and temporaries, per device. Seconds per iteration: XLA:TPU's cost "
      "model (device compute of every program's calls, decode loops at max_new_tokens), not a "
      "measurement. Each row is one `python -m launch.plan "
      "--config=configs/alfworld.py:algo=hgpo,model=M --topology T --search`; a model "
      "`M+loraR` adds `--config.model.lora.rank=R` (LoRA, hgpo_jax/models/lora.py: the "
      "frozen base in the compute dtype, float32 adapters and their AdamW moments only, the "
      "reference the base with the adapters off: no copy).",
      "",
      f"Compiled with jax {jax.__version__}, libtpu {libtpu_version} (GPU rows: "
      f"jax-cuda12-plugin {jax.__version__}), each row at the commit "
      "it names (+: with uncommitted changes); "
      f"CSV: [{os.path.basename(_csv_path(md_path))}]({os.path.basename(_csv_path(md_path))}).",
      "",
      "| model | target | mesh | micro-batch | prefill chunk rows | decode slots | peak GiB "
      "per device (of usable) | verdict | est. s per iteration | commit |",
      "|---|---|---|---|---|---|---|---|---|---|",
  ]


def _table_line(r: dict) -> str:
  """The Markdown table's row of one CSV row."""
  peak = (f"{r['peak_gib']:.2f} of {r['usable_hbm_gib']:.2f} ({r['peak_program']})"
          if r["verdict"] == "fits" else
          f"persistent alone {r['persistent_gib']:.2f} of {r['usable_hbm_gib']:.2f}"
          + (f"; {r['why']}" if r.get("why") else ""))
  flags = f"`{r['mesh']}`" if r["verdict"] == "fits" else "none fits"
  chips = f"{r['chips']} chip" + ("s" if r["chips"] != 1 else "")
  return (f"| {r['model']} | {r['target']} ({chips}) | {flags} | "
          f"{r['micro_batch_rows'] or '-'} | {r.get('prefill_chunk_rows') or '-'}"
          f"{', unshared' if r.get('share_prefill') == 'false' else ''} | "
          f"{r.get('decode_slots') or '-'} | "
          f"{peak} | {r['verdict']} | "
          f"{r['est_s_per_iteration'] if r['est_s_per_iteration'] != '' else '-'} | "
          f"{r.get('commit') or '?'} |")


def _table_tail(rows: list[dict], md_path: str, figure_path: str) -> list[str]:
  """The Markdown's lines below the table: the paper settings not compiled yet, and the
  figure with its caption."""
  lines = []
  have = {(r["model"], r["target"]) for r in rows}
  missing = [f"{m} on {t}" for m in ("qwen2.5-1.5b", "qwen2.5-7b")
             for t in ("v5e-8", "v5p-8", "v6e-8") if (m, t) not in have]
  if missing:
    lines += ["", f"Not compiled yet (`python -m launch.plan --table` adds them): "
              f"{', '.join(missing)}."]
  rel = os.path.relpath(figure_path, os.path.dirname(md_path) or ".")
  lines += ["", f"![Per-device memory by program]({rel})", "",
            "Per-device peak of each program (persistent state + the program's own bytes) for "
            "the rows that fit, and the persistent state alone (for a row that does not fit: "
            "on its most sharded candidate mesh); the dashed line is the budget (usable HBM less the headroom). "
            "Regenerated with the table by `python -m launch.plan --table`.", ""]
  return lines


def write_table(rows: list[dict], md_path: str, figure_path: str, headroom: float) -> None:
  """The Markdown table, the CSV beside it and the memory figure of `rows`, in table order
  (`_table_order`: --render of a CSV with appended rows sorts them too)."""
  rows = [{k: row.get(k, "") for k in TABLE_FIELDS} for row in sorted(rows, key=_table_order)]
  _write_csv(rows, md_path)
  lines = _table_head(rows, md_path, headroom)
  lines += [_table_line(r) for r in rows]
  lines += _table_tail(rows, md_path, figure_path)
  with open(md_path, "w", encoding="utf-8") as f:
    f.write("\n".join(lines))
  plot_memory(rows, figure_path, headroom)


def plot_memory(rows: list[dict], path: str, headroom: float) -> None:
  """One panel per target: per-device peak GiB of each program, one bar per model."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  targets_ = list(dict.fromkeys(r["target"] for r in rows))
  models = list(dict.fromkeys(r["model"] for r in rows))
  # "persistent": the state alone (parameters, moments, reference), the one bar of a row
  # that does not fit (its programs are not compiled on a mesh that fits).
  programs = ["persistent"] + [p for p in TABLE_PROGRAMS
                               if any(r.get(f"peak_gib_{p}") not in (None, "") for r in rows)]
  fig, axes = plt.subplots(1, len(targets_), figsize=(4.2 * len(targets_), 3.6), squeeze=False)
  width = 0.8 / max(len(models), 1)
  for ax, target in zip(axes[0], targets_):
    for i, model in enumerate(models):
      row = next((r for r in rows if r["target"] == target and r["model"] == model), None)
      if row is None:
        continue
      values = [float(row.get("persistent_gib" if p == "persistent" else f"peak_gib_{p}") or 0)
                for p in programs]
      xs = [j + (i - (len(models) - 1) / 2) * width for j in range(len(programs))]
      label = model + ("" if row["verdict"] == "fits" else " (does not fit)")
      ax.bar(xs, values, width, label=label)
      budget = float(row["usable_hbm_gib"]) * (1 - headroom)
    ax.axhline(budget, color="k", ls="--", lw=1)
    ax.set_title(f"{target}: budget {budget:.1f} GiB")
    ax.set_xticks(range(len(programs)))
    ax.set_xticklabels(programs, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("peak GiB per device")
    ax.legend(fontsize=7)
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


if __name__ == "__main__":
  sys.exit(main())
