r"""ALFWorld-mini: a named, versioned, frozen set of small ALFWorld-format games.

The CPU-scale benchmark suite (docs/environments.md) needs ALFWorld games that the tiny
policy can learn on a 2-core machine and on which the estimators can still differ:
richer than the two 4-step rooms of tests/test_learning.py, far smaller than full
ALFRED rooms (20-40 receptacles, 30-50 admissible actions). Each game here is a real
ALFRED floor plan cut down to

  * 3-4 receptacles (mini_v1; one instance per class): the ones the task needs (where the target
    lies, the goal receptacle, the sink/fridge/microwave of a state-change task, the
    furniture carrying the lamp) plus random other receptacles of the room;
  * the target object class plus 1-2 distractor object classes (1-2 instances each);
  * a plan of 4-10 steps (Fast Downward, replayed in the engine: a checked walkthrough).

Task types cycle over `SUITE.task_types` (index % n). Train games use ALFWorld's TRAIN
rooms; `valid_seen` draws other games on the same rooms; `valid_unseen` uses the
held-out TEST rooms (ALFWorld's out-of-distribution split). Every game is drawn from
`random.Random(f"alfworld-mini/{version}/{split}/{index}")`, so the files are
regenerated bit-identically by

  python -m env_servers.alfworld.mini --out env_servers/alfworld/data/mini_v1

(`--check` regenerates into a temporary folder and compares the bytes with the
committed files instead). Play them with `AlfworldEnv(data_dir=<that folder>)`, i.e. in
a config `--config.env.args.data_dir=env_servers/alfworld/data/mini_v1` (a folder of
`<split>.json.gz` files is read as a frozen set).

mini_v1: 48 train, 16 valid_seen, 24 valid_unseen games, 45 KB gzip; plans of 4-8 steps
(mean 4.8). mini_v2 (the suite's version): 2 / 2 / 12 games; see MINI_V2 below. Generation: `time python -m env_servers.alfworld.mini` took 58.5 s wall
(13.6 s CPU) for the 88 games on the shared 2-core machine under load. A new suite
version (different counts, types or sizes) gets a new name; the files of a published
version never change.
"""

from __future__ import annotations

import argparse
import dataclasses
import filecmp
import os
import random
import sys
import tempfile
import time

from env_servers.alfworld import games
from env_servers.alfworld import generator


@dataclasses.dataclass(frozen=True)
class Suite:
  """What a suite version is made of (changing any field means a new version name)."""

  version: str
  task_types: tuple[str, ...]
  counts: tuple[tuple[str, int], ...]  # (split, number of games)
  receptacles: tuple[int, int]  # inclusive range of receptacles kept per room
  distractor_classes: tuple[int, int]  # inclusive range of non-target object classes
  plan_steps: tuple[int, int]  # inclusive range of walkthrough lengths
  # The version whose random streams draw the games (default: this version). A version
  # that only adds games to another's splits draws with that version's streams, so its
  # first games are the other version's games, byte for byte.
  seed_version: str | None = None

  @property
  def num_games(self) -> int:
    return sum(n for _, n in self.counts)


