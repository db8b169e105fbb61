r"""Compiled plan for a pod: per-device memory, FLOPs and a recommended mesh, no weights.

  python -m launch.plan --config=configs/alfworld.py:algo=hgpo,model=qwen2.5-7b \
      --devices 8 --mesh fsdp=8 --device-memory 16GiB [--config.model.dtype=bfloat16 ...]

Fakes `--devices` CPU devices, builds the config's abstract parameters, optimizer state
and batches (no weights are read), compiles the sharded update, log-prob pass, sampler
prefill and one decode step, and prints per device: parameter, optimizer-state and
reference bytes, each program's argument / output / aliased / temporary bytes
(`memory_analysis()`), FLOPs per call, and whether the peak fits `--device-memory` with
`--headroom` kept free. Then it tries candidate meshes (pure data parallel first, then
more FSDP, then tensor parallelism) and micro-batches for the train step and prints the
first that fits, as `--config.*` overrides. Compiling on CPU approximates an
accelerator's temporary bytes (XLA:CPU fuses and assigns buffers differently); the
persistent bytes are exact. See hgpo_jax/training/plan.py.
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
  ap.add_argument("--devices", type=int, default=8, help="devices of the pod (fake CPU devices)")
  ap.add_argument("--mesh", default="", help="mesh to report, e.g. fsdp=8 or data=2,fsdp=2,tensor=2 "
                  "(default: the config's --config.mesh.*)")
  ap.add_argument("--device-memory", default="16GiB", help="memory of one device, e.g. 16GiB, 80GB")
  ap.add_argument("--headroom", type=float, default=0.1, help="fraction of device memory kept free")
  ap.add_argument("--micro-batch", type=int, default=0, help="override config.train.micro_batch_rows")
  ap.add_argument("--rollout-rows", type=int, default=0,
                  help="sampler rows per call (default rollout.num_groups x group_size)")
  ap.add_argument("--no-recommend", action="store_true", help="only the given mesh, no search")
  args, rest = ap.parse_known_args(argv)
  bad = [r for r in rest if not r.startswith("--config.")]
  if bad:
    ap.error(f"unrecognised arguments: {bad}")
  return args, rest


def main(argv=None) -> int:
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  if args.devices < 1:
    raise SystemExit("--devices must be >= 1")
  # The fake device count is fixed when JAX initialises: set it before importing jax.
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if "xla_force_host_platform_device_count" not in f)
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}".strip()
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax
  from hgpo_jax import runtime
  from hgpo_jax.training import plan as plan_lib

  # Candidate meshes recompile the same programs: the persistent cache makes repeats cheap.
  runtime.enable_compilation_cache()

  config = load_config(args.config, overrides)
  memory = plan_lib.parse_bytes(args.device_memory)
  assert jax.device_count() == args.devices, jax.devices()
  if args.mesh:
    mesh = plan_lib.parse_mesh(args.mesh)
  else:
    mesh = (config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  shapes = plan_lib.shapes_from_config(config, args.micro_batch or None, args.rollout_rows or None)
  print(f"plan: {args.config} {' '.join(overrides)} on {args.devices} devices of "
        f"{memory / plan_lib.GiB:.2f} GiB; model {config.model.name} ({shapes.model.dtype})", flush=True)
  t0 = time.perf_counter()
  plan = plan_lib.compile_plan(config, mesh, micro_batch_rows=args.micro_batch or None,
                               rollout_rows=args.rollout_rows or None)
  print(plan_lib.format_plan(plan, memory, args.headroom))
  print(plan_lib.sampler_rows_line(plan, memory, args.headroom))
  print(f"(compiled in {time.perf_counter() - t0:.0f} s)", flush=True)
  if args.no_recommend:
    return 0
  print("searching candidate meshes for the train step (update + log-probs):", flush=True)
  best, _ = plan_lib.recommend(config, args.devices, memory, args.headroom,
                               log=lambda s: print(s, flush=True))
  if best is None:
    hint = "bfloat16 (--config.model.dtype=bfloat16), " if config.model.dtype == "float32" else ""
    print(f"recommended: none of the candidate meshes fits; use {hint}more devices, or a "
          "shorter prompt/response (--config.rollout.max_prompt_tokens).")
    return 1
  d, f, t = best.mesh
  print(f"recommended: --config.mesh.data={d} --config.mesh.fsdp={f} --config.mesh.tensor={t} "
        f"--config.train.micro_batch_rows={best.shapes.micro_batch_rows} "
        f"(train-step peak {best.peak() / plan_lib.GiB:.2f} GiB per device)")
  print(plan_lib.format_plan(best, memory, args.headroom))
  return 0


if __name__ == "__main__":
  sys.exit(main())
