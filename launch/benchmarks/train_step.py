"""Benchmark: PPO actor-update throughput, 1 device vs 8 fake CPU devices.

  python -m launch.benchmarks.train_step                          # tiny + smollm2-135m
  python -m launch.benchmarks.train_step --models=tiny --steps=5

Each (model, device count) runs in its own subprocess, because the fake device count
(`--xla_force_host_platform_device_count`) is fixed when JAX starts. A run builds the
Learner, fills old log-probs once, compiles the update, then times `--steps` updates on
the same mini-batch (one optimizer step each, `block_until_ready`) and reports the median.
tokens/s counts every position of the [B, L] batch (prompt + response), per update.
Each run also prints the update's FLOPs per call (from the compiled executable,
`hgpo_jax.cost.hlo`), the achieved FLOP/s and the MFU against this CPU's detected peak.
Fake devices share the same CPU cores, so the 8-device number measures partitioning
overhead, not a speed-up. The last line prints the ratio 8 devices / 1 device.

  python -m launch.benchmarks.train_step --accelerator [--accel-model qwen2.5-1.5b]
      [--rows 8] [--seq 2048] [--steps 5]

On one accelerator (a GPU or TPU chip: the process's first device; refused on a CPU): the
same update for a randomly initialised preset (float32 parameters and Adam state,
bfloat16 activations and matmul inputs, remat on; no weights needed), once with the
attention `auto` picks for that platform and once with the `xla` reference, side by side
in one process, each with its tokens/s, FLOPs per call, achieved FLOP/s and MFU against
the chip's published bf16 peak (`hgpo_jax.cost.hardware.ACCELERATORS`). The last line is the ratio
of train tokens/s, auto / xla.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# (rows B, sequence length L, micro-batch rows, 8-device mesh (data, fsdp, tensor), dtype)
SETTINGS = {
    "tiny": dict(rows=8, seq=256, micro=8, mesh8=(8, 1, 1), dtype="float32"),
    # B=2, T=128, bf16: a full fine-tune step of SmolLM2-135M in f32 at B=8 needed ~9 GB
    # RSS; this keeps the run under ~3 GB. 9 heads do not split
    # over tensor=4, so attention is replicated there and the MLP / vocab are split.
    "smollm2-135m": dict(rows=2, seq=128, micro=2, mesh8=(2, 1, 4), dtype="bfloat16"),
}


def run_one(model_name: str, devices: int, steps: int) -> dict:
  """Child process body: times the update; returns a JSON-able result."""
  import jax

  from hgpo_jax import runtime
  from hgpo_jax.models import loading, sharding

  runtime.enable_compilation_cache()
  s = SETTINGS[model_name]
  assert jax.device_count() == devices, jax.devices()
  shape = (1, 1, 1) if devices == 1 else s["mesh8"]
  mesh = sharding.make_mesh(*shape)
  model, _, cfg = loading.load_model(model_name, dtype=s["dtype"])
  return time_update(model, cfg, mesh, model_name, s, devices, steps)


def time_update(model, cfg, mesh, model_name: str, s: dict, devices: int, steps: int) -> dict:
  """Builds the Learner of `model` on `mesh`, compiles and times `steps` updates of one
  random mini-batch of s["rows"] x s["seq"] tokens; returns a JSON-able result."""
  import jax
  import numpy as np
  from flax import nnx

  from hgpo_jax.training import train_batch, train_step

  config = train_step.UpdateConfig(lr=1e-6, mini_batch_rows=s["rows"], micro_batch_rows=s["micro"])
  learner = train_step.Learner(model, mesh, config)
  state = learner.init_state(nnx.state(model, nnx.Param))
  del model
  rng = np.random.default_rng(0)
  half = s["seq"] // 2
  prompts = [rng.integers(3, cfg.vocab_size, half).tolist() for _ in range(s["rows"])]
  responses = [rng.integers(3, cfg.vocab_size, half).tolist() for _ in range(s["rows"])]
  host, _ = train_batch.build_train_batch(prompts, responses, rng.normal(size=s["rows"]).astype(np.float32),
                                          prompt_buckets=[half], response_buckets=[half], row_multiple=s["rows"])
  host = train_step.fill_rows(learner, state.params, None, host)
  host = host.replace(ref_logprobs=host.old_logprobs)
  batch = learner.put_batch(host)
  t0 = time.perf_counter()
  state, m = learner.update(state, batch)
  jax.block_until_ready(state)
  compile_s = time.perf_counter() - t0
  times = []
  for _ in range(steps):
    t0 = time.perf_counter()
    state, m = learner.update(state, batch)
    jax.block_until_ready(state)
    times.append(time.perf_counter() - t0)
  med = statistics.median(times)
  from hgpo_jax.cost import hardware
  from hgpo_jax.compiled import trainer_metrics
  from launch.benchmarks import harness
  # Per-device FLOPs x devices: the fake devices share one CPU, whose peak is the reference.
  flops = trainer_metrics.LearnerFlops(learner).per_call(host)["update"] * devices
  peak = hardware.device_peak(dtype=s["dtype"])
  perf_line = harness.flops_line(f"{model_name} devices={devices} update", flops, med, peak)
  return dict(perf_line=perf_line, model=model_name, devices=devices,
              mesh=[int(n) for n in mesh.devices.shape], rows=s["rows"], seq=s["seq"],
              dtype=s["dtype"], first_call_s=round(compile_s, 3), step_s_median=round(med, 6),
              step_s_all=[round(t, 6) for t in times], tokens_per_s=round(s["rows"] * s["seq"] / med, 1),
              loss=float(m["loss"]))


def run_accelerator(model_name: str, rows: int, seq: int, steps: int) -> None:
  """--accelerator: the update on the first device, `auto` attention against `xla`."""
  import jax

  from hgpo_jax.models import attention, config as model_config, cudnn_check, loading, sharding

  device = jax.devices()[0]
  if device.platform == "cpu":
    raise SystemExit("--accelerator needs a GPU or TPU (this process's first device is a CPU); "
                     "without it the benchmark compares 1 and 8 fake CPU devices.")
  cudnn_check.check_if_gpu()  # on a GPU: cuDNN attention == the reference, before timing it
  mesh = sharding.make_mesh(1, 1, 1, devices=[device])
  auto = attention.resolve_impl("auto", [device], "bfloat16", length=seq)
  print(f"jax {jax.__version__} on {device.device_kind}; {model_name} (random init, f32 "
        f"parameters, bf16 activations, remat), B={rows} L={seq}, median of {steps} updates",
        flush=True)
  setting = dict(rows=rows, seq=seq, micro=rows, dtype="bfloat16")
  results = {}
  for impl in (auto, "xla"):
    cfg = model_config.get_preset(model_name).replace(dtype="bfloat16", remat=True,
                                                      attention_impl=impl)
    model = loading.init_model(cfg, seed=0, mesh=mesh)
    r = time_update(model, cfg, mesh, f"{model_name} attention={impl}", setting, 1, steps)
    del model
    results[impl] = r
    print(f"attention={impl:6s}: {r['tokens_per_s']:.1f} tokens/s (median step "
          f"{r['step_s_median']} s of {r['step_s_all']}, first call {r['first_call_s']} s, "
          f"loss {r['loss']:.4f})", flush=True)
    print(r["perf_line"], flush=True)
  ratio = results[auto]["tokens_per_s"] / results["xla"]["tokens_per_s"]
  print(f"{model_name}: train tokens/s, attention {auto} / xla: {ratio:.2f}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--models", default="tiny,smollm2-135m", help="comma-separated: " + ",".join(SETTINGS))
  ap.add_argument("--steps", type=int, default=3, help="timed updates per run (median reported)")
  ap.add_argument("--child", nargs=2, metavar=("MODEL", "DEVICES"), help=argparse.SUPPRESS)
  ap.add_argument("--accelerator", action="store_true",
                  help="on one GPU/TPU: a random-init preset, auto vs xla attention")
  ap.add_argument("--accel-model", default="qwen2.5-1.5b", help="preset for --accelerator")
  ap.add_argument("--rows", type=int, default=8, help="--accelerator: rows per update")
  ap.add_argument("--seq", type=int, default=2048, help="--accelerator: tokens per row")
  args = ap.parse_args(argv)
  if args.accelerator:
    run_accelerator(args.accel_model, args.rows, args.seq, args.steps)
    return
  if args.child:
    print("RESULT " + json.dumps(run_one(args.child[0], int(args.child[1]), args.steps)), flush=True)
    return
  models = [m for m in args.models.split(",") if m]
  for m in models:
    if m not in SETTINGS:
      raise SystemExit(f"unknown model {m!r}; use one of {list(SETTINGS)}.")
  results = {}
  for m in models:
    for n in (1, 8):
      env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
      proc = subprocess.run([sys.executable, "-m", "launch.benchmarks.train_step", "--child", m, str(n),
                             f"--steps={args.steps}"], env=env, capture_output=True, text=True)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not lines:
        raise SystemExit(f"benchmark child {m} x{n} failed:\n{proc.stderr[-3000:]}")
      r = json.loads(lines[-1][len("RESULT "):])
      results[(m, n)] = r
      print(f"{m:14s} devices={n} mesh={r['mesh']} B={r['rows']} L={r['seq']} {r['dtype']}: "
            f"{r['tokens_per_s']:.1f} tokens/s (median step {r['step_s_median']} s of {r['step_s_all']}, "
            f"first call {r['first_call_s']} s)", flush=True)
      print(r["perf_line"], flush=True)
  for m in models:
    ratio = results[(m, 8)]["tokens_per_s"] / results[(m, 1)]["tokens_per_s"]
    print(f"{m}: train tokens/s, 8 fake devices / 1 device: {ratio:.2f}")


if __name__ == "__main__":
  main()
