"""ALFWorld engine speed: steps/s with the memoised text generation vs the stock engine.

  python -m launch.benchmarks.alfworld_engine            # default: 3 reps x 6 games
  python -m launch.benchmarks.alfworld_engine --reps 5 --steps 60

Each (mode, repetition) runs in a fresh process (a process that ran one mode would warm
caches for the other), plays the same frozen games (one per task type, generated
ALFWorld-format games on ALFRED rooms) with seeded random admissible commands through
`AlfworldEnv`, and times only `step` (resets are the planner-free PDDL load, ~1 s each,
the same in both modes). Modes alternate so machine-load drift hits both alike; the
summary reports medians, and the last line is the patched/stock ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(mode: str, n_games: int, n_steps: int) -> dict:
  import random
  from env_servers.alfworld import games
  from env_servers.alfworld.env import AlfworldEnv

  env = AlfworldEnv(speedup=(mode == "patched"), max_steps=10 * n_steps)
  records = games.load_frozen(games.frozen_set_file("valid_unseen"))[:n_games]
  rng = random.Random(0)
  steps, step_time, reset_time, n_admissible = 0, 0.0, 0.0, 0
  for record in records:
    t0 = time.perf_counter()
    _, info = env.reset(options={"task_id": record.task_id})
    reset_time += time.perf_counter() - t0
    for _ in range(n_steps):
      cmd = rng.choice(info["admissible_actions"])
      t0 = time.perf_counter()
      _, _, terminated, truncated, info = env.step(cmd)
      step_time += time.perf_counter() - t0
      steps += 1
      n_admissible += len(info["admissible_actions"])
      if terminated or truncated:
        t0 = time.perf_counter()
        _, info = env.reset(options={"task_id": record.task_id})
        reset_time += time.perf_counter() - t0
  return {"mode": mode, "steps": steps, "steps_per_s": steps / step_time,
          "reset_s": reset_time / len(records), "admissible": n_admissible / steps}


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--games", type=int, default=6)
  parser.add_argument("--steps", type=int, default=40, help="random steps per game")
  parser.add_argument("--worker", choices=["stock", "patched"], help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.worker:
    print(json.dumps(_worker(args.worker, args.games, args.steps)))
    return 0

  env = dict(os.environ, PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
  results: dict[str, list[dict]] = {"stock": [], "patched": []}
  for rep in range(args.reps):
    for mode in ("stock", "patched"):
      out = subprocess.run(
          [sys.executable, "-m", "launch.benchmarks.alfworld_engine", "--worker", mode,
           "--games", str(args.games), "--steps", str(args.steps)],
          cwd=_REPO, env=env, capture_output=True, text=True, check=True)
      r = json.loads(out.stdout.strip().splitlines()[-1])
      results[mode].append(r)
      print(f"rep {rep} {mode:8s} {r['steps_per_s']:7.1f} steps/s  reset {r['reset_s']:.2f} s  "
            f"({r['steps']} steps, {r['admissible']:.0f} admissible commands/step)", flush=True)
  med = {m: statistics.median(r["steps_per_s"] for r in rs) for m, rs in results.items()}
  print(f"median steps/s: stock {med['stock']:.1f}, patched {med['patched']:.1f} "
        f"({args.reps} reps x {args.games} games x {args.steps} random steps)")
  print(f"speedup patched/stock: {med['patched'] / med['stock']:.1f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
