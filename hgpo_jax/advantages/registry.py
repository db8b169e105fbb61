"""Name -> estimator registry: the one source of truth for estimator names.

Every estimator is a pure function `fn(batch: RowBatch, options) -> EstimatorOutput`
where `options` is a frozen (hashable) dataclass registered with it; the function
is jitted with `options` static. Config validation, the command-line tool and the
trainer ask this registry instead of keeping their own name lists.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import flax.struct
import jax

from hgpo_jax.advantages.batch import RowBatch


@flax.struct.dataclass
class EstimatorOutput:
  """What every estimator returns.

  `advantage` is always present (one scalar per row; group-based estimators are
  defined at row level and the trainer broadcasts it over the response mask).
  Critic-based estimators also return token-level advantages, the token loss
  mask (HiPER routes each level to its own token span) and value targets.
  """

  advantage: jax.Array
  """f32[R]: per-row advantage (0 on padding rows)."""
  token_advantage: Optional[jax.Array] = None
  """f32[R, T]: per-token advantage; None means broadcast `advantage`."""
  loss_mask: Optional[jax.Array] = None
  """bool[R, T]: tokens that receive policy gradient; None means the response mask."""
  value_targets: Optional[Any] = None
  """Critic regression targets (pytree of f32 arrays), None for critic-free estimators."""


@dataclasses.dataclass(frozen=True)
class Estimator:
  name: str
  fn: Callable[[RowBatch, Any], EstimatorOutput]
  options_cls: type
  needs_critic: bool

  def options(self, **kwargs) -> Any:
    """Builds validated options; unknown names raise a one-line TypeError."""
    known = {f.name for f in dataclasses.fields(self.options_cls)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
      raise TypeError(
          f"estimator {self.name!r} has no option(s) {unknown}; known: {sorted(known)}")
    return self.options_cls(**kwargs)

  def __call__(self, batch: RowBatch, options: Any = None) -> EstimatorOutput:
    return self.fn(batch, options if options is not None else self.options_cls())


_REGISTRY: dict[str, Estimator] = {}


def register(name: str, options_cls: type, *, needs_critic: bool = False):
  """Decorator: registers `fn(batch, options)` under `name`, jitted with static options."""

  def wrap(fn):
    if name in _REGISTRY:
      raise ValueError(f"estimator {name!r} registered twice")
    jitted = jax.jit(fn, static_argnums=(1,))
    _REGISTRY[name] = Estimator(name, jitted, options_cls, needs_critic)
    functools.update_wrapper(jitted, fn)
    return jitted

  return wrap


def _load_all() -> None:
  # Importing the estimator modules runs their @register decorators.
  import hgpo_jax.advantages.estimators  # noqa: F401  (runs the @register decorators)


def names() -> list[str]:
  _load_all()
  return sorted(_REGISTRY)


def get(name: str) -> Estimator:
  _load_all()
  if name not in _REGISTRY:
    raise KeyError(f"unknown advantage estimator {name!r}; registered: {sorted(_REGISTRY)}")
  return _REGISTRY[name]