# Sized by uniform-random play over the admissible actions (the untrained tiny policy
# with constrained decoding plays about like it: 16 % vs 17 % on the learning test's
# rooms, tests/test_learning.py). mini_v1, 8 episodes per game,
# `python -m env_servers.alfworld.mini --random-play 8 --split train` (and valid_unseen):
#   train:        1.0 / 3.4 / 6.0 / 10.7 % within 10 / 14 / 20 / 30 steps (108 s)
#   valid_unseen: 1.0 / 2.1 / 4.2 /  7.8 %
# The suite plays 20 steps. pick_and_place_simple is listed twice: half the games are
# the shortest task type (placing). The tiny-policy calibration is iteration 1 of the sweep.
SUITE = Suite(
    version="mini_v1",
    task_types=("pick_and_place_simple", "look_at_obj_in_light", "pick_and_place_simple",
                "pick_clean_then_place_in_recep"),
    counts=(("train", 48), ("valid_seen", 16), ("valid_unseen", 24)),
    receptacles=(3, 4),
    distractor_classes=(1, 2),
    plan_steps=(4, 10),
)
MINI_V1 = SUITE
# mini_v2: sized for the CPU suite's budget (launch/experiments/suites.py: 14 iterations x 16
# trajectories x 12 steps, the 2-layer tiny policy). Only the receptacles the task needs
# (2-3), no distractor class, plans of 4-6 steps (the 12-step horizon is 2x the longest);
# 2 train games (placing, lamp) and 12 held-out games of three task types on unseen
# rooms. Richer candidates (9 or 4 train games, 3 receptacles, a distractor class) were
# not learned within the budget (results/suite_calibration.md lists the calibration runs).
# Uniform-random play over the admissible list with look/inventory/examine hidden, as the
# suite plays it (`--random-play 32 --hide-actions look,inventory,examine`): train
# 17.2 % within 12 steps.
MINI_V2 = Suite(
    version="mini_v2",
    task_types=("pick_and_place_simple", "look_at_obj_in_light", "pick_and_place_simple",
                "pick_clean_then_place_in_recep"),
    counts=(("train", 2), ("valid_seen", 2), ("valid_unseen", 12)),
    receptacles=(2, 3),
    distractor_classes=(0, 0),
    plan_steps=(4, 6),
)
# mini_v3: mini_v2 with 48 held-out games instead of 12, so that one held-out game is
# 2.1 points of success instead of 8.3 (results tables: the detectable difference). Drawn
# with mini_v2's streams: the train and valid_seen games and the first 12 valid_unseen
# games are mini_v2's (tests/env_servers compare the bytes).
MINI_V3 = dataclasses.replace(
    MINI_V2, version="mini_v3", seed_version="mini_v2",
    counts=(("train", 2), ("valid_seen", 2), ("valid_unseen", 48)))
# mini_v4: mini_v3 with 64 train games instead of 2, for a pretrained policy that reads the
# task: the same four-type cycle on ALFWorld's TRAIN rooms, the same 48 held-out games.
# A 2-layer random-init policy learns two rooms by heart; a language model can learn the
# task types' procedures, which only many rooms teach. Drawn with mini_v2's streams: the
# first 2 train games, the valid_seen games and all 48 held-out games are mini_v3's.
MINI_V4 = dataclasses.replace(
    MINI_V2, version="mini_v4", seed_version="mini_v2",
    counts=(("train", 64), ("valid_seen", 2), ("valid_unseen", 48)))
SUITE = MINI_V3  # the CPU suite's version: the default of the command line
SUITES = {s.version: s for s in (MINI_V1, MINI_V2, MINI_V3, MINI_V4)}
# The receptacle a state-change task needs (the PDDL domain's Clean/Heat/CoolObject).
_TOOL = {"pick_clean_then_place_in_recep": "SinkBasin",
         "pick_heat_then_place_in_recep": "Microwave",
         "pick_cool_then_place_in_recep": "Fridge"}
_MAX_ATTEMPTS = 200


def suite_dir(version: str = SUITE.version) -> str:
  """Folder of the committed files of a suite version (package data)."""
  if version not in SUITES:
    raise ValueError(f"unknown ALFWorld-mini suite {version!r}; known: {sorted(SUITES)}")
  return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", version)


def reduce_room(room: generator.Room, keep_receptacles: list[tuple[str, str, bool]],
                keep_objects: list[str]) -> generator.Room:
  """`room` with only the given receptacle instances and object classes."""
  rcls = {r[1] for r in keep_receptacles}
  objs = set(keep_objects)
  return dataclasses.replace(
      room, receptacles=tuple(sorted(keep_receptacles)),
      object_props={o: room.object_props[o] for o in sorted(objs)},
      can_contain={r: tuple(o for o in room.can_contain[r] if o in objs)
                   for r in sorted(rcls) if r in room.can_contain})


def _first_of_class(room: generator.Room) -> dict[str, tuple[str, str, bool]]:
  out = {}
  for recep in room.receptacles:
    out.setdefault(recep[1], recep)
  return out


