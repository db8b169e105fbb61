"""The estimator interface: what an estimator returns, its registry entry, and `define`.

Every estimator is a pure function `fn(batch: RowBatch, options) -> EstimatorOutput`
where `options` is a frozen (hashable) dataclass; `@define(name, Options)` jits it with
`options` static and attaches its `Estimator` entry. This module keeps no table: the
estimator modules (episode, gae, gigpo, hae, hgpo) import it, and
`hgpo_jax.advantages.registry` imports them and lists their entries, so no module imports
the registry that imports it.
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
  """A registry entry: the jitted estimator function, its options class and whether it
  reads critic values. Calling it runs `fn` (default options when none are given)."""

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


def define(name: str, options_cls: type, *, needs_critic: bool = False):
  """Decorator: jits `fn(batch, options)` with static options and attaches its entry as
  `.estimator` (an `Estimator`); `hgpo_jax.advantages.registry` lists the decorated
  functions under their names."""

  def wrap(fn):
    jitted = jax.jit(fn, static_argnums=(1,))
    functools.update_wrapper(jitted, fn)
    jitted.estimator = Estimator(name, jitted, options_cls, needs_critic)
    return jitted

  return wrap
