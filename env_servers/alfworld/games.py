"""ALFWorld game records and the two places games live: the frozen set and a data dir.

A game as the engine reads it (`textworld.envs.PddlEnv.load`) is the JSON object of a
`game.tw-pddl` file:

  {"pddl_domain": <alfred.pddl>, "grammar": <alfred.twl2 with "UNKNOWN GOAL" replaced by
   the task sentence>, "pddl_problem": <problem>, "solvable": bool, "walkthrough": [cmd]}

Domain and grammar are the same for every game (they ship in the `alfworld` wheel), so
the frozen evaluation set stores only what differs (`GameRecord`: problem, task sentence,
task type, walkthrough) as gzip-compressed JSON under `data/<split>.json.gz`, and
`GameRecord.game_json()` assembles the full object at load time.

The official ALFWorld layout (what `alfworld-download` produces, and what
`python -m env_servers.alfworld.generate --out DIR` writes) is

  <data_dir>/<split>/<task_type>-<Obj>-<MRecep>-<Recep>-<scene>/<trial>/game.tw-pddl
                                                                       /traj_data.json

and is read by `DataDirGames` with ALFWorld's own filtering rules (`AlfredTWEnv.
collect_game_files`: skip movable/sliced variants, unknown task types, games without
`solvable: true`). Task ids are `<split>/<task dir>/<trial dir>` in both sources.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import importlib.resources
import json
import os
from typing import Any, Iterable, Mapping

# ALFWorld's six task types, in ALFWorld's numbering order (alfred_tw_env.TASK_TYPES 1..6).
TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
SPLITS = ("train", "valid_seen", "valid_unseen")
FROZEN_FORMAT = "hgpo_jax.alfworld.frozen/1"
GAME_FILE = "game.tw-pddl"
TRAJ_FILE = "traj_data.json"
_GOAL_PLACEHOLDER = "UNKNOWN GOAL"


class GameFileError(ValueError):
  """A game file or data directory is missing, corrupt or not in ALFWorld's layout."""


@functools.cache
def _alfworld_text(name: str) -> str:
  # alfworld.info only holds the two data-file paths; importing it pulls nothing heavy.
  from alfworld import info
  path = {"domain": info.ALFRED_PDDL_PATH, "grammar": info.ALFRED_TWL2_PATH}[name]
  with open(path, encoding="utf-8") as f:
    return f.read()


def alfred_domain() -> str:
  """ALFWorld's PDDL domain (`alfworld/data/alfred.pddl`)."""
  return _alfworld_text("domain")


def alfred_grammar(task_sentence: str) -> str:
  """ALFWorld's text grammar with the goal sentence filled in (as `add_task_to_grammar`)."""
  return _alfworld_text("grammar").replace(_GOAL_PLACEHOLDER, task_sentence)


@dataclasses.dataclass(frozen=True)
class GameRecord:
  """One game, as stored in the frozen set; the differing part of a `game.tw-pddl`.

  Attributes:
    split: "train", "valid_seen" or "valid_unseen".
    trial: trial folder name, unique within (split, task dir).
    task_type: one of TASK_TYPES.
    floorplan: ALFRED floor-plan number of the room (1..430).
    pddl_params: ALFWorld's traj_data["pddl_params"] (object_target, parent_target,
      toggle_target, mrecep_target, object_sliced).
    task_sentence: the goal, e.g. "put a cool apple in countertop".
    pddl_problem: the PDDL problem text.
    walkthrough: planner commands (demangled names) that win the game.
  """

  split: str
  trial: str
  task_type: str
  floorplan: int
  pddl_params: Mapping[str, Any]
  task_sentence: str
  pddl_problem: str
  walkthrough: tuple[str, ...]

  @property
  def task_dir(self) -> str:
    """ALFWorld's folder name: <task_type>-<Obj>-<MRecep or None>-<Recep or Toggle>-<scene>."""
    p = self.pddl_params
    return "-".join([self.task_type, p["object_target"], p["mrecep_target"] or "None",
                     p["parent_target"] or p["toggle_target"], str(self.floorplan)])

  @property
  def task_id(self) -> str:
    return f"{self.split}/{self.task_dir}/{self.trial}"

  def game_json(self) -> dict[str, Any]:
    """The full `game.tw-pddl` object (domain + grammar assembled here)."""
    return {
        "pddl_domain": alfred_domain(),
        "grammar": alfred_grammar(self.task_sentence),
        "pddl_problem": self.pddl_problem,
        "solvable": bool(self.walkthrough),
        "walkthrough": list(self.walkthrough),
    }

  def traj_data(self) -> dict[str, Any]:
    """The parts of ALFWorld's `traj_data.json` that ALFWorld's code reads."""
    return {
        "task_type": self.task_type,
        "pddl_params": dict(self.pddl_params),
        "scene": {"floor_plan": f"FloorPlan{self.floorplan}", "scene_num": self.floorplan},
        "turk_annotations": {"anns": []},
        "task_desc": self.task_sentence,
        "generator": "hgpo_jax env_servers.alfworld (ALFWorld-format game on an ALFRED floor "
                     "plan; not a released ALFWorld game)",
    }

  def to_json(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["pddl_params"] = dict(self.pddl_params)
    d["walkthrough"] = list(self.walkthrough)
    return d

  @classmethod
  def from_json(cls, d: Mapping[str, Any]) -> "GameRecord":
    fields = {f.name for f in dataclasses.fields(cls)}
    missing = fields - set(d)
    if missing:
      raise GameFileError(f"game record lacks {sorted(missing)}")
    kw = {k: d[k] for k in fields}
    kw["walkthrough"] = tuple(kw["walkthrough"])
    kw["floorplan"] = int(kw["floorplan"])
    return cls(**kw)


# ----------------------------------------------------------------------------------------
# Frozen set: data/<split>.json.gz


def frozen_set_file(split: str) -> str:
  """Path of the shipped frozen set for `split` (package data, located via importlib)."""
  return str(importlib.resources.files("env_servers.alfworld.data") / f"{split}.json.gz")


def save_frozen(records: Iterable[GameRecord], path: str, **meta: Any) -> None:
  """Writes records as gzip JSON, byte-identical for identical records (mtime=0)."""
  payload = {"format": FROZEN_FORMAT, **meta, "games": [r.to_json() for r in records]}
  raw = json.dumps(payload, indent=0, sort_keys=True).encode("utf-8")
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "wb") as f:
    with gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
      gz.write(raw)


