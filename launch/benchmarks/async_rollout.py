r"""Benchmark: rollout ahead of the update (`train.max_staleness=1`) against rollout and
update in turn (`max_staleness=0`), on env servers with a remote env's latency.

  python -m launch.benchmarks.async_rollout [--step-latency-ms 150] [--iterations 8] \
      [--reps 3] [--config configs/sokoban.py:algo=hgpo,k=2,smoke] [--override --config.a.b=v]

Both sides are the real trainer (`hgpo_jax.train.train_and_evaluate`, in this process) on
the same config for `--iterations` iterations in fresh workdirs, with env servers whose
every Step call waits `--step-latency-ms` (`env.step_latency_ms`: the servers'
`--step-latency-ms`, a web shop's or a browser's round trip). On a CPU the two sides share
the cores, so the latency-bound env is the honest proxy of what the overlap hides: the
rollout's waiting on the env overlaps the update's compute. The sides alternate run by run
(`--reps` runs each); each run's iterations 3.. are timed (`time/iteration_s`; the first
two compile and, with `max_staleness=1`, fill the pipeline). The last line is the ratio
of the medians, in turn / ahead.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile

DEFAULT_CONFIG = "configs/sokoban.py:algo=hgpo,k=2,smoke"
SKIPPED_ITERATIONS = 2
ITERATION = "time/iteration_s"


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m launch.benchmarks.async_rollout",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--config", default=DEFAULT_CONFIG)
  ap.add_argument("--step-latency-ms", type=float, default=150.0)
  ap.add_argument("--iterations", type=int, default=8)
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--override", action="append", default=[], metavar="--config.a.b=v",
                  help="a further config override of both sides")
  return ap


def run_side(spec: str, overrides: list[str], staleness: int, latency_ms: float,
             iterations: int) -> list[dict]:
  """The timed iterations' metric lines of one training run with `max_staleness=staleness`."""
  from configs import common
  from hgpo_jax import train
  from hgpo_jax.training import experiment, run_records
  config = common.load(spec, [
      *overrides, f"--config.train.max_staleness={staleness}",
      f"--config.env.step_latency_ms={latency_ms}", f"--config.train.num_iterations={iterations}",
      "--config.eval.every=0", "--config.eval.at_end=false", "--config.mesh.data=1",
      f"--config.checkpoint.every={iterations}", "--config.metrics.writers=()"])
  workdir = tempfile.mkdtemp(prefix=f"async_rollout_k{staleness}_")
  try:
    train.train_and_evaluate(experiment.from_config(config), workdir)
    lines = run_records.training_lines(workdir)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return lines[SKIPPED_ITERATIONS:]


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.iterations <= SKIPPED_ITERATIONS or args.reps < 1 or args.step_latency_ms < 0:
    print(f"async_rollout: --iterations must be > {SKIPPED_ITERATIONS}, --reps >= 1 and "
          f"--step-latency-ms >= 0", file=sys.stderr)
    return 2
  from hgpo_jax import runtime
  runtime.pin_cpu_isa()
  import jax
  runtime.enable_compilation_cache()
  print(f"async_rollout: {args.config} {' '.join(args.override)}, step latency "
        f"{args.step_latency_ms:g} ms, {args.iterations} iterations x {args.reps} runs per "
        f"side; {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
  lines: dict[int, list[dict]] = {0: [], 1: []}
  for rep in range(args.reps):
    for k in (0, 1):
      got = run_side(args.config, args.override, k, args.step_latency_ms, args.iterations)
      lines[k] += got
      print(f"run {rep + 1} max_staleness={k}: iterations "
            f"{' '.join(f'{line[ITERATION]:.2f}' for line in got)} s", flush=True)
  median = lambda k, *keys: statistics.median(sum(line[key] for key in keys) for line in lines[k])
  print(f"in turn, medians per iteration: env {median(0, 'time/env_s'):.2f} s, generation "
        f"{median(0, 'time/generation_s'):.2f} s, log-probs + update "
        f"{median(0, 'time/logprobs_s', 'time/update_s'):.2f} s", flush=True)
  turn, ahead = median(0, ITERATION), median(1, ITERATION)
  print(f"async_rollout: median iteration {turn:.2f} s in turn (max_staleness=0), {ahead:.2f} s "
        f"ahead (max_staleness=1) over {len(lines[0])} iterations each: {turn / ahead:.2f}x",
        flush=True)
  return 0


if __name__ == "__main__":
  os.environ.setdefault("PYTHONHASHSEED", "0")
  sys.exit(main())
