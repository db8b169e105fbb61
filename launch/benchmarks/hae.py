"""Benchmark: the jit HAE and GAE estimators vs their readable loop references.

  python -m launch.benchmarks.hae [--trajs 128] [--turns 50] [--tokens 512] [--reps 10] [--ref-reps 3]

One batch of HiPER/PPO scale (docs/algorithms.md §12: 128 tasks per iteration, 50
turns, 512 response tokens): every trajectory has `--turns` turns and every
response `--tokens` tokens, random subgoal switches (p = 0.3), 60% of the
trajectories end done (the rest are truncated), 15% invalid turns, random
switch/subgoal/action spans. Reported, medians over repetitions:
  * jit: the registered estimator on a device-resident batch, after compilation,
    until the result is ready (compilation time printed separately);
  * reference: `hgpo_jax/advantages/hae_reference.py` (plain Python loops).
The outputs are checked against each other before timing. The last line is the
HAE speed-up of the jit estimator over the reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from hgpo_jax.advantages.gae import GaeOptions, gae
from hgpo_jax.advantages import hae_reference as ref
from hgpo_jax.advantages.hae import HaeOptions, hae


def _median_seconds(fn, reps: int) -> float:
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _bench(name, jit_fn, ref_fn, batch, fields, options, check, reps, ref_reps):
  start = time.perf_counter()
  out = jax.block_until_ready(jit_fn(batch, options))
  compile_s = time.perf_counter() - start
  expect = ref_fn(fields, options)
  check(out, expect)
  jit_s = _median_seconds(lambda: jax.block_until_ready(jit_fn(batch, options)), reps)
  ref_s = _median_seconds(lambda: ref_fn(fields, options), ref_reps)
  print(f"{name}: jit {jit_s * 1e3:.2f} ms (median of {reps}; first call incl. compile {compile_s:.2f} s), "
        f"reference {ref_s * 1e3:.1f} ms (median of {ref_reps})", flush=True)
  return ref_s / jit_s


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m launch.benchmarks.hae", description=__doc__.split("\n")[0])
  p.add_argument("--trajs", type=int, default=128)
  p.add_argument("--turns", type=int, default=50)
  p.add_argument("--tokens", type=int, default=512)
  p.add_argument("--reps", type=int, default=10, help="repetitions of the jit estimators")
  p.add_argument("--ref-reps", type=int, default=3, help="repetitions of the loop references")
  p.add_argument("--seed", type=int, default=0)
  args = p.parse_args(argv)

  fields = ref.random_fields(np.random.default_rng(args.seed), args.trajs, args.turns, args.tokens,
                             shuffle=False, full=True)
  batch = jax.device_put(ref.row_batch(fields))
  rows = int(fields["mask"].sum())
  print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; batch: {args.trajs} trajectories x "
        f"{args.turns} turns = {rows} rows x {args.tokens} tokens", flush=True)

  def check_hae(out, expect):
    np.testing.assert_allclose(out.token_advantage, expect["token_advantage"], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(out.value_targets["high"], expect["levels"]["ret_high"], rtol=1e-3, atol=1e-3)

  def check_gae(out, expect):
    np.testing.assert_allclose(out.token_advantage, expect["token_advantage"], rtol=1e-3, atol=1e-3)

  gae_speedup = _bench("gae (multi_turn)", gae, ref.gae, batch, fields, GaeOptions(multi_turn=True),
                       check_gae, args.reps, args.ref_reps)
  hae_opts = HaeOptions(keep_penalty=-0.3, keep_consistency_penalty=-0.3)
  hae_speedup = _bench("hae", hae, ref.hae, batch, fields, hae_opts, check_hae, args.reps, args.ref_reps)
  print(f"gae speedup vs reference: {gae_speedup:.1f}x")
  print(f"hae speedup vs reference: {hae_speedup:.1f}x")


if __name__ == "__main__":
  main()
