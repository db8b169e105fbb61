"""Name -> estimator registry: the one source of truth for estimator names.

Every estimator is a pure function `fn(batch: RowBatch, options) -> EstimatorOutput`
where `options` is a frozen (hashable) dataclass defined with it
(`hgpo_jax.advantages.estimator.define`); the function is jitted with `options` static.
Config validation, the command-line tool and the trainer ask this registry instead of
keeping their own name lists. The table is built here, at import, from the estimator
modules' functions: they import `hgpo_jax.advantages.estimator`, never this module.
"""

from __future__ import annotations

from hgpo_jax.advantages import episode
from hgpo_jax.advantages import gae
from hgpo_jax.advantages import gigpo
from hgpo_jax.advantages import hae
from hgpo_jax.advantages import hgpo
from hgpo_jax.advantages.estimator import Estimator
from hgpo_jax.advantages.estimator import EstimatorOutput

__all__ = ["Estimator", "EstimatorOutput", "get", "names"]

# Every estimator function (decorated with `estimator.define`); a new one is added here.
ESTIMATOR_FUNCTIONS = (episode.grpo, episode.rloo, gae.gae, gigpo.gigpo, hae.hae, hgpo.hgpo)


def _table(functions) -> dict[str, Estimator]:
  table: dict[str, Estimator] = {}
  for fn in functions:
    entry = fn.estimator
    if entry.name in table:
      raise ValueError(f"estimator {entry.name!r} registered twice")
    table[entry.name] = entry
  return table


_REGISTRY: dict[str, Estimator] = _table(ESTIMATOR_FUNCTIONS)


def names() -> list[str]:
  """The registered estimator names, sorted."""
  return sorted(_REGISTRY)


def get(name: str) -> Estimator:
  """The estimator registered as `name`; KeyError (naming the registered ones) otherwise."""
  if name not in _REGISTRY:
    raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(_REGISTRY)}")
  return _REGISTRY[name]