def load_frozen(path: str) -> list[GameRecord]:
  """Reads a frozen set written by `save_frozen`."""
  if not os.path.isfile(path):
    raise GameFileError(f"frozen ALFWorld game set {path} not found; reinstall the package or "
                        "regenerate it with `python -m env_servers.alfworld.generate --frozen`")
  try:
    with gzip.open(path, "rt", encoding="utf-8") as f:
      payload = json.load(f)
    if payload.get("format") != FROZEN_FORMAT:
      raise GameFileError(f"format {payload.get('format')!r}, expected {FROZEN_FORMAT!r}")
    return [GameRecord.from_json(g) for g in payload["games"]]
  except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
    raise GameFileError(f"corrupt frozen ALFWorld game set {path} ({e}); regenerate it with "
                        "`python -m env_servers.alfworld.generate --frozen`") from e


# ----------------------------------------------------------------------------------------
# Official layout: <data_dir>/<split>/<task dir>/<trial>/{game.tw-pddl, traj_data.json}


def write_game_dir(record: GameRecord, data_dir: str) -> str:
  """Writes one game in ALFWorld's folder layout; returns the game.tw-pddl path."""
  game_dir = os.path.join(data_dir, record.split, record.task_dir, record.trial)
  os.makedirs(game_dir, exist_ok=True)
  with open(os.path.join(game_dir, TRAJ_FILE), "w", encoding="utf-8") as f:
    json.dump(record.traj_data(), f, indent=1, sort_keys=True)
  with open(os.path.join(game_dir, "initial_state.pddl"), "w", encoding="utf-8") as f:
    f.write(record.pddl_problem)
  path = os.path.join(game_dir, GAME_FILE)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record.game_json(), f)
  return path


def read_game_file(path: str) -> dict[str, Any]:
  """Reads and checks one `game.tw-pddl`; raises GameFileError naming the file."""
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f)
  except FileNotFoundError as e:
    raise GameFileError(f"ALFWorld game file {path} not found") from e
  except (OSError, ValueError) as e:
    raise GameFileError(f"corrupt ALFWorld game file {path} ({e}); re-download or "
                        "regenerate it") from e
  keys = ("pddl_domain", "grammar", "pddl_problem")
  if not isinstance(data, dict) or any(not isinstance(data.get(k), str) for k in keys):
    raise GameFileError(f"corrupt ALFWorld game file {path}: it must be a JSON object with "
                        f"string fields {list(keys)}; re-download or regenerate it")
  return data