def sample_small_room(task_type: str, room: generator.Room, suite: Suite, rng: random.Random
                      ) -> tuple[generator.Room, tuple[str, str, str]] | None:
  """A reduced copy of `room` and a task (object, goal receptacle, lamp) in it, or None."""
  target = generator.sample_task(task_type, room, rng)
  if target is None:
    return None
  obj, goal, lamp = target
  by_class = _first_of_class(room)
  required = []
  if goal:
    required.append(goal)
  if task_type in _TOOL:
    required.append(_TOOL[task_type])
  if lamp:
    lamp_hosts = sorted({h[1] for h in room.hosts(lamp)})
    if not lamp_hosts:
      return None
    required.append(rng.choice(lamp_hosts))
  sources = sorted({h[1] for h in room.hosts(obj)} - set(required) - {goal})
  if not sources:
    return None
  required.append(rng.choice(sources))
  required = list(dict.fromkeys(required))
  lo, hi = suite.receptacles
  n = rng.randint(max(lo, len(required)), max(hi, len(required)))
  others = sorted(set(by_class) - set(required))
  extra = rng.sample(others, min(len(others), n - len(required)))
  keep = [by_class[c] for c in required + extra]
  if len(keep) < lo:
    return None
  kept_classes = {r[1] for r in keep}
  # Distractors: pickupable classes with a host among the kept receptacles.
  candidates = sorted(o for o, p in room.object_props.items()
                      if "pickupable" in p and o not in (obj, lamp)
                      and any(r in kept_classes and o in room.can_contain.get(r, ())
                              for r in kept_classes))
  dlo, dhi = suite.distractor_classes
  if len(candidates) < dlo:
    return None
  distractors = rng.sample(candidates, min(len(candidates), rng.randint(dlo, dhi)))
  small = reduce_room(room, keep, [obj] + ([lamp] if lamp else []) + distractors)
  # The target still needs a starting place outside the goal class in the small room.
  if not [h for h in small.hosts(obj) if h[1] != goal]:
    return None
  return small, target


def generate_game(split: str, index: int, suite: Suite = SUITE) -> games.GameRecord:
  """The `index`-th game of `split` in `suite`; deterministic in (version, split, index)."""
  c = generator._constants()
  task_type = suite.task_types[index % len(suite.task_types)]
  rooms = [r for r in generator.split_rooms(split)
           if generator._room_kind(r) in c.GOALS_VALID[task_type]]
  rng = random.Random(f"alfworld-mini/{suite.seed_version or suite.version}/{split}/{index}")
  for _ in range(_MAX_ATTEMPTS):
    room = generator.load_room(rng.choice(rooms))
    sampled = sample_small_room(task_type, room, suite, rng)
    if sampled is None:
      continue
    small, (obj, goal, lamp) = sampled
    record = games.GameRecord(
        split=split, trial=f"trial_{suite.seed_version or suite.version}_{index:05d}",
        task_type=task_type,
        floorplan=room.floorplan,
        pddl_params={"object_target": obj, "parent_target": goal, "toggle_target": lamp,
                     "mrecep_target": "", "object_sliced": False},
        task_sentence=generator.task_sentence(task_type, obj, goal, lamp, rng),
        pddl_problem=generator.build_problem(task_type, small, (obj, goal, lamp), rng),
        walkthrough=())
    plan = generator.plan_walkthrough(record.game_json())
    lo, hi = suite.plan_steps
    if plan and lo <= len(plan) <= hi:
      return dataclasses.replace(record, walkthrough=tuple(plan))
  raise RuntimeError(f"no solvable {task_type} game with a {suite.plan_steps} step plan for "
                     f"{suite.version} {split} index={index} after {_MAX_ATTEMPTS} attempts")


