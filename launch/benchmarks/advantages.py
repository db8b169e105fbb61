"""Benchmark: jit advantage kernels vs the readable reference, and host grouping.

  python -m launch.benchmarks.advantages [--reps 20] [--sizes 6400,100000,1000000]

Batches mimic paper-scale rollouts (docs/algorithms.md §12): groups of 8
trajectories of 50 steps (6,400 rows = 16 groups, as in one HGPO iteration;
100k and 1M rows scale the group count), random walks over a per-group room graph
with loops (revisits), 50% successes (reward 10 at the last step), 10% invalid
steps, K = 4. Reported separately, medians over repetitions:
  * host grouping: `build_row_batch` from columns (strings interned, ids hashed);
  * kernel: the registered jit estimator on a device-resident batch, after
    compilation, until the result is ready;
  * reference: `hgpo_jax.advantages.reference` (plain Python over row dicts),
    run only at the sizes given by --reference-max-rows, since it grows to minutes.
The kernel is checked against the reference wherever both run. The last line is
the HGPO speed-up of the kernel over the reference at the smallest size.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np

from hgpo_jax.advantages import build_row_batch
from hgpo_jax.advantages import reference
from hgpo_jax.advantages import registry
from launch.benchmarks import harness

TRAJS_PER_GROUP = 8
STEPS = 50
NUM_ROOMS = 12
K = 4
ESTIMATORS = ("grpo", "rloo", "gigpo", "hgpo")


def rollout_columns(num_rows: int, seed: int = 0) -> dict:
  """Columns of a synthetic rollout with num_rows = groups * 8 * 50 rows (in batch order)."""
  num_groups = num_rows // (TRAJS_PER_GROUP * STEPS)
  rng = np.random.default_rng(seed)
  num_trajs = num_groups * TRAJS_PER_GROUP
  group_t = np.repeat(np.arange(num_groups), TRAJS_PER_GROUP)
  # Same start room per group (same env seed); mostly forward moves, some loops back.
  room_ts = np.zeros((num_trajs, STEPS), np.int64)
  for s in range(1, STEPS):
    move = rng.choice([1, 1, 1, 0, -1, 2], size=num_trajs)
    room_ts[:, s] = (room_ts[:, s - 1] + move) % NUM_ROOMS
  reward_ts = np.zeros((num_trajs, STEPS))
  reward_ts[:, -1] = 10.0 * (rng.random(num_trajs) < 0.5)
  valid_ts = rng.random((num_trajs, STEPS)) > 0.1
  group_r = np.repeat(group_t, STEPS)
  room_r = room_ts.reshape(-1)
  return dict(
      group=group_r,
      traj=np.repeat(np.arange(num_trajs), STEPS),
      step=np.tile(np.arange(STEPS), num_trajs),
      anchor_obs=[f"task {g}: you are in room {r}."
                  for g, r in zip(group_r.tolist(), room_r.tolist())],
      reward=reward_ts.reshape(-1),
      valid=valid_ts.reshape(-1))


def as_row_dicts(cols: dict) -> list[dict]:
  names = list(cols)
  return [dict(zip(names, values)) for values in zip(*(
      c.tolist() if isinstance(c, np.ndarray) else c for c in cols.values()))]


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--reps", type=int, default=20, help="kernel repetitions per measurement")
  p.add_argument("--sizes", default="6400,100000,1000000", help="row counts (multiples of 400)")
  p.add_argument("--reference-max-rows", type=int, default=100_000,
                 help="run the reference only up to this many rows")
  args = p.parse_args(argv)
  sizes = [int(s) for s in args.sizes.split(",")]
  print(f"devices: {jax.devices()}  K={K}  reps={args.reps}")
  headline = None
  for size in sizes:
    cols = rollout_columns(size)
    n = len(cols["step"])
    group_reps = max(1, min(args.reps, 2_000_000 // n))
    grouping_s, grouped = harness.median_seconds(
        lambda: build_row_batch(cols, num_levels=K + 1, capacity=n), group_reps)
    batch = jax.device_put(grouped.batch)
    rows = as_row_dicts(cols) if n <= args.reference_max_rows else None
    print(f"\n{n} rows: host grouping {grouping_s * 1e3:.1f} ms (median of {group_reps})")
    for name in ESTIMATORS:
      est = registry.get(name)
      opts = est.options(k=K) if name == "hgpo" else est.options()
      run = lambda: est(batch, opts).advantage.block_until_ready()
      run()  # compile
      kernel_s, advantage = harness.median_seconds(run, args.reps)
      line = f"  {name:6s} kernel {kernel_s * 1e3:8.3f} ms"
      if rows is not None:
        ref_reps = 3 if n <= 10_000 else 1
        ref_s, expected = harness.median_seconds(lambda: reference.ESTIMATORS[name](rows, opts), ref_reps)
        actual = grouped.to_input_order(np.asarray(advantage))
        err = float(np.max(np.abs(actual - np.asarray(expected))))
        line += (f"  reference {ref_s * 1e3:9.1f} ms (median of {ref_reps})  "
                 f"speed-up {ref_s / kernel_s:8.1f}x  max |diff| {err:.1e}")
        if name == "hgpo" and headline is None:
          headline = ref_s / kernel_s
      else:
        line += "  reference skipped (above --reference-max-rows)"
      print(line, flush=True)
  if headline is not None:
    print(f"hgpo speedup vs reference: {headline:.1f}x")


if __name__ == "__main__":
  main()