class FrozenGames:
  """The shipped frozen evaluation set (or any directory of `<split>.json.gz` files)."""

  def __init__(self, frozen_dir: str | None = None):
    self._dir = frozen_dir

  def _file(self, split: str) -> str:
    if self._dir is None:
      return frozen_set_file(split)
    return os.path.join(self._dir, f"{split}.json.gz")

  def splits(self) -> list[str]:
    return [s for s in SPLITS if os.path.isfile(self._file(s))]

  @functools.cache
  def _records(self, split: str) -> dict[str, GameRecord]:
    if split not in SPLITS:
      raise ValueError(f"unknown ALFWorld split {split!r}; expected one of {list(SPLITS)}")
    return {r.task_id: r for r in load_frozen(self._file(split))}

  def task_ids(self, split: str) -> list[str]:
    return sorted(self._records(split))

  def game(self, task_id: str) -> tuple[dict[str, Any], str]:
    """Returns (game.tw-pddl object, task type) for a task id."""
    record = self._records(_split_of(task_id)).get(task_id)
    if record is None:
      raise ValueError(f"unknown ALFWorld task id {task_id!r} (not in the frozen set)")
    return record.game_json(), record.task_type


class DataDirGames:
  """Games in ALFWorld's official folder layout under `data_dir` (split = first level)."""

  def __init__(self, data_dir: str):
    if not os.path.isdir(data_dir):
      raise GameFileError(f"ALFWorld data dir {data_dir} does not exist; point data_dir at the "
                          "folder holding train/, valid_seen/, valid_unseen/ (e.g. json_2.1.1)")
    self._data_dir = data_dir
    if any(d.startswith(TASK_TYPES) for d in os.listdir(data_dir)):
      raise GameFileError(f"ALFWorld data dir {data_dir} holds task folders, i.e. it is one "
                          "split; point data_dir at its parent (the folder holding the splits)")
    self._splits = sorted(d for d in os.listdir(data_dir)
                          if os.path.isdir(os.path.join(data_dir, d)) and self._has_games(d))
    if not self._splits:
      raise GameFileError(f"no games under {data_dir}/<split>/<task>/<trial>/{GAME_FILE}; point "
                          "data_dir at the folder holding train/, valid_seen/, valid_unseen/")

  def _has_games(self, split: str) -> bool:
    for _, _, files in os.walk(os.path.join(self._data_dir, split)):
      if TRAJ_FILE in files:
        return True
    return False

  def splits(self) -> list[str]:
    return list(self._splits)

  @functools.cache
  def _games(self, split: str) -> dict[str, tuple[str, str]]:
    """task id -> (game file path, task type), with ALFWorld's collect_game_files filters."""
    if split not in self._splits:
      raise ValueError(f"unknown ALFWorld split {split!r} in {self._data_dir}; "
                     f"found {self._splits}")
    root = os.path.join(self._data_dir, split)
    games = {}
    for dirpath, _, files in sorted(os.walk(root)):
      if TRAJ_FILE not in files or "movable" in dirpath or "Sliced" in dirpath:
        continue
      traj_path = os.path.join(dirpath, TRAJ_FILE)
      try:
        with open(traj_path, encoding="utf-8") as f:
          task_type = json.load(f)["task_type"]
      except (OSError, ValueError, KeyError, TypeError) as e:
        raise GameFileError(f"corrupt ALFWorld {traj_path} ({e})") from e
      game_path = os.path.join(dirpath, GAME_FILE)
      if task_type not in TASK_TYPES or not os.path.isfile(game_path):
        continue
      if read_game_file(game_path).get("solvable") is not True:
        continue
      rel = os.path.relpath(dirpath, self._data_dir).replace(os.sep, "/")
      games[rel] = (game_path, task_type)
    return games

  def task_ids(self, split: str) -> list[str]:
    return sorted(self._games(split))

  def game(self, task_id: str) -> tuple[dict[str, Any], str]:
    entry = self._games(_split_of(task_id)).get(task_id)
    if entry is None:
      raise ValueError(f"unknown ALFWorld task id {task_id!r} (no solvable game at "
                     f"{self._data_dir}/{task_id})")
    path, task_type = entry
    return read_game_file(path), task_type


def is_frozen_dir(path: str) -> bool:
  """True if `path` is a folder of frozen sets (`<split>.json.gz`, e.g. data/mini_v1)."""
  return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, f"{s}.json.gz"))
                                     for s in SPLITS)


def open_games(data_dir: str | None):
  """The game source for `data_dir`: the shipped frozen set (None or ""), a folder of
  frozen sets (`<split>.json.gz`, e.g. `env_servers/alfworld/data/mini_v1`), or a
  folder in ALFWorld's official layout."""
  if not data_dir:
    return FrozenGames()
  if is_frozen_dir(data_dir):
    return FrozenGames(data_dir)
  return DataDirGames(data_dir)


def _split_of(task_id: str) -> str:
  split = task_id.split("/", 1)[0]
  if split == task_id:
    raise ValueError(f"malformed ALFWorld task id {task_id!r}; expected <split>/<task dir>/<trial>")
  return split
