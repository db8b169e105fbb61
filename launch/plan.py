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
* `--topology h100-8` (experimental): 8 x H100 SXM compiled by XLA:GPU without a GPU, through
  the CUDA plugin's compile-only topology (needs `jax-cuda12-plugin[with-cuda]==0.10.2`,
  not installed by default; no autotuning, so temporaries can differ from a real compile).
* `--devices N` without a topology: N fake CPU devices compiled by XLA:CPU, a labelled
  approximation of an accelerator's temporaries (persistent bytes are exact).

Prints per device each program's argument / output / aliased / temporary / peak bytes and
FLOPs per call; `--rollout-programs list|compile` lists (or compiles) every sampler
program a run can call, each batch and prompt bucket (`rollout.precompile` compiles them); `--search` then tries candidate meshes and micro-batches for the train
step and the largest sampler rows per call, with the same compiles. The last line reads
`fits: peak X GiB of Y GiB per device on <target> (<program>)` or `does not fit: ...`;
the exit status is 0 iff every program fits.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import sys
import time


def load_config(spec: str, overrides: list[str]):
  """`path.py[:arg]` and `--config.a.b=value` overrides -> a locked ConfigDict."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise SystemExit(f"--config: no config file {path!r} (e.g. configs/alfworld.py:algo=hgpo).")
  module_spec = importlib.util.spec_from_file_location("plan_config", path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  config = module.get_config(arg or None)
  flat = {}
  for item in overrides:
    key, eq, value = item[len("--config."):].partition("=")
    if not eq:
      raise SystemExit(f"override {item!r} needs a value: --config.{key}=VALUE")
    try:
      flat[key] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      flat[key] = value
  try:
    config.update_from_flattened_dict(flat)
  except (KeyError, TypeError, AttributeError) as e:
    raise SystemExit(f"bad --config override: {e}") from None
  return config


def parse_args(argv):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", required=True, help="configs/<family>.py[:variant args]")
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
  ap.add_argument("--search", action="store_true", help="search meshes, micro-batches and "
                  "sampler rows per call that fit (several compiles)")
  ap.add_argument("--no-recommend", action="store_true", help="(kept for old command lines: "
                  "the search runs only with --search)")
  args, rest = ap.parse_known_args(argv)
  bad = [r for r in rest if not r.startswith("--config.")]
  if bad:
    ap.error(f"unrecognised arguments: {bad}")
  return args, rest


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  if args.devices < 1:
    raise SystemExit("--devices must be >= 1")
  from hgpo_jax.training import targets
  if args.topology:
    try:
      target = targets.resolve(args.topology)
    except ValueError as e:
      raise SystemExit(f"--topology: {e}") from None
    reason = targets.compiler_available(target)
    if reason:
      raise SystemExit(f"--topology {args.topology}: {reason}")
    targets.prepare_environment()
  else:
    # The fake device count is fixed when JAX initialises: set it before importing jax.
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                     if "xla_force_host_platform_device_count" not in f)
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  from hgpo_jax import runtime
  from hgpo_jax.training import plan as plan_lib
  from hgpo_jax.training import run_config

  if not args.topology:
    # Candidate meshes recompile the same programs: the persistent cache makes repeats
    # cheap. (XLA:TPU executables of a compile-only client cannot be read back from it.)
    runtime.enable_compilation_cache()

  config = load_config(args.config, overrides)
  if args.topology:
    devices = targets.devices(target)
    label = f"{target.name} ({target.topology}, {len(devices)} chips, " \
            f"{targets.process_count(devices)} hosts)"
    memory = (plan_lib.parse_bytes(args.device_memory) if args.device_memory
              else targets.available_hbm(target))
  else:
    target = None
    devices = jax.devices()[:args.devices]
    assert len(devices) == args.devices, jax.devices()
    label = f"{args.devices} fake CPU devices (XLA:CPU approximation)"
    memory = plan_lib.parse_bytes(args.device_memory or "16GiB")
  mesh = plan_lib.parse_mesh(args.mesh) if args.mesh else (
      config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  # --mesh is the run's --config.mesh.*: the sampler's per-host mesh derives from it too.
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = mesh
  micro = args.micro_batch or None
  if micro is None:
    # One row per device at least: a config written for fewer devices (smoke) gets its
    # micro-batch raised to the data-parallel size of the target mesh.
    from hgpo_jax.models import sharding as sharding_lib
    m = sharding_lib.make_mesh(*mesh, devices=devices)
    dp = m.shape["data"] * m.shape["fsdp"]
    if config.train.micro_batch_rows % dp:
      micro = dp
      print(f"note: micro-batch raised from {config.train.micro_batch_rows} to {dp} rows (one per "
            f"data-parallel device of mesh data={m.shape['data']} fsdp={m.shape['fsdp']})")
  shapes = plan_lib.shapes_from_config(config, micro, args.rollout_rows or None)
  print(f"plan: {args.config} {' '.join(overrides)} on {label}, {memory / plan_lib.GiB:.2f} GiB "
        f"per device; model {config.model.name} ({shapes.model.dtype})", flush=True)
  for line in run_config.precision_warnings(config):
    print(f"warning: {line}", flush=True)
  if args.rollout_programs == "list":  # nothing to compile
    listed = plan_lib.rollout_programs(config, mesh, rollout_rows=args.rollout_rows or None,
                                       devices=devices)
    print("\n".join(f"  {name}" for name, _ in listed))
    print(f"{len(listed)} sampler programs a run can call (per process)", flush=True)
    return 0
  t0 = time.perf_counter()
  plan = plan_lib.compile_plan(
      config, mesh, micro_batch_rows=micro, rollout_rows=args.rollout_rows or None,
      phases=[p for p in args.programs.split(",") if p] or None, devices=devices)
  seconds = None
  if target is not None and target.platform == "tpu":
    seconds = plan_lib.estimated_seconds(plan, targets.seconds_per_cycle(target))
  print(plan_lib.format_plan(plan, memory, args.headroom, seconds))
  print(f"(compiled in {time.perf_counter() - t0:.0f} s)", flush=True)
  if args.rollout_programs:
    print(f"sampler programs of a run ({args.rollout_programs}):", flush=True)
    t1 = time.perf_counter()
    listed = plan_lib.rollout_programs(
        config, mesh, compile_them=args.rollout_programs == "compile",
        rollout_rows=args.rollout_rows or None, devices=devices,
        log=lambda line: print(line, flush=True))
    if listed:
      worst = max(listed, key=lambda e: e[1].transient)
      refused = [name for name, phase in listed if phase.refused]
      print(f"{len(listed)} sampler programs compiled in {time.perf_counter() - t1:.0f} s; "
            f"largest transient {worst[1].transient / plan_lib.GiB:.2f} GiB per device "
            f"({worst[0]}); refused by the compiler: {refused or 'none'}", flush=True)
  if args.search:
    print("searching candidate meshes for the train step (update + log-probs):", flush=True)
    best, _ = plan_lib.recommend(config, len(devices), memory, args.headroom,
                                 log=lambda s: print(s, flush=True), devices=devices)
    if best is None:
      hint = "bfloat16 (--config.model.dtype=bfloat16), " if config.model.dtype == "float32" else ""
      print(f"recommended: none of the candidate meshes fits; use {hint}more devices, or a "
            "shorter prompt/response (--config.rollout.max_prompt_tokens).")
    else:
      d, f, t = best.mesh
      print(f"recommended: --config.mesh.data={d} --config.mesh.fsdp={f} --config.mesh.tensor={t} "
            f"--config.train.micro_batch_rows={best.shapes.micro_batch_rows} "
            f"(train-step peak {best.peak() / plan_lib.GiB:.2f} GiB per device)")
    print("searching sampler rows per generate call on the given mesh:", flush=True)
    rows = plan_lib.largest_rollout_rows(config, mesh, memory, args.headroom,
                                         micro_batch_rows=micro, devices=devices,
                                         log=lambda s: print(s, flush=True))
    print(f"sampler: at most {rows} rows per generate call fit on mesh {mesh} "
          f"(the rollout asks for {plan.rollout_rows})")
  print(plan_lib.verdict_line(plan, memory, args.headroom, args.topology or label), flush=True)
  return 0 if plan.fits(memory, args.headroom) else 1


if __name__ == "__main__":
  sys.exit(main())