def write_suite(out_dir: str, suite: Suite = SUITE, splits: tuple[str, ...] | None = None,
                limit: int | None = None, log=print) -> dict[str, float]:
  """Writes `<out_dir>/<split>.json.gz` per split (the first `limit` games if given).

  Returns seconds spent per split. `limit` writes a prefix of the split (for tests: the
  committed file is compared with `write_suite(..., limit=None)` only).
  """
  from env_servers.alfworld import speedup
  speedup.apply()  # the walkthrough replay steps the engine
  seconds = {}
  for split, num in suite.counts:
    if splits is not None and split not in splits:
      continue
    n = num if limit is None else min(num, limit)
    t0 = time.perf_counter()
    records = [generate_game(split, i, suite) for i in range(n)]
    path = os.path.join(out_dir, f"{split}.json.gz")
    games.save_frozen(records, path, split=split, suite=suite.version, num=n,
                      task_types=list(suite.task_types), receptacles=list(suite.receptacles),
                      distractor_classes=list(suite.distractor_classes),
                      plan_steps=list(suite.plan_steps))
    seconds[split] = time.perf_counter() - t0
    lengths = [len(r.walkthrough) for r in records]
    log(f"{suite.version} {split}: {n} games, plan length {min(lengths)}-{max(lengths)} "
        f"(mean {sum(lengths) / n:.1f}), {seconds[split]:.1f} s ({seconds[split] / n:.2f} s/game) "
        f"-> {path}")
  return seconds


def check(version: str = SUITE.version, committed_dir: str | None = None) -> list[str]:
  """Regenerates the suite into a temporary folder; returns the files that differ."""
  committed_dir = committed_dir or suite_dir(version)
  with tempfile.TemporaryDirectory() as tmp:
    write_suite(tmp, SUITES[version])
    names = [f"{s}.json.gz" for s, _ in SUITES[version].counts]
    return [n for n in names if not os.path.isfile(os.path.join(committed_dir, n))
            or not filecmp.cmp(os.path.join(tmp, n), os.path.join(committed_dir, n), shallow=False)]


def random_play(data_dir: str, split: str, episodes: int,
                horizons: tuple[int, ...] = (10, 12, 15, 20, 30), hide_actions: str = ""
                ) -> dict[int, float]:
  """Success rate of uniform-random play over the admissible actions within each horizon
  (`episodes` per game, seeded by task id and episode: deterministic)."""
  from env_servers.alfworld import env as env_lib
  env = env_lib.AlfworldEnv(data_dir=data_dir, max_steps=max(horizons), hide_actions=hide_actions)
  wins = {h: 0 for h in horizons}
  n = 0
  try:
    for task_id in env.task_ids(split):
      for episode in range(episodes):
        rng = random.Random(f"{task_id}/{episode}")
        _, info = env.reset(options={"task_id": task_id})
        for t in range(1, max(horizons) + 1):
          _, _, won, truncated, info = env.step(rng.choice(info["admissible_actions"]))
          if won:
            for h in horizons:
              wins[h] += t <= h
          if won or truncated:
            break
        n += 1
  finally:
    env.close()
  return {h: wins[h] / n for h in horizons}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--suite", default=SUITE.version, choices=sorted(SUITES))
  parser.add_argument("--out", help="output folder for <split>.json.gz (default: the "
                                    "committed folder env_servers/alfworld/data/<suite>)")
  parser.add_argument("--check", action="store_true",
                      help="regenerate into a temporary folder and compare with the committed "
                           "files (exit 1 if any byte differs)")
  parser.add_argument("--random-play", type=int, default=0, metavar="EPISODES",
                      help="instead: success of uniform-random play (EPISODES per game) on "
                           "--split of the committed files, within 10/12/15/20/30 steps")
  parser.add_argument("--split", default="train", choices=games.SPLITS)
  parser.add_argument("--hide-actions", default="",
                      help="with --random-play: command prefixes left out of the admissible "
                           "list (AlfworldEnv hide_actions), e.g. look,inventory,examine")
  args = parser.parse_args(argv)
  if args.random_play:
    t0 = time.perf_counter()
    rates = random_play(args.out or suite_dir(args.suite), args.split, args.random_play,
                        hide_actions=args.hide_actions)
    print(f"{args.suite} {args.split}, uniform-random play, {args.random_play} episodes/game: "
          + ", ".join(f"{100 * r:.1f} % within {h}" for h, r in rates.items())
          + f" ({time.perf_counter() - t0:.0f} s)")
    return 0
  if args.check:
    bad = check(args.suite, args.out)
    print("identical" if not bad else f"differ: {bad}")
    return 1 if bad else 0
  t0 = time.perf_counter()
  write_suite(args.out or suite_dir(args.suite), SUITES[args.suite])
  print(f"{args.suite}: {SUITES[args.suite].num_games} games in {time.perf_counter() - t0:.1f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
