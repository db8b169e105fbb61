"""Benchmark: GiGPO's similarity grouping, fast matcher vs the published greedy difflib rule.

  python -m launch.benchmarks.similarity [--groups 8] [--rows 200] [--states 40] [--reps 1]

One batch of ALFWorld scale (16 episode groups x `--rows` step rows; GiGPO's paper:
8 x 16 = 128 trajectories of up to 50 steps): each group has `--states` distinct
room descriptions of ~250-400 characters, and every visit appends a varying detail
("You see 3 mugs.") so exact repeats are rare but visits of one room stay >= 0.95
similar. Timed, medians over repetitions, the whole batch:
  * published: verl-agent's rule, row by row (`similarity.greedy_clusters_reference`);
  * fast: `similarity.greedy_clusters` (distinct texts once, length and rapidfuzz Indel
    upper bounds, difflib only to confirm), one memo for the batch as the grouping uses.
The clusters are checked to be identical before timing. The last line is the speed ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hgpo_jax.advantages import similarity

_WORDS = ("cabinet drawer shelf countertop fridge microwave sinkbasin stoveburner toaster "
          "coffeemachine garbagecan dresser desk bed sidetable armchair sofa safe").split()


def make_batch(rng, groups: int, rows: int, states: int) -> tuple[list, np.ndarray]:
  texts, group = [], []
  for g in range(groups):
    rooms = []
    for _ in range(states):
      things = ", ".join(f"a {w} {rng.integers(1, 9)}" for w in rng.choice(_WORDS, 14))
      rooms.append(f"You are in the middle of a room. Looking quickly around you, you see {things}.")
    for _ in range(rows):
      room = rooms[rng.integers(states)]
      texts.append(f"{room} You see {rng.integers(0, 10)} mugs.")
      group.append(g)
  return texts, np.asarray(group)


def _time(fn, reps):
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    out = fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), out


def main(argv=None):
  p = argparse.ArgumentParser(prog="python -m launch.benchmarks.similarity")
  p.add_argument("--groups", type=int, default=8)
  p.add_argument("--rows", type=int, default=200, help="step rows per episode group")
  p.add_argument("--states", type=int, default=40, help="distinct rooms per episode group")
  p.add_argument("--thresh", type=float, default=0.95)
  p.add_argument("--reps", type=int, default=1)
  args = p.parse_args(argv)
  texts, group = make_batch(np.random.default_rng(0), args.groups, args.rows, args.states)
  print(f"batch: {args.groups} groups x {args.rows} rows, {args.states} rooms per group, "
        f"mean text length {np.mean([len(t) for t in texts]):.0f} chars, "
        f"{len(set(texts))} distinct texts", flush=True)
  t_ref, ref = _time(lambda: similarity.cluster_in_groups(texts, group, args.thresh,
                                                          reference=True), args.reps)
  t_fast, fast = _time(lambda: similarity.cluster_in_groups(texts, group, args.thresh),
                       args.reps)
  np.testing.assert_array_equal(fast, ref)
  print(f"published greedy difflib rule: {t_ref * 1e3:.1f} ms; fast matcher: {t_fast * 1e3:.1f} ms; "
        f"clusters identical ({ref.max() + 1} clusters)")
  print(f"similarity grouping speed ratio vs the difflib rule: {t_ref / t_fast:.1f}x")


if __name__ == "__main__":
  main()
