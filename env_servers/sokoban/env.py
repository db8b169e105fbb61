"""Text Sokoban: seeded procedural rooms, solvable by construction.

A level is made by carving a room with a random walk, putting every box on a target
and then playing the game *backwards* (the player walks and sometimes pulls a box).
Reversing those moves is a solution, so every level is solvable and ships its
walkthrough. Everything derives from `random.Random(f"{level_seed}/{dim}/{boxes}")`,
so a task id gives the same level on every machine and Python version.

Tasks: `train-00042` is level seed 42, `test-00042` is level seed 1_000_042 (the two
splits never share a level). `train_levels=N` keeps the train split to its first N levels
(a few rooms a small policy can learn by heart, as ALFWorld-mini's two training games);
the test split stays whole. Reward 10 when the last box reaches a target, else 0;
the episode is truncated after `max_steps` actions (invalid ones included).

Grid symbols: `#` wall, `_` floor, `.` target, `$` box, `*` box on target, `@` player,
`+` player on target. The anchor observation is the grid alone.
"""

from __future__ import annotations

import dataclasses
import random

import gymnasium as gym

from env_servers import base

MOVES = {"up": (0, -1), "down": (0, 1), "left": (-1, 0), "right": (1, 0)}
OPPOSITE = {"up": "down", "down": "up", "left": "right", "right": "left"}
SPLITS = {"train": (0, 1000), "test": (1_000_000, 200)}  # split -> (seed offset, size)
SOLVED_REWARD = 10.0
INSTRUCTIONS = ("Push every box ($) onto a target (.). Symbols: # wall, _ floor, @ you, "
                "* box on target, + you on target. Actions: up, down, left, right.")


@dataclasses.dataclass(frozen=True)
class Level:
  dim: int
  floor: frozenset  # of (x, y); everything else is wall
  targets: frozenset
  boxes: frozenset  # initial box cells
  player: tuple
  walkthrough: tuple  # actions that solve the level


def _add(p, d, k=1):
  return (p[0] + k * d[0], p[1] + k * d[1])


