"""`AlfworldEnv`: ALFWorld games as a gymnasium text env (the env_servers.base contract).

The engine is the unmodified `textworld.envs.PddlEnv` wrapped in ALFWorld's own
`AlfredDemangler` (THOR ids -> "apple 1", "sinkbasin 1"), i.e. what ALFWorld's
`AlfredTWEnv` plays, so observations and commands read exactly as in ALFWorld:

  reset -> "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. ...
            \n\nYour task is to: put a cool apple in countertop."
  step("go to fridge 1") -> "You arrive at fridge 1. The fridge 1 is closed."
  step(<anything not admissible>) -> "Nothing happens."

Per step: reward = 10 * won (ALFWorld's success reward), terminated = won, truncated
when `max_steps` actions were taken without winning. `info` carries the base.py keys:
anchor_obs (the raw observation: this env adds no template, so it equals obs),
admissible_actions (ALFWorld's list without "help"), won, task_type, plus task_id.

Games come from the shipped frozen set (default) or from a directory in ALFWorld's
official layout (`data_dir=`: the released json_2.1.1 data, or a set written by
`python -m env_servers.alfworld.generate --out DIR`). Generated games are ALFWorld-format
games on ALFRED rooms, not the released ALFWorld splits: label results accordingly.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

from env_servers import base
from env_servers.alfworld import games
from env_servers.alfworld import speedup as speedup_lib

WIN_REWARD = 10.0  # ALFWorld's reward for a won episode (verl-agent / GiGPO convention)


def _parse_bool(value: bool | str, name: str) -> bool:
  if isinstance(value, bool):
    return value
  text = str(value).strip().lower()
  if text in ("1", "true", "yes", "on"):
    return True
  if text in ("0", "false", "no", "off"):
    return False
  raise ValueError(f"AlfworldEnv {name}={value!r} is not a boolean; use true or false")


def _parse_int(value: int | str, name: str, minimum: int) -> int:
  try:
    number = int(value)
  except (TypeError, ValueError):
    raise ValueError(f"AlfworldEnv {name}={value!r} is not an integer") from None
  if number < minimum:
    raise ValueError(f"AlfworldEnv {name}={number} must be >= {minimum}")
  return number


class AlfworldEnv(gym.Env):
  """One ALFWorld game at a time; `reset(options={"task_id": ...})` picks the game.

  Args (strings accepted, as the server passes command-line values):
    data_dir: folder in ALFWorld's official layout (<split>/<task>/<trial>/game.tw-pddl),
      or a folder of frozen sets (<split>.json.gz, e.g. env_servers/alfworld/data/mini_v1,
      the ALFWorld-mini suite of env_servers/alfworld/mini.py); None plays the shipped
      frozen set (train / valid_seen / valid_unseen).
    max_steps: actions per episode before truncation (ALFWorld agents use 50).
    speedup: memoise TextWorld's text generation (speedup.py; identical transcripts).
      The patch is process-wide: False restores the stock engine for the process.
    hide_actions: comma-separated command prefixes left out of the admissible list (they
      stay playable). The CPU suite hides ALFWorld's informational commands ("look",
      "inventory", "examine"), which change no state: an untrained policy that decodes
      token by token through the admissible list spends most of its mass on them
      (one first token each, against one "go" shared by every receptacle).
  """

  metadata = {"render_modes": []}

  def __init__(self, data_dir: str | None = None, max_steps: int | str = 50,
               speedup: bool | str = True, hide_actions: str | tuple[str, ...] = ()):
    super().__init__()
    self.max_steps = _parse_int(max_steps, "max_steps", 1)
    if isinstance(hide_actions, str):
      hide_actions = tuple(p.strip() for p in hide_actions.split(",") if p.strip())
    self.hide_actions = ("help",) + tuple(hide_actions)
    if _parse_bool(speedup, "speedup"):
      speedup_lib.apply()
    else:
      speedup_lib.restore()
    self._source = games.open_games(data_dir)
    self._engine = None
    self._task_id: str | None = None
    self._task_type = ""
    self._steps = 0
    self._done = True

  # -- catalog ----------------------------------------------------------------------------

  def splits(self) -> list[str]:
    return self._source.splits()

  def task_ids(self, split: str) -> list[str]:
    return self._source.task_ids(split)

  # -- episode ----------------------------------------------------------------------------

  def reset(self, *, seed: int | None = None,
            options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """Starts a game. ALFWorld games are deterministic, so `seed` only matters when no
    task_id is given: then it picks a task of options["split"] (default "train")."""
    super().reset(seed=seed)
    options = options or {}
    task_id = options.get("task_id")
    if not task_id:
      ids = self.task_ids(options.get("split") or "train")
      task_id = ids[int(self.np_random.integers(len(ids)))]
    elif options.get("split") and not task_id.startswith(options["split"] + "/"):
      raise ValueError(f"ALFWorld task id {task_id!r} is not in split {options['split']!r}")
    game_json, task_type = self._source.game(task_id)
    self._done = True  # no stepping a half-loaded game if the load below fails
    self._engine = self._load(game_json, task_id)
    self._task_id, self._task_type = task_id, task_type
    state = self._engine.reset()
    self._steps, self._done = 0, False
    return state.feedback, self._info(state)

  def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
    if self._engine is None or self._done:
      raise RuntimeError("AlfworldEnv.step called without an active episode; call reset first")
    command = action if isinstance(action, str) else ""
    # The engine matches whole admissible commands, so a capped or empty string simply
    # yields ALFWorld's "Nothing happens." like any other unknown command.
    command = command[:base.MAX_TEXT_CHARS].replace("\n", " ")
    state, _, _ = self._engine.step(command)
    self._steps += 1
    won = bool(state["won"])
    truncated = not won and self._steps >= self.max_steps
    self._done = won or truncated
    return state.feedback, WIN_REWARD * won, won, truncated, self._info(state)

  def close(self) -> None:
    if self._engine is not None:
      self._engine.close()
      self._engine = None
    self._done = True

  # -- helpers ----------------------------------------------------------------------------

  def _load(self, game_json: dict[str, Any], task_id: str):
    # Imported here so that listing tasks (and the server's start-up) stays light.
    import textworld
    from textworld.envs import PddlEnv
    from alfworld.agents.environment.alfred_tw_env import AlfredDemangler

    # One engine per env, re-loaded at every reset: each PddlEnv copies and dlopens its
    # own 33 MB libdownward.so that is never unloaded, so a new engine per reset leaks
    # disk and memory (thousands of resets filled /tmp). `load` rebuilds the game's
    # logic and PDDL state on the same library handle.
    engine = self._engine
    if engine is None:
      engine = AlfredDemangler(PddlEnv(textworld.EnvInfos(admissible_commands=True, won=True)),
                               shuffle=False)
    try:
      engine.load(game_json)
    except Exception as e:  # the PDDL/grammar parsers raise many types
      raise games.GameFileError(f"corrupt ALFWorld game {task_id}: the engine cannot load it "
                                f"({type(e).__name__}: {str(e)[:200]}); re-download or "
                                "regenerate it") from e
    return engine

  def _info(self, state) -> dict[str, Any]:
    return {
        base.ANCHOR_OBS: state.feedback,
        base.ADMISSIBLE: [c for c in state["admissible_commands"]
                          if not any(c == p or c.startswith(p + " ") for p in self.hide_actions)],
        base.WON: bool(state["won"]),
        base.TASK_TYPE: self._task_type,
        "task_id": self._task_id,
    }
