"""Benchmark: the SmolLM2 job with LoRA adapters against full fine-tuning, side by side.

  python -m launch.benchmarks.lora [--rank 16] [--iterations 3] [--reps 1] [--sides full,lora]
  python -m launch.benchmarks.lora --flops [--rank 16]     # the analytic FLOPs only, no run

Both sides are the real trainer, `python -m launch.main` with
`--config=configs/alfworld.py:algo=hgpo,k=2,model=smollm2-135m,local` (the SmolLM2 job,
`make run-llm`: an ALFWorld server subprocess, 2 groups x 4 trajectories x 2 steps, one
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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

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
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    lines = [json.loads(line) for line in f]
  shutil.rmtree(workdir, ignore_errors=True)
  return lines, usage.ru_maxrss / 2**20  # KiB -> GiB


ROWS, SCORED, LONGEST = 16, 32, 640 + 32  # the job's update: rows, response bucket, prompt + it
TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def flops_table(rank: int) -> list[str]:
  """The analytic update FLOPs of the job's model, full vs LoRA `rank`, per micro-batch
  length and remat setting, with their ratio."""
  from hgpo_jax.cost import analytic
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import lora as lora_lib
  full = model_config.get_preset("smollm2-135m")
  adapted = full.replace(lora=lora_lib.from_settings(rank, 16.0, TARGETS, False))
  lines = [f"analytic update GFLOP of {ROWS} rows, {SCORED} scored tokens each (smollm2-135m, "
           f"LoRA rank {rank} on all seven projections)"]
  for seq in (LONGEST // 2, LONGEST):
    for remat in (True, False):
      f, l = (analytic.analytic_update_flops(c, rows=ROWS, seq=seq, scored=SCORED, remat=remat)
              for c in (full, adapted))
      lines.append(f"  seq {seq:4d} remat {str(remat):5s}: full {f / 1e9:9.1f}  lora "
                   f"{l / 1e9:9.1f}  full / lora {f / l:.3f}")
  return lines


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="launch.benchmarks.lora",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--iterations", type=int, default=3)
  parser.add_argument("--reps", type=int, default=1)
  parser.add_argument("--flops", action="store_true",
                      help="print the analytic update FLOPs of both sides; run nothing")
  parser.add_argument("--sides", default="full,lora",
                      help="the sides to run, in this order (full, lora; the ratios need both)")
  args = parser.parse_args(argv)
  if args.flops:
    if args.rank < 1:
      parser.error("--rank must be >= 1")
    print("\n".join(flops_table(args.rank)))
    return 0
  chosen = [s.strip() for s in args.sides.split(",") if s.strip()]
  if args.iterations < 2 or args.rank < 1 or args.reps < 1:
    parser.error("--iterations must be >= 2 (the first one compiles), --rank and --reps >= 1")
  if not chosen or set(chosen) - {"full", "lora"}:
    parser.error(f"--sides {args.sides!r}: name full and/or lora")
  every = {"full": [], "lora": [f"--config.model.lora.rank={args.rank}"]}
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
        f"lora: rank {args.rank}, alpha 16, all seven projections")
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
