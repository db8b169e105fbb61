"""Benchmark: the SmolLM2 job with LoRA adapters against full fine-tuning, side by side.

  python -m launch.benchmarks.lora [--rank 16] [--iterations 3] [--reps 1] [--sides full,lora]
  python -m launch.benchmarks.lora --flops [--rank 16]     # the analytic FLOPs only, no run
  python -m launch.benchmarks.lora --update [--reps 3] [--rank 16] [--rows 4] [--prompt 400] [--response 32]

Every form takes `--top-layers N`: the LoRA sides adapt the last N of SmolLM2's 30 layers
only (`model.lora.top_layers`, PEFT's `layers_to_transform`; the update's backward stops at
them); 0, the default, adapts every layer.

Both sides are the real trainer, `python -m launch.main` with
`--config=configs/alfworld.py:algo=hgpo,k=2,model=smollm2-135m,local` (the SmolLM2 job
of the `local` variant: an ALFWorld server subprocess, 2 groups x 4 trajectories x 2 steps, one
optimizer step on 16 rows of up to 640 + 32 tokens) for `--iterations` iterations in a
fresh workdir:

  full  full fine-tuning (the job as it is): AdamW over every weight, a frozen copy of
        the initial weights as the KL reference;
  lora  `--config.model.lora.rank=RANK` (alpha 16, all seven projections): gradients and
        AdamW moments of the adapters only, the reference the base with the adapters off
        (no copy; hgpo_jax/models/lora.py).

Sides alternate repetition by repetition. Each reports the median `time/update_s` (the
update phase: the optimizer step on the iteration's rows) and `time/logprobs_s` over its
iterations 2.. (iteration 1 compiles), the median iteration time, and the trainer process's
peak resident memory (`ru_maxrss` of the `launch.main` child from `os.wait4`: the whole
run, its compilations included; the env server is a process of its own). The last line
prints the ratios full / lora of the update time and of the peak memory.

`--flops` prints, without running anything, the analytic update FLOPs of both sides
(`hgpo_jax.cost.analytic`, equal to XLA's compiled count: tests/cost/test_analytic.py and
test_flops.py) at the job's longest and a middle micro-batch length, with remat (the job's
setting) and without: the bound on what a compute-bound update can gain from LoRA. A LoRA
update still takes the input gradients of every frozen matmul, and the attention products
(QK^T and PV: no weights) cost the same on both sides, so it saves one of the three
forward-sized terms of the weight matmuls only, and remat's extra forward stays.

`--update` times the compiled update program alone, in one process, on one mini-batch of
the llm suite's update shape (SmolLM2-135M-Instruct's real weights, float32, `--rows` rows
of `--prompt` prompt + `--response` response tokens in one micro-batch, one optimizer step,
query chunks of 256 as the suite runs it; launch/experiments/suites.py, `LLM`; 4 rows by
default, half the suite's micro-batch, so that the four learners fit in 24 GiB). Four
sides, alternating call by call after one compile call each, `--reps` timed calls each:

  full+remat  full fine-tuning with remat: the SmolLM2 job's setting (configs/common.py
              model.remat=True), the memory full fine-tuning needs at the mini suite's size;
  full        full fine-tuning without remat (like for like with `lora`);
  lora+remat  LoRA with remat (like for like with `full+remat`);
  lora        LoRA rank `--rank` (alpha 2 x rank) without remat: the llm suite's setting.

Each prints its median seconds, tokens/s and the compiled program's FLOPs (XLA's count,
`hgpo_jax.compiled.trainer_metrics`). The last line gives full+remat / lora (fine-tuning as the
SmolLM2 job runs it against LoRA as the llm suite runs it) beside the two like-for-like
ratios, full / lora and full+remat / lora+remat.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from hgpo_jax.training import run_records

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "configs/alfworld.py:algo=hgpo,k=2,model=smollm2-135m,local"  # the SmolLM2 job


def _run(workdir: str, iterations: int, overrides: list[str]) -> tuple[list[dict], float]:
  """(metrics.jsonl lines, peak RSS in GiB) of one trainer run; the workdir is deleted."""
  env = dict(os.environ, PYTHONHASHSEED="0")
  cmd = [sys.executable, "-m", "launch.main", f"--config={CONFIG}", f"--workdir={workdir}",
         f"--config.train.num_iterations={iterations}", "--config.eval.at_end=false", *overrides]
  log = os.path.join(os.path.dirname(workdir), os.path.basename(workdir) + ".log")
  with open(log, "w") as out:
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    _, status, usage = os.wait4(proc.pid, 0)
  if os.waitstatus_to_exitcode(status):
    with open(log) as f:
      sys.exit(f"lora: {' '.join(cmd)} failed:\n{f.read()[-3000:]}")
  lines = run_records.read_metrics(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  return lines, usage.ru_maxrss / 2**20  # KiB -> GiB


ROWS, SCORED, LONGEST = 16, 32, 640 + 32  # the job's update: rows, response bucket, prompt + it
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def _where(top_layers: int) -> str:
  return f"the last {top_layers} layers" if top_layers else "every layer"


def flops_table(rank: int, top_layers: int = 0) -> list[str]:
  """The analytic update FLOPs of the job's model, full vs LoRA `rank` (on the last
  `top_layers` layers; 0: all), per micro-batch length and remat setting, with their ratio."""
  from hgpo_jax.cost import analytic
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import lora as lora_lib
  full = model_config.get_preset("smollm2-135m")
  adapted = full.replace(lora=lora_lib.from_settings(rank, 16.0, TARGETS, False, top_layers))
  lines = [f"analytic update GFLOP of {ROWS} rows, {SCORED} scored tokens each (smollm2-135m, "
           f"LoRA rank {rank} on all seven projections of {_where(top_layers)})"]
  for seq in (LONGEST // 2, LONGEST):
    for remat in (True, False):
      f, l = (analytic.analytic_update_flops(c, rows=ROWS, seq=seq, scored=SCORED, remat=remat)
              for c in (full, adapted))
      lines.append(f"  seq {seq:4d} remat {str(remat):5s}: full {f / 1e9:9.1f}  lora "
                   f"{l / 1e9:9.1f}  full / lora {f / l:.3f}")
  return lines


UPDATE_SIDES = {"full+remat": (0, True), "full": (0, False), "lora+remat": (1, True),
                "lora": (1, False)}  # name -> (adapters?, remat)


def update_sides(rank: int, rows: int, prompt: int, response: int, top_layers: int = 0, *,
                 sides: dict | None = None, compute: str = "float32",
                 micro_rows: int | None = None, scored_tail: int | None = None) -> dict:
  """{side: (call, compiled FLOPs)} for `sides` ({name: (adapters?, remat) or (adapters?,
  remat, model.adapted_layers)}, default UPDATE_SIDES): each call runs one update of the
  side's learner on one random mini-batch (the same token ids on every side) and returns
  its new state, which the next call updates (the update donates its state). `compute`:
  the products' dtype (with adapters the frozen base is stored in it, as the trainer
  stores it); `micro_rows`: rows per micro-batch (default all); `scored_tail`: score the
  last this many columns only, as the trainer does (default every column)."""
  import numpy as np
  from flax import nnx

  from hgpo_jax.compiled import trainer_metrics
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import lora as lora_lib
  from hgpo_jax.models import loading, sharding
  from hgpo_jax.training import train_batch, train_step

  cfg = model_config.get_preset("smollm2-135m")
  mesh = sharding.make_mesh(1, 1, 1)
  rng = np.random.default_rng(0)
  host, _ = train_batch.build_train_batch(
      [rng.integers(3, cfg.vocab_size, prompt).tolist() for _ in range(rows)],
      [rng.integers(3, cfg.vocab_size, response).tolist() for _ in range(rows)],
      rng.normal(size=rows).astype(np.float32), prompt_buckets=[prompt],
      response_buckets=[response], row_multiple=rows)
  out = {}
  for name, (adapted, remat, *loop) in (sides or UPDATE_SIDES).items():
    model = loading.load_model("smollm2-135m")[0]  # as the trainer builds it (training.run)
    model.cfg = model.cfg.replace(remat=remat, attn_query_chunk=256, dtype=compute)
    if adapted:
      model.cfg = model.cfg.replace(param_dtype=compute, adapted_layers=(loop or ["scan"])[0])
      model = loading.with_lora(model, lora_lib.from_settings(rank, 2.0 * rank, TARGETS, False,
                                                              top_layers))
    learner = train_step.Learner(model, mesh, train_step.UpdateConfig(
        lr=1e-6, mini_batch_rows=rows, micro_batch_rows=micro_rows or rows,
        scored_tail=scored_tail))
    box = {"state": learner.init_state(nnx.state(model, nnx.Param))}
    del model
    filled = train_step.fill_rows(learner, box["state"].params, None, host)
    batch = learner.put_batch(filled.replace(ref_logprobs=filled.old_logprobs))
    flops = trainer_metrics.LearnerFlops(learner).per_call(filled)["update"]

    def call(learner=learner, box=box, batch=batch):
      box["state"], _ = learner.update(box["state"], batch)
      return box["state"]
    out[name] = (call, flops)
  return out


def run_update(rank: int, rows: int, prompt: int, response: int, reps: int,
               top_layers: int = 0) -> None:
  """--update: the four sides' update programs, alternating; prints the ratios last."""
  import jax

  from launch.benchmarks import harness
  sides = update_sides(rank, rows, prompt, response, top_layers)
  print(f"smollm2-135m update, {rows} rows x ({prompt} + {response}) tokens, float32, one "
        f"optimizer step; lora rank {rank} alpha {2 * rank}, all seven projections of "
        f"{_where(top_layers)}; jax "
        f"{jax.__version__} on {jax.devices()[0].device_kind}; median of {reps} alternating "
        "calls after one compile call each", flush=True)
  med = harness.alternating_medians({n: c for n, (c, _) in sides.items()}, reps, warmup=1)
  for name, seconds in med.items():
    flops = sides[name][1]
    print(f"  {name:10s} {seconds:7.2f} s  {rows * (prompt + response) / seconds:7.1f} tokens/s  "
          f"{flops / 1e9:8.1f} GFLOP  {flops / seconds / 1e9:6.1f} GFLOP/s", flush=True)
  print(f"update time, full+remat / lora: {med['full+remat'] / med['lora']:.2f}x (like for like: "
        f"full / lora {med['full'] / med['lora']:.2f}x, full+remat / lora+remat "
        f"{med['full+remat'] / med['lora+remat']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="launch.benchmarks.lora",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--iterations", type=int, default=3)
  parser.add_argument("--reps", type=int, default=None,
                      help="repetitions per side (default 1; 3 with --update)")
  parser.add_argument("--flops", action="store_true",
                      help="print the analytic update FLOPs of both sides; run nothing")
  parser.add_argument("--update", action="store_true",
                      help="time the compiled update program alone, four sides (module doc)")
  parser.add_argument("--rows", type=int, default=4, help="--update: rows of the mini-batch")
  parser.add_argument("--prompt", type=int, default=400, help="--update: prompt tokens per row")
  parser.add_argument("--response", type=int, default=32, help="--update: response tokens per row")
  parser.add_argument("--top-layers", type=int, default=0,
                      help="LoRA on the last N layers only (model.lora.top_layers; 0: all)")
  parser.add_argument("--sides", default="full,lora",
                      help="the sides to run, in this order (full, lora; the ratios need both)")
  args = parser.parse_args(argv)
  if not 0 <= args.top_layers <= 30:
    parser.error(f"--top-layers {args.top_layers}: SmolLM2-135M has 30 layers (0: all)")
  if args.flops:
    if args.rank < 1:
      parser.error("--rank must be >= 1")
    print("\n".join(flops_table(args.rank, args.top_layers)))
    return 0
  if args.reps is None:
    args.reps = 3 if args.update else 1
  if args.update:
    if min(args.rank, args.rows, args.prompt, args.response, args.reps) < 1:
      parser.error("--update: --rank, --rows, --prompt, --response and --reps must be >= 1")
    run_update(args.rank, args.rows, args.prompt, args.response, args.reps, args.top_layers)
    return 0
  chosen = [s.strip() for s in args.sides.split(",") if s.strip()]
  if args.iterations < 2 or args.rank < 1 or args.reps < 1:
    parser.error("--iterations must be >= 2 (the first one compiles), --rank and --reps >= 1")
  if not chosen or set(chosen) - {"full", "lora"}:
    parser.error(f"--sides {args.sides!r}: name full and/or lora")
  every = {"full": [], "lora": [f"--config.model.lora.rank={args.rank}",
                                f"--config.model.lora.top_layers={args.top_layers}"]}
  sides = {name: every[name] for name in chosen}
  update = {s: [] for s in sides}
  logprobs = {s: [] for s in sides}
  iteration = {s: [] for s in sides}
  peak = {s: [] for s in sides}
  scratch = tempfile.mkdtemp(prefix="lora_bench_")
  try:
    for rep in range(args.reps):
      for name, overrides in sides.items():
        start = time.perf_counter()
        lines, rss = _run(os.path.join(scratch, f"{name}{rep}"), args.iterations, overrides)
        timed = [line for line in lines if "time/update_s" in line][1:]
        update[name] += [line["time/update_s"] for line in timed]
        logprobs[name] += [line["time/logprobs_s"] for line in timed]
        iteration[name] += [line["time/iteration_s"] for line in timed]
        peak[name].append(rss)
        print(f"  rep {rep + 1}/{args.reps} {name}: {time.perf_counter() - start:.0f} s wall, "
              f"peak RSS {rss:.2f} GiB", flush=True)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  med = {s: (statistics.median(update[s]), statistics.median(logprobs[s]),
             statistics.median(iteration[s]), max(peak[s])) for s in sides}
  print(f"{CONFIG}; median over iterations 2..{args.iterations} x {args.reps} reps; "
        f"lora: rank {args.rank}, alpha 16, all seven projections of "
        f"{_where(args.top_layers)}")
  for name, (u, lp, it, rss) in med.items():
    print(f"  {name:5s} update {u:.1f} s, log-probs {lp:.1f} s, iteration {it:.1f} s, "
          f"peak RSS {rss:.2f} GiB")
  if len(med) < 2:
    return 0
  (u_full, _, _, m_full), (u_lora, _, _, m_lora) = med["full"], med["lora"]
  print(f"full / lora: update time {u_full / u_lora:.2f}x, peak memory {m_full / m_lora:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