def generate_level(level_seed: int, dim: int = 7, num_boxes: int = 2) -> Level:
  """Returns the level of `level_seed` (deterministic; retries inside one RNG stream)."""
  rng = random.Random(f"{level_seed}/{dim}/{num_boxes}")
  inner = [(x, y) for y in range(1, dim - 1) for x in range(1, dim - 1)]
  while True:
    pos = rng.choice(inner)
    floor = {pos}
    for _ in range(rng.randint(2 * len(inner) // 3, 2 * len(inner))):
      step = _add(pos, MOVES[rng.choice(list(MOVES))])
      if 1 <= step[0] <= dim - 2 and 1 <= step[1] <= dim - 2:
        pos = step
        floor.add(pos)
    if len(floor) < num_boxes + 4:
      continue
    cells = sorted(floor)
    targets = frozenset(rng.sample(cells, num_boxes))
    player = rng.choice([c for c in cells if c not in targets])
    boxes, reverse_moves = set(targets), []
    for _ in range(rng.randint(4 * num_boxes, 12 * num_boxes)):
      name = rng.choice(list(MOVES))
      nxt, behind = _add(player, MOVES[name]), _add(player, MOVES[name], -1)
      if nxt not in floor or nxt in boxes:
        continue
      if behind in boxes and rng.random() < 0.75:  # pulling is what moves boxes off targets
        boxes.remove(behind)
        boxes.add(player)
      player = nxt
      reverse_moves.append(name)
    if boxes != targets:
      walkthrough = tuple(OPPOSITE[m] for m in reversed(reverse_moves))
      return Level(dim, frozenset(floor), targets, frozenset(boxes), player, walkthrough)


class SokobanEnv(gym.Env):
  """Text Sokoban with the `env_servers.base` info contract."""

  def __init__(self, dim: int = 7, num_boxes: int = 2, max_steps: int = 50,
               train_levels: int = 0):
    if dim < 5 or num_boxes < 1 or max_steps < 1:
      raise ValueError(f"sokoban: need dim >= 5, num_boxes >= 1, max_steps >= 1; got "
                       f"dim={dim}, num_boxes={num_boxes}, max_steps={max_steps}")
    if not 0 <= int(train_levels) <= SPLITS["train"][1]:
      raise ValueError(f"sokoban: train_levels={train_levels} must be in 0..{SPLITS['train'][1]} "
                       f"(0: the whole train split)")
    self.dim, self.num_boxes, self.max_steps = int(dim), int(num_boxes), int(max_steps)
    self.train_levels = int(train_levels)
    self._level = None

  @staticmethod
  def splits() -> list[str]:
    return list(SPLITS)

  def split_size(self, split: str) -> int:
    """Levels in `split` (the train split's first `train_levels` when set)."""
    if split not in SPLITS:
      raise ValueError(f"sokoban: unknown split {split!r}; splits: {', '.join(SPLITS)}")
    if split == "train" and self.train_levels:
      return self.train_levels
    return SPLITS[split][1]

  def task_ids(self, split: str) -> list[str]:
    return [f"{split}-{i:05d}" for i in range(self.split_size(split))]

  def level_seed(self, task_id: str) -> int:
    """Maps `train-00042` to its level seed."""
    split, _, index = task_id.rpartition("-")
    if split not in SPLITS or not index.isdigit() or int(index) >= self.split_size(split):
      raise ValueError(f"sokoban: unknown task id {task_id!r}; expected e.g. 'train-00042' "
                       f"(see task_ids(split){'' if not self.train_levels else f'; train_levels={self.train_levels}'})")
    return SPLITS[split][0] + int(index)

  def reset(self, *, seed: int | None = None, options: dict | None = None):
    super().reset(seed=seed)
    task_id = (options or {}).get("task_id")
    if task_id:
      level_seed = self.level_seed(task_id)
    else:  # plain gymnasium use: the seed picks the level
      level_seed = seed if seed is not None else int(self.np_random.integers(2**31))
    self._level = generate_level(level_seed, self.dim, self.num_boxes)
    self._player, self._boxes = self._level.player, set(self._level.boxes)
    self._steps = 0
    info = self._info()
    info["walkthrough"] = " ".join(self._level.walkthrough)
    return f"{INSTRUCTIONS}\n{self._observation('')}", info

  def step(self, action: str):
    if self._level is None:
      raise RuntimeError("sokoban: step() before reset(); call reset() first")
    self._steps += 1
    name = action.strip().lower()
    if name not in MOVES:
      message = f"Invalid action {action[:40]!r}; valid actions: up, down, left, right."
    elif name not in self._admissible():
      message = f"You cannot move {name}."
    else:
      message = ""
      d = MOVES[name]
      self._player = _add(self._player, d)
      if self._player in self._boxes:
        self._boxes.remove(self._player)
        self._boxes.add(_add(self._player, d))
    won = self._boxes == self._level.targets
    truncated = not won and self._steps >= self.max_steps
    info = self._info()
    return self._observation(message), SOLVED_REWARD if won else 0.0, won, truncated, info

  def _admissible(self) -> list[str]:
    floor, out = self._level.floor, []
    for name, d in MOVES.items():
      nxt = _add(self._player, d)
      if nxt in floor and (nxt not in self._boxes or
                           (_add(nxt, d) in floor and _add(nxt, d) not in self._boxes)):
        out.append(name)
    return out

  def _grid(self) -> str:
    rows = []
    for y in range(self.dim):
      row = []
      for x in range(self.dim):
        c = (x, y)
        on_target = c in self._level.targets
        if c not in self._level.floor:
          row.append("#")
        elif c == self._player:
          row.append("+" if on_target else "@")
        elif c in self._boxes:
          row.append("*" if on_target else "$")
        else:
          row.append("." if on_target else "_")
      rows.append("".join(row))
    return "\n".join(rows)

  def _observation(self, message: str) -> str:
    done = len(self._boxes & self._level.targets)
    prefix = f"{message}\n" if message else ""
    return f"{prefix}{self._grid()}\nBoxes on targets: {done}/{self.num_boxes}."

  def _info(self) -> dict:
    on_target = len(self._boxes & self._level.targets)
    return {
        base.ANCHOR_OBS: self._grid(),
        base.ADMISSIBLE: self._admissible(),
        base.WON: self._boxes == self._level.targets,
        base.TASK_TYPE: "sokoban",
        base.SCORE: on_target / self.num_boxes,
    }


POLICIES = ("uniform", "no-undo")


def random_play(split: str, episodes: int, dim: int = 6, num_boxes: int = 1,
                horizons: tuple[int, ...] = (10, 15, 20),
                policy: str = "uniform", train_levels: int = 0) -> dict[int, float]:
  """Success rate of uniform-random play over the admissible moves within each horizon,
  one episode per level of the split's first `episodes` levels (seeded by the task id:
  deterministic). The reference point of a policy's untrained success. A split with fewer
  levels than `episodes` (`train_levels`) is played round-robin, episode i of a level
  seeded by its task id and i.

  policy="no-undo" draws uniformly among the admissible moves other than the reverse of
  the previous move (unless it is the only one): what a policy gains by learning only
  not to oscillate."""
  if policy not in POLICIES:
    raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
  env = SokobanEnv(dim=dim, num_boxes=num_boxes, max_steps=max(horizons),
                   train_levels=train_levels)
  wins = dict.fromkeys(horizons, 0)
  levels = env.task_ids(split)
  task_ids = [levels[i % len(levels)] for i in range(episodes)]
  for i, task_id in enumerate(task_ids):
    rng = random.Random(f"random-play/{task_id}" + (f"/{i}" if i >= len(levels) else ""))
    env.reset(options={"task_id": task_id})
    last = None
    for step in range(1, max(horizons) + 1):
      moves = env._admissible()
      if policy == "no-undo" and last is not None and len(moves) > 1:
        moves = [m for m in moves if m != OPPOSITE[last]]
      last = rng.choice(moves)
      _, _, won, truncated, _ = env.step(last)
      if won:
        for h in horizons:
          wins[h] += step <= h
        break
      if truncated:
        break
  return {h: wins[h] / len(task_ids) for h in horizons}


def shortest_solution(level: Level, max_moves: int) -> int | None:
  """Fewest moves that solve `level` (breadth-first over player and box cells), or None
  when no solution has at most `max_moves` moves."""
  floor, targets = level.floor, level.targets
  start = (level.player, frozenset(level.boxes))
  seen, frontier = {start}, [start]
  for depth in range(1, max_moves + 1):
    nxt_frontier = []
    for player, boxes in frontier:
      for d in MOVES.values():
        p = _add(player, d)
        if p not in floor:
          continue
        if p in boxes:
          q = _add(p, d)
          if q not in floor or q in boxes:
            continue
          new_boxes = (boxes - {p}) | {q}
          if new_boxes == targets:
            return depth
        else:
          new_boxes = boxes
        state = (p, new_boxes)
        if state not in seen:
          seen.add(state)
          nxt_frontier.append(state)
    frontier = nxt_frontier
    if not frontier:
      return None
  return None


def level_stats(split: str, levels: int, dim: int = 6, num_boxes: int = 1,
                horizons: tuple[int, ...] = (10, 15, 20)) -> dict:
  """Over the split's first `levels` levels: the walkthrough's length and pushes (the
  generator's solution, not a shortest one), the shortest solution's length (BFS up to
  max(horizons) moves) and the share of levels solvable within each horizon (the ceiling
  of any policy's success)."""
  import statistics
  env = SokobanEnv(dim=dim, num_boxes=num_boxes)
  lengths, pushes, shortest = [], [], []
  for task_id in env.task_ids(split)[:levels]:
    level = generate_level(env.level_seed(task_id), dim, num_boxes)
    player, boxes, n_push = level.player, set(level.boxes), 0
    for name in level.walkthrough:
      player = _add(player, MOVES[name])
      if player in boxes:
        boxes.remove(player)
        boxes.add(_add(player, MOVES[name]))
        n_push += 1
    lengths.append(len(level.walkthrough))
    pushes.append(n_push)
    shortest.append(shortest_solution(level, max(horizons)))
  solved = [s for s in shortest if s is not None]
  return {
      "walkthrough_median": statistics.median(lengths),
      "pushes_median": statistics.median(pushes),
      "shortest_median": statistics.median(solved) if solved else None,
      "solvable": {h: sum(s is not None and s <= h for s in shortest) / len(shortest)
                   for h in horizons},
  }


def main(argv: list[str] | None = None) -> int:
  import argparse
  parser = argparse.ArgumentParser(description="Text Sokoban: uniform-random play over the "
                                   "admissible moves (the untrained-policy reference).")
  parser.add_argument("--random-play", type=int, required=True, metavar="LEVELS",
                      help="levels played, one episode each (the split's first LEVELS)")
  parser.add_argument("--split", default="train", choices=sorted(SPLITS))
  parser.add_argument("--dim", type=int, default=6)
  parser.add_argument("--boxes", type=int, default=1)
  parser.add_argument("--horizons", default="10,15,20")
  parser.add_argument("--policy", default="uniform", choices=POLICIES,
                      help="no-undo: never reverse the previous move (unless forced)")
  parser.add_argument("--train-levels", type=int, default=0, metavar="N",
                      help="the train split's first N levels only, played round-robin")
  parser.add_argument("--stats", action="store_true",
                      help="also print the walkthrough's median length and pushes, the "
                      "shortest solution's median length and the share of levels "
                      "solvable within each horizon (BFS)")
  args = parser.parse_args(argv)
  try:
    horizons = tuple(int(h) for h in args.horizons.split(","))
    rates = random_play(args.split, args.random_play, args.dim, args.boxes, horizons,
                        args.policy, args.train_levels)
    stats = (level_stats(args.split, args.random_play, args.dim, args.boxes, horizons)
             if args.stats else None)
  except ValueError as e:
    parser.exit(2, f"sokoban: {e}\n")
  policy = "" if args.policy == "uniform" else f", policy {args.policy}"
  levels = (f"{args.random_play} episodes on its first {args.train_levels} levels"
            if args.train_levels and args.split == "train" else f"{args.random_play} levels")
  print(f"sokoban {args.dim}x{args.dim}, {args.boxes} box(es), split {args.split}, "
        f"{levels}{policy}: " +
        ", ".join(f"{100 * r:.1f} % within {h} steps" for h, r in rates.items()))
  if stats:
    print(f"  walkthrough median {stats['walkthrough_median']} moves, "
          f"{stats['pushes_median']} pushes; shortest solution median "
          f"{stats['shortest_median']} moves; solvable: " +
          ", ".join(f"{100 * r:.1f} % within {h}" for h, r in stats["solvable"].items()))
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
