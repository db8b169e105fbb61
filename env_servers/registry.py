"""Environment name -> class, imported lazily so a server loads only its own env.

Each entry is a "module:Class" string. The class is a `gymnasium.Env` over text
following `env_servers.base`; its constructor takes keyword arguments (the server's
`--env-arg key=value` pairs), and it answers `splits() -> list[str]` and
`task_ids(split) -> list[str]`.
"""

from __future__ import annotations

import importlib
from typing import Any

ENVS: dict[str, str] = {
    "alfworld": "env_servers.alfworld.env:AlfworldEnv",
    "webshop": "env_servers.webshop.env:WebShopEnv",
    "sokoban": "env_servers.sokoban.env:SokobanEnv",
    "search": "env_servers.search.env:SearchEnv",
}


def env_class(name: str) -> type:
  """Imports the env class registered under `name`, or named by a "module:Class" path
  (for envs outside this repository and for tests)."""
  if name not in ENVS and ":" not in name:
    raise ValueError(f"unknown env {name!r}; registered envs: {', '.join(sorted(ENVS))} "
                     "(or give a 'module:Class' path)")
  module_name, class_name = ENVS.get(name, name).split(":")
  try:
    module = importlib.import_module(module_name)
  except ImportError as e:
    raise ImportError(f"env {name!r}: importing {module_name} failed ({e}); install the "
                      "env's requirements (see env_servers/requirements-nodeps.txt)") from e
  try:
    return getattr(module, class_name)
  except AttributeError as e:
    raise ImportError(f"env {name!r}: {module_name} has no class {class_name}; fix "
                      "env_servers/registry.py") from e


def make_env(name: str, **kwargs: Any):
  """Instantiates the env registered under `name` with constructor keyword args."""
  return env_class(name)(**kwargs)
