"""Procedural ALFWorld-format games on ALFRED's 120 floor plans (no download needed).

The `alfworld` wheel ships no game files, but it ships what a game is made of: for each
ALFRED room the receptacle instances with their THOR ids (`gen/layouts/FloorPlanN-
openable.json`) and the object classes present (`FloorPlanN-objects.json`), the
compatibility tables (`gen/constants.py`: VAL_RECEPTACLE_OBJECTS, VAL_ACTION_OBJECTS,
GOALS_VALID, TRAIN/TEST_SCENE_NUMBERS), and the goal formulas and sentence templates
(`gen/goal_library.py`). A game here is:

  1. a room: one floor plan valid for the task type (GOALS_VALID), from the split's rooms
     (train, valid_seen: TRAIN_SCENE_NUMBERS; valid_unseen: TEST_SCENE_NUMBERS);
  2. a task: target object class (+ goal receptacle or lamp) that the room supports;
  3. object placements sampled from VAL_RECEPTACLE_OBJECTS (never pre-solved);
  4. the PDDL problem with goal_library's goal formula and a goal_library sentence;
  5. a solvability check: the bundled Fast Downward planner (TextWorld's `replan`) finds
     a plan, and replaying that plan in the engine wins; the plan is the walkthrough.

Everything is drawn from `random.Random(f"alfworld/{split}/{seed}/{index}")`, so a
(split, seed, index) triple gives a byte-identical problem in any process, and the train
and valid_seen streams (same rooms) are independent draws. What differs from the released
ALFWorld games (docs/environments.md, "What is and is not comparable"): placements and counts are sampled, not
taken from ALFRED's THOR trajectories; receptacles that a room lists in objects.json but
not in openable.json get one instance; there are no human-written goal sentences. Scores
on these games are not comparable to published ALFWorld numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import random
from typing import Callable, Iterator, Mapping

from env_servers.alfworld import games

# Types the domain names as constants: every problem must declare them.
_DOMAIN_RTYPES = ("SinkBasin", "Microwave", "Fridge")
_DOMAIN_OTYPES = ("Knife", "ButterKnife")
# The receptacle class a state-change task needs (the domain's Clean/Heat/CoolObject).
_TOOL = {
    "pick_clean_then_place_in_recep": "SinkBasin",
    "pick_heat_then_place_in_recep": "Microwave",
    "pick_cool_then_place_in_recep": "Fridge",
}
_NEEDS = {
    "pick_clean_then_place_in_recep": "cleanable",
    "pick_heat_then_place_in_recep": "heatable",
    "pick_cool_then_place_in_recep": "coolable",
}
_LAMPS = ("DeskLamp", "FloorLamp")
# Lamps stand on furniture in ALFRED rooms; the domain's ToggleObject needs a host.
_LAMP_HOSTS = ("Desk", "SideTable", "Dresser", "Shelf", "DiningTable", "CoffeeTable",
               "CounterTop", "TVStand")
_AGENT_START = "loc_bar__minus_20_bar__minus_20_bar_0_bar_30"  # no receptacle: ALFWorld's intro
_MAX_ATTEMPTS = 50


def _constants():
  # alfworld.gen.constants is a plain data module (no THOR, no spaCy).
  import alfworld.gen.constants as c
  return c


def split_rooms(split: str) -> tuple[int, ...]:
  """Floor plans a split draws rooms from (ALFWorld's seen/unseen scene partition)."""
  c = _constants()
  if split in ("train", "valid_seen"):
    return tuple(c.TRAIN_SCENE_NUMBERS)
  if split == "valid_unseen":
    return tuple(c.TEST_SCENE_NUMBERS)
  raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {list(games.SPLITS)}")


def _room_kind(floorplan: int) -> str:
  for kind, numbers in _constants().SCENE_TYPE.items():
    if floorplan in numbers:
      return kind
  raise ValueError(f"FloorPlan{floorplan} is not an ALFRED floor plan")


def _pddl_name(thor_id: str) -> str:
  """THOR id -> PDDL name, ALFWorld's mangling (undone by AlfredDemangler)."""
  for a, b in (("|", "_bar_"), ("-", "_minus_"), ("+", "_plus_"), (".", "_dot_")):
    thor_id = thor_id.replace(a, b)
  return thor_id


def _synthetic_id(cls: str, k: int, salt: int) -> str:
  """A THOR-like id for an instance the layout files do not list.

  Basins follow ALFRED's `Sink|x|y|z|SinkBasin` form: the demangler names an id
  containing "basin" after its first part plus "basin" (so "sinkbasin 1").
  """
  pos = f"+{salt:02d}.{k:02d}|+00.90|-{salt:02d}.{k:02d}"
  if cls.endswith("Basin"):
    return f"{cls[:-len('Basin')]}|{pos}|{cls}"
  return f"{cls}|{pos}"


@dataclasses.dataclass(frozen=True)
class Room:
  """An ALFRED room as the generator sees it.

  Attributes:
    floorplan: ALFRED floor-plan number.
    kind: "Kitchen", "LivingRoom", "Bedroom" or "Bathroom".
    receptacles: (PDDL name, class, openable) per receptacle instance, sorted.
    object_props: object class -> PDDL properties (pickupable, heatable, ..., toggleable).
    can_contain: receptacle class -> pickupable object classes it may hold.
  """

  floorplan: int
  kind: str
  receptacles: tuple[tuple[str, str, bool], ...]
  object_props: Mapping[str, frozenset[str]]
  can_contain: Mapping[str, tuple[str, ...]]

  def hosts(self, obj_cls: str) -> list[tuple[str, str, bool]]:
    """Receptacle instances that may hold `obj_cls` (lamps: furniture)."""
    if obj_cls in _LAMPS:
      return [r for r in self.receptacles if r[1] in _LAMP_HOSTS]
    return [r for r in self.receptacles if obj_cls in self.can_contain.get(r[1], ())]


@functools.cache
def load_room(floorplan: int) -> Room:
  """Builds a room from the layout files and constants in the alfworld wheel."""
  c = _constants()
  layout_dir = os.path.join(os.path.dirname(c.__file__), "layouts")
  prefix = os.path.join(layout_dir, f"FloorPlan{floorplan}")
  try:
    with open(f"{prefix}-openable.json", encoding="utf-8") as f:
      recep_ids = sorted(json.load(f))
    with open(f"{prefix}-objects.json", encoding="utf-8") as f:
      classes = sorted(set(json.load(f)))
  except FileNotFoundError as e:
    raise ValueError(f"FloorPlan{floorplan} layout not found in the alfworld wheel ({e})") from e
  receptacles = []
  for rid in recep_ids:
    parts = rid.split("|")
    cls = parts[-1] if len(parts) == 5 else parts[0]  # 'Sink|x|y|z|SinkBasin' -> SinkBasin
    receptacles.append((_pddl_name(rid), cls, cls in c.OPENABLE_CLASS_SET))
  present = {cls for _, cls, _ in receptacles}
  extra = [cls for cls in classes if cls in c.VAL_RECEPTACLE_OBJECTS and cls not in present
           and cls not in c.MOVABLE_RECEPTACLES_SET]
  for k, cls in enumerate(extra):
    receptacles.append((_pddl_name(_synthetic_id(cls, k, 90)), cls, cls in c.OPENABLE_CLASS_SET))
  receptacles.sort()
  room_rcls = {cls for _, cls, _ in receptacles}
  containable = set().union(*(c.VAL_RECEPTACLE_OBJECTS[r] for r in room_rcls))
  actions = c.VAL_ACTION_OBJECTS
  props = {}
  for cls in classes:
    if cls in _LAMPS:
      props[cls] = frozenset({"toggleable"})
    elif (cls in containable and "Sliced" not in cls
          and (cls not in c.RECEPTACLES or cls in c.MOVABLE_RECEPTACLES_SET)):
      p = {"pickupable"}
      for prop, table in (("heatable", "Heatable"), ("coolable", "Coolable"),
                          ("cleanable", "Cleanable"), ("sliceable", "Sliceable")):
        if cls in actions[table]:
          p.add(prop)
      props[cls] = frozenset(p)
  pickupable = {o for o, p in props.items() if "pickupable" in p}
  can_contain = {r: tuple(sorted(o for o in c.VAL_RECEPTACLE_OBJECTS[r] if o in pickupable))
                 for r in sorted(room_rcls)}
  return Room(floorplan, _room_kind(floorplan), tuple(receptacles), props, can_contain)


def sample_task(task_type: str, room: Room,
                rng: random.Random) -> tuple[str, str, str] | None:
  """(object class, goal receptacle class, lamp class) valid in `room`, or None."""
  props = room.object_props
  if task_type == "look_at_obj_in_light":
    lamps = sorted(c for c in props if "toggleable" in props[c] and room.hosts(c))
    objs = sorted(c for c in props if "pickupable" in props[c] and room.hosts(c))
    if not lamps or not objs:
      return None
    return rng.choice(objs), "", rng.choice(lamps)
  tool = _TOOL.get(task_type)
  if tool and tool not in room.can_contain:
    return None
  need = _NEEDS.get(task_type, "pickupable")
  movable = _constants().MOVABLE_RECEPTACLES_SET
  options = []
  for recep, objs in sorted(room.can_contain.items()):
    if recep == tool or recep in movable:
      continue
    for obj in objs:
      # The target must have a starting place outside the goal receptacle class.
      if need in props[obj] and any(h[1] != recep for h in room.hosts(obj)):
        options.append((obj, recep))
  if not options:
    return None
  obj, recep = rng.choice(options)
  return obj, recep, ""


def _goal_pddl(task_type: str, obj: str, recep: str, toggle: str) -> str:
  """goal_library's goal formula (ALFRED writes '#' for PDDL's '-'); closes the problem."""
  import alfworld.gen.goal_library as glib
  text = glib.gdict[task_type]["pddl"].format(obj=obj, recep=recep, toggle=toggle, mrecep="")
  return "\n".join(line.rstrip() for line in text.replace("#", "-").strip().splitlines())


def task_sentence(task_type: str, obj: str, recep: str, toggle: str, rng: random.Random) -> str:
  """A goal_library sentence, filled in like ALFWorld's get_templated_task_desc."""
  import alfworld.gen.goal_library as glib
  template = rng.choice(glib.gdict[task_type]["templates"])
  return template.format(obj=obj.lower(), recep=recep.lower(), toggle=toggle.lower(), mrecep="")


def build_problem(task_type: str, room: Room, target: tuple[str, str, str],
                  rng: random.Random) -> str:
  """The PDDL problem: objects placed by `rng`, the goal from goal_library."""
  obj_cls, recep_cls, toggle_cls = target
  placed = []  # (PDDL name, class, host receptacle name)
  counts: dict[str, int] = {}

  def place(cls: str, n: int, forbid: str = "") -> None:
    hosts = [h for h in room.hosts(cls) if h[1] != forbid]
    for _ in range(n):
      counts[cls] = counts.get(cls, 0) + 1
      host = rng.choice(hosts)[0]
      placed.append((_pddl_name(_synthetic_id(cls, counts[cls], len(placed) % 90)), cls, host))

  if task_type == "look_at_obj_in_light":
    place(toggle_cls, 1)
    place(obj_cls, 1 + rng.randint(0, 1))
  else:
    base = 2 if task_type == "pick_two_obj_and_place" else 1
    place(obj_cls, base + rng.randint(0, 1), forbid=recep_cls)  # never pre-solved
  others = sorted(c for c, p in room.object_props.items()
                  if "pickupable" in p and c != obj_cls and room.hosts(c))
  for cls in rng.sample(others, min(len(others), rng.randint(8, 14))):
    place(cls, rng.randint(1, 2))

  locs = {name: f"loc_bar_{k}_bar_{k % 7}_bar_{k % 4}_bar_30"
          for k, (name, _, _) in enumerate(room.receptacles)}
  otypes = sorted({cls for _, cls, _ in placed} | set(room.object_props) | set(_DOMAIN_OTYPES))
  rtypes = sorted({cls for _, cls, _ in room.receptacles} | set(_DOMAIN_RTYPES))
  lines = ["(define (problem plan_trial)", "(:domain alfred)", "(:objects", "agent1 - agent"]
  lines += [f"{t}Type - otype" for t in otypes]
  lines += [f"{t}Type - rtype" for t in rtypes]
  lines += [f"{name} - object" for name, _, _ in placed]
  lines += [f"{name} - receptacle" for name, _, _ in room.receptacles]
  lines += [f"{loc} - location" for loc in [*locs.values(), _AGENT_START]]
  lines += [")", "(:init", f"(atLocation agent1 {_AGENT_START})"]
  for name, cls, openable in room.receptacles:
    lines.append(f"(receptacleType {name} {cls}Type)")
    lines.append(f"(receptacleAtLocation {name} {locs[name]})")
    if openable:
      lines.append(f"(openable {name})")
  for rcls, ocls in room.can_contain.items():
    lines += [f"(canContain {rcls}Type {o}Type)" for o in ocls]
  for name, cls, host in placed:
    lines.append(f"(objectType {name} {cls}Type)")
    lines.append(f"(inReceptacle {name} {host})")
    lines.append(f"(objectAtLocation {name} {locs[host]})")
    lines += [f"({p} {name})" for p in sorted(room.object_props[cls])]
  lines.append(")")
  lines.append(_goal_pddl(task_type, obj_cls, recep_cls, toggle_cls))
  return "\n".join(lines) + "\n"


def plan_walkthrough(game_json: Mapping) -> list[str]:
  """Fast Downward plan (demangled commands) that wins the game, or [] if none.

  The plan is replayed in the engine and kept only if it wins, so a stored walkthrough
  is a checked solution, not just the planner's claim.
  """
  import textworld
  from textworld.envs import PddlEnv
  from alfworld.agents.environment.alfred_tw_env import AlfredDemangler

  env = AlfredDemangler(PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True,
                                                   policy_commands=True)), shuffle=False)
  env.load(dict(game_json))
  state = env.reset()
  plan = list(state["policy_commands"] or [])
  env.request_infos.policy_commands = False  # replanning every step is the slow part
  won = False
  for cmd in plan:
    if cmd not in state["admissible_commands"]:
      return []
    state, _, done = env.step(cmd)
    won = bool(state["won"])
    if done:
      break
  env.close()
  return plan if won else []


