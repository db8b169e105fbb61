"""Writes generated ALFWorld-format games (the command behind larger game sets).

  # 500 train games in ALFWorld's folder layout; play them with AlfworldEnv(data_dir=DIR)
  python -m env_servers.alfworld.generate --split train --num 500 --seed 0 --out DIR

  # the shipped frozen set (env_servers/alfworld/data/<split>.json.gz), small rooms only
  python -m env_servers.alfworld.generate --split valid_seen --num 24 --seed 0 \
      --max-receptacles 20 --frozen --out env_servers/alfworld/data

Generation is deterministic per (split, seed, index); the Fast Downward solvability
check dominates its cost. Measured on the 2-core dev machine while other jobs ran: the
frozen sets above took 0.85-3.4 s/game wall; `--split train --num 12 --seed 0` (all
rooms) took 3.8 s/game wall, 1.1 s/game CPU. The largest kitchens plan slowest.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from env_servers.alfworld import games
from env_servers.alfworld import generator
from env_servers.alfworld import speedup


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--split", required=True, choices=games.SPLITS)
  parser.add_argument("--num", type=int, required=True, help="number of games")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", required=True,
                      help="output folder: <out>/<split>/<task>/<trial>/ (or <out>/<split>.json.gz "
                           "with --frozen)")
  parser.add_argument("--max-receptacles", type=int, default=None,
                      help="only rooms with at most this many receptacles (faster planning)")
  parser.add_argument("--frozen", action="store_true",
                      help="write one gzip JSON (the shipped frozen-set format) instead of folders")
  args = parser.parse_args(argv)
  if args.num < 1:
    parser.error("--num must be >= 1")

  from tqdm import tqdm

  speedup.apply()  # the walkthrough replay steps the engine
  t0 = time.perf_counter()
  records = []
  with tqdm(total=args.num, desc=f"alfworld {args.split}", unit="game") as bar:
    for record in generator.generate_split(args.split, args.num, args.seed,
                                           args.max_receptacles):
      if not args.frozen:
        games.write_game_dir(record, args.out)
      records.append(record)
      bar.update(1)
  if args.frozen:
    path = os.path.join(args.out, f"{args.split}.json.gz")
    games.save_frozen(records, path, split=args.split, seed=args.seed,
                      num=args.num, max_receptacles=args.max_receptacles)
  else:
    path = os.path.join(args.out, args.split)
  dt = time.perf_counter() - t0
  print(f"wrote {len(records)} {args.split} games to {path} in {dt:.1f} s "
        f"({dt / len(records):.2f} s/game)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
