"""Benchmark: one iteration of the SmolLM2 job (the `local` variant) now vs a named earlier revision.

  python -m launch.benchmarks.smollm2_iteration --baseline-rev REV [--iterations 3] [--reps 1]
      [--sides baseline,current,bf16,packed,ungrouped,coarse]

(Paper-shaped iterations on one accelerator are `python -m launch.benchmarks.paper_iteration`.)

Every side is the real trainer, `python -m launch.main` with
`--config=configs/alfworld.py:algo=hgpo,k=2,model=smollm2-135m,local` (SmolLM2-135M-Instruct,
an ALFWorld server subprocess, 2 groups x 4 trajectories x 2 steps, one optimizer step on
16 rows of up to 640 + 32 tokens) for `--iterations` iterations in a fresh workdir:

  baseline  the repository at `--baseline-rev` (a temporary `git worktree`), its own
            `local` variant; required whenever this side runs (3c5ff63 is the trainer
            before this benchmark existed (f32 compute; separate old- and reference-log-prob passes; the full
            T x T attention square; every rollout row prefilled)).
  current   the current `local` variant (float32): the changes that keep the arithmetic:
            the update takes log pi_old from its own forward pass when an iteration is
            one optimizer step (`train.reuse_on_policy_logprobs`), causal block skipping
            (`model.attn_query_chunk`), one prefill per distinct prompt (`Sampler`),
            length-grouped micro-batches (`train.group_by_length`);
  bf16      the current tree with bf16 products over the f32 weights
            (`--config.model.compute_dtype=bfloat16`, opt-in): faster only on a CPU with
            bf16 dot products (AVX512-BF16 / AMX; the header line says whether this one
            has them), and it changes the numbers (below);
  packed    the current tree with `--config.train.pack_rows=true` (steps packed end to end
            into rows of the same length; exact).
  ungrouped the current tree with `--config.train.group_by_length=false`: every update row
            padded to the iteration's longest prompt instead of length-grouped
            micro-batches (`local` groups them; exact).
  coarse    the current tree with `--config.train.length_multiple=128`: length-grouped
            micro-batches rounded up to 128 tokens instead of `local`'s 64 (exact).

`--sides` picks and orders the sides (default: baseline, current, bf16); without
baseline, the last line is the first side's time over current's. Sides alternate
repetition by repetition; each reports the median `time/iteration_s` over its iterations
2.. (iteration 1 compiles) and its phase times. Then the metrics of
`current` and `bf16` are compared with the baseline's: rollout metrics (equal when
the sampled actions are), and the largest relative difference of the training floats
(`train/*`); and what bf16 compute does to a small step of the f32 weights (the share of
weights whose bf16 value moves, `--quantization-only` prints just that), and `current`
with `packed`. The last line is the baseline/current iteration-time ratio (or <first side>/current).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from hgpo_jax.training import run_records
from launch.benchmarks import harness

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = "configs/alfworld.py:algo=hgpo,k=2,model=smollm2-135m,local"
PHASES = ("generation_s", "logprobs_s", "update_s")
MFU = ("logprobs_mfu", "update_mfu")  # perf/* of metrics.jsonl: XLA's FLOPs / time / CPU peak
# what the update's row layout (packing, length grouping) changes by design
LAYOUT = ("train/token_fill", "train/update_rows")
SIDES = ("baseline", "current", "bf16", "packed", "ungrouped", "coarse")  # the sides --sides may name


def _run(tree: str, workdir: str, iterations: int, overrides: list[str]) -> list[dict]:
  """Trains in `tree` (its own code) and returns the metrics.jsonl lines; the workdir is
  deleted (its checkpoints, SmolLM2 weights and Adam state, take ~1.6 GB each)."""
  env = dict(os.environ, PYTHONPATH=tree, PYTHONHASHSEED="0")
  cmd = [sys.executable, "-m", "launch.main", f"--config={CONFIG}", f"--workdir={workdir}",
         f"--config.train.num_iterations={iterations}", "--config.eval.at_end=false", *overrides]
  done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
  if done.returncode:
    sys.exit(f"smollm2_iteration: {' '.join(cmd)} failed in {tree}:\n{done.stderr[-3000:]}")
  lines = run_records.read_metrics(workdir)
  shutil.rmtree(workdir, ignore_errors=True)
  return lines


def _detail(phases: dict[str, list[float]], mfu: dict[str, list[float]]) -> str:
  """Median seconds per phase, then the median MFU of each compiled pass that has one."""
  parts = [f"{p[:-2]} {statistics.median(phases[p]):.1f} s" for p in PHASES]
  parts += [f"{m[:-4]} MFU {statistics.median(mfu[m]):.2f}" for m in MFU if mfu.get(m)]
  return ", ".join(parts)


def _compare(base: list[dict], other: list[dict]) -> str:
  same_rollouts = all(
      b[k] == o[k] for b, o in zip(base, other) for k in b if k.startswith("rollout/"))
  worst, where = 0.0, ""
  for b, o in zip(base, other):
    for k in b:
      if k.startswith("train/") and k not in LAYOUT and k in o and b[k] != 0:
        rel = abs(o[k] - b[k]) / abs(b[k])
        if rel > worst:
          worst, where = rel, f"{k} at iteration {b['step']}: {b[k]:.6g} vs {o[k]:.6g}"
  return (f"rollout metrics {'equal' if same_rollouts else 'DIFFER'}; largest relative "
          f"difference of train/* {worst:.2g} ({where})")


def bf16_step_quantization(step: float = 1e-5) -> str:
  """What bf16 compute does to a small update of f32 weights: the share of SmolLM2's
  matrix weights whose bf16 value changes after a step of `step` (random signs, as AdamW's
  first step moves every weight by ~lr), and by how much."""
  import jax.numpy as jnp
  import numpy as np
  import jax
  from flax import nnx
  from hgpo_jax.models import loading
  model, _, _ = loading.load_model("smollm2-135m")
  w = np.concatenate([np.asarray(x).ravel() for x in jax.tree.leaves(nnx.state(model, nnx.Param))
                      if x.ndim >= 2])
  d = step * np.sign(np.random.default_rng(0).standard_normal(w.shape)).astype(np.float32)
  bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  before, after = bf16(w), bf16(w + d)
  changed = before != after
  return (f"bf16 view of SmolLM2's {w.size:,} matrix weights (median |w| {np.median(np.abs(w)):.3f}) "
          f"after a {step:g} step: {changed.mean():.1%} change, by {np.mean(np.abs(after - before)[changed]) / step:.1f}x "
          f"the step on average (rms {np.sqrt(np.mean((after - before) ** 2)) / step:.1f}x)")


def _parser() -> argparse.ArgumentParser:
  """The command line of `python -m launch.benchmarks.smollm2_iteration`."""
  parser = argparse.ArgumentParser(prog="python -m launch.benchmarks.smollm2_iteration",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--baseline-rev", default="",
                      help="the revision of the baseline side (required when it runs)")
  parser.add_argument("--iterations", type=int, default=3)
  parser.add_argument("--reps", type=int, default=1)
  parser.add_argument("--sides", default="baseline,current,bf16",
                      help=f"comma-separated sides to run, in this order (of {', '.join(SIDES)}; "
                           "current and at least one other)")
  parser.add_argument("--quantization-only", action="store_true",
                      help="only print what bf16 compute does to a 1e-5 step of the weights")
  return parser


def _chosen_sides(parser: argparse.ArgumentParser, args) -> list[str]:
  """The keys of `--sides` in order, after checking them and `--iterations` (exits on an
  error)."""
  if args.iterations < 2:
    sys.exit("smollm2_iteration: --iterations must be >= 2 (the first one compiles)")
  chosen = [s.strip() for s in args.sides.split(",") if s.strip()]
  unknown = sorted(set(chosen) - set(SIDES))
  if unknown or "current" not in chosen or len(set(chosen)) < 2:
    sys.exit(f"smollm2_iteration: --sides {args.sides!r}: choose from {', '.join(SIDES)}, "
             f"current and at least one other")
  if "baseline" in chosen and not args.baseline_rev:
    parser.error("--sides includes baseline: name its revision with --baseline-rev REV")
  return chosen


def _side_table(chosen: list[str], baseline_rev: str, baseline_tree: str | None
                ) -> tuple[dict[str, tuple[str, list[str]]], dict[str, str]]:
  """({label: (tree, overrides)} of the `chosen` sides in their order, {key: label})."""
  every = {"baseline": (f"baseline ({baseline_rev})", baseline_tree, []),
           "current": ("current (float32)", REPO_ROOT, []),
           "bf16": ("bf16 compute (opt-in)", REPO_ROOT, ["--config.model.compute_dtype=bfloat16"]),
           "packed": ("rows packed (opt-in)", REPO_ROOT, ["--config.train.pack_rows=true"]),
           "ungrouped": ("rows not length-grouped", REPO_ROOT, ["--config.train.group_by_length=false"]),
           "coarse": ("lengths rounded to 128", REPO_ROOT, ["--config.train.length_multiple=128"])}
  sides = {every[k][0]: every[k][1:] for k in chosen}
  label = {k: every[k][0] for k in chosen}
  return sides, label


def _measure(sides: dict[str, tuple[str, list[str]]], iterations: int, reps: int
             ) -> tuple[dict, dict, dict, dict]:
  """Trains every side `reps` times in turn; returns, per side label, (iteration seconds,
  {phase: seconds}, {pass: MFU}) of the timed iterations (all but the first, compiling one)
  and the metrics lines of its last rep."""
  times = {name: [] for name in sides}
  phases = {name: {p: [] for p in PHASES} for name in sides}
  mfu = {name: {m: [] for m in MFU} for name in sides}
  lines = {}
  scratch = tempfile.mkdtemp(prefix="iteration_runs_")
  try:
    for rep in range(reps):
      for i, (name, (tree, overrides)) in enumerate(sides.items()):
        start = time.perf_counter()
        lines[name] = _run(tree, os.path.join(scratch, f"rep{rep}_side{i}"), iterations, overrides)
        timed = [l for l in lines[name] if "time/iteration_s" in l][1:]
        times[name] += [l["time/iteration_s"] for l in timed]
        for p in PHASES:
          phases[name][p] += [l[f"time/{p}"] for l in timed]
        for m in MFU:
          mfu[name][m] += [l[f"perf/{m}"] for l in timed if f"perf/{m}" in l]
        print(f"  rep {rep + 1}/{reps} {name}: {time.perf_counter() - start:.0f} s wall",
              flush=True)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  return times, phases, mfu, lines


def _print_report(args, chosen: list[str], reference: str, label: dict[str, str], times: dict,
                  phases: dict, mfu: dict, lines: dict) -> None:
  """Prints the header (jax, CPU), each side's median times, the metric comparisons against
  the reference (and the layout-only sides against current) and the time ratios."""
  import jax
  from hgpo_jax.cost import hardware
  cpu = hardware.describe_cpu()
  print(f"jax {jax.__version__}, {cpu['model'] or 'cpu'}, {cpu['cores']} cores, "
        f"{cpu['f32_lanes'] * 32}-bit vectors, bf16 dot products: "
        f"{'yes' if cpu['bf16_dot'] or cpu['amx'] else 'no'}; {CONFIG}; median over "
        f"{args.reps} x {args.iterations - 1} timed iterations")
  for name in times:
    print(f"  {name:26s} {statistics.median(times[name]):7.1f} s per iteration "
          f"({_detail(phases[name], mfu[name])})")
  for key in chosen:
    if key != reference:
      print(f"  {label[key]} vs {label[reference]}: "
            f"{_compare(lines[label[reference]], lines[label[key]])}")
  for key in ("packed", "ungrouped", "coarse"):
    if key in chosen and reference != "current" and reference != key:
      print(f"  {label[key]} vs {label['current']}: "
            f"{_compare(lines[label['current']], lines[label[key]])}")
  median = {k: statistics.median(times[label[k]]) for k in chosen}
  others = [f"current/{k} {median['current'] / median[k]:.2f}" for k in ("bf16", "packed")
            if k in chosen and k != reference]
  others += [f"{k}/current {median[k] / median['current']:.2f}" for k in ("ungrouped", "coarse")
             if k in chosen and k != reference]
  if "bf16" in chosen:
    print(f"  {bf16_step_quantization()}")
  what = f"SmolLM2 job, {args.baseline_rev} vs now" if reference == "baseline" else "SmolLM2 job"
  print(f"iteration time {'; '.join(others + [''])}{reference}/current "
        f"({what}): {median[reference] / median['current']:.2f}")


def main():
  parser = _parser()
  args = parser.parse_args()
  if args.quantization_only:
    print(bf16_step_quantization())
    return
  chosen = _chosen_sides(parser, args)
  reference = "baseline" if "baseline" in chosen else next(k for k in chosen if k != "current")
  trees = contextlib.ExitStack()
  baseline_tree = (trees.enter_context(harness.revision_tree(args.baseline_rev,
                                                             "smollm2_iteration"))
                   if "baseline" in chosen else None)
  sides, label = _side_table(chosen, args.baseline_rev, baseline_tree)
  try:
    times, phases, mfu, lines = _measure(sides, args.iterations, args.reps)
  finally:
    trees.close()
  _print_report(args, chosen, reference, label, times, phases, mfu, lines)

if __name__ == "__main__":
  main()