def generate_game(split: str, seed: int, index: int,
                  max_receptacles: int | None = None) -> games.GameRecord:
  """The `index`-th game of (split, seed); deterministic.

  Task types cycle in ALFWorld's order (index % 6), so any 6 consecutive games cover
  all six. Rooms whose type GOALS_VALID allows for the task type are drawn uniformly;
  `max_receptacles` restricts to small rooms (quick planning, used for the frozen set).
  """
  c = _constants()
  task_type = games.TASK_TYPES[index % len(games.TASK_TYPES)]
  rooms = [n for n in split_rooms(split)
           if _room_kind(n) in c.GOALS_VALID[task_type]
           and (max_receptacles is None or len(load_room(n).receptacles) <= max_receptacles)]
  if not rooms:
    raise ValueError(f"no {split} room for {task_type} with <= {max_receptacles} receptacles; "
                     "raise max_receptacles")
  rng = random.Random(f"alfworld/{split}/{seed}/{index}")
  for _ in range(_MAX_ATTEMPTS):
    room = load_room(rng.choice(rooms))
    target = sample_task(task_type, room, rng)
    if target is None:
      continue
    obj, recep, toggle = target
    record = games.GameRecord(
        split=split,
        trial=f"trial_s{seed}_{index:05d}",
        task_type=task_type,
        floorplan=room.floorplan,
        pddl_params={"object_target": obj, "parent_target": recep, "toggle_target": toggle,
                     "mrecep_target": "", "object_sliced": False},
        task_sentence=task_sentence(task_type, obj, recep, toggle, rng),
        pddl_problem=build_problem(task_type, room, target, rng),
        walkthrough=(),
    )
    plan = plan_walkthrough(record.game_json())
    if plan:
      return dataclasses.replace(record, walkthrough=tuple(plan))
  raise RuntimeError(f"no solvable {task_type} game for {split} seed={seed} index={index} after "
                     f"{_MAX_ATTEMPTS} attempts")


def generate_split(split: str, num: int, seed: int, max_receptacles: int | None = None,
                   on_game: Callable[[games.GameRecord], None] | None = None
                   ) -> Iterator[games.GameRecord]:
  """Games 0..num-1 of (split, seed), in order."""
  for index in range(num):
    record = generate_game(split, seed, index, max_receptacles)
    if on_game is not None:
      on_game(record)
    yield record
