"""Env classes for server/pool tests, loaded by servers as `flaky_envs:Class`."""

import os

from env_servers.sokoban import env as sokoban


class FlakyEnv(sokoban.SokobanEnv):
  """Sokoban whose step("explode") raises; `import_jax=true` imports JAX at construction."""

  def __init__(self, import_jax: bool = False, **kwargs):
    if import_jax:
      import jax  # noqa: F401
    super().__init__(**kwargs)

  def step(self, action):
    if action == "explode":
      raise RuntimeError("boom")
    return super().step(action)


class DriftingEnv(sokoban.SokobanEnv):
  """Not deterministic per (task, seed): observations name the server process."""

  def step(self, action):
    obs, reward, terminated, truncated, info = super().step(action)
    return f"{obs}\nserved by pid {os.getpid()}", reward, terminated, truncated, info


class BrokenCatalogEnv(sokoban.SokobanEnv):
  """Its task list of the "test" split raises (an exception outside any slot's step)."""

  def task_ids(self, split):
    if split == "test":
      raise OSError("task file test.json is missing")
    return super().task_ids(split)


class _Unprintable:
  def __str__(self):
    raise ValueError("observation cannot be rendered")


class UnprintableEnv(sokoban.SokobanEnv):
  """step("render") returns an observation whose str() raises (fails in the server's
  reply conversion, after the env's step returned)."""

  def step(self, action):
    out = super().step(action)
    return (_Unprintable(),) + tuple(out[1:]) if action == "render" else out
