"""A name -> entry table: the one list of names of a pluggable choice.

Each choice that a config names (policy loss, KL estimator, rollout correction, learning
rate schedule, metric writer) is a `Registry` filled where its entries are defined, at
import. Config validation and the code that dispatches on the name both ask it, so no
second list of names can drift. It imports nothing from `hgpo_jax`: every floor may use it.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
  """Entries by name, some also reachable by an alias (verl's "kl" for "k1").

  Args:
    kind: what an entry is, for the error of an unknown name ("policy loss").
  """

  def __init__(self, kind: str):
    self.kind = kind
    self._entries: dict[str, T] = {}
    self._aliases: dict[str, str] = {}

  def register(self, name: str, obj: T, *, aliases: tuple[str, ...] = ()) -> T:
    """Adds `obj` as `name` (and each alias); a name or alias already taken is refused."""
    for key in (name, *aliases):
      if key in self:
        raise ValueError(f"{self.kind} {key!r} is already registered")
    self._entries[name] = obj
    self._aliases.update((alias, name) for alias in aliases)
    return obj

  def unregister(self, name: str) -> None:
    """Removes `name` and its aliases (a test's toy entry)."""
    self._entries.pop(self.canonical(name))
    self._aliases = {a: n for a, n in self._aliases.items() if n in self._entries}

  def canonical(self, name: str) -> str:
    """The registered name that `name` is or stands for; KeyError as `get`."""
    registered = self._aliases.get(name, name)
    if registered not in self._entries:
      raise KeyError(self._unknown(name))
    return registered

  def get(self, name: str) -> T:
    """The entry of `name` or alias; KeyError naming the registered ones otherwise."""
    return self._entries[self.canonical(name)]

  def names(self) -> list[str]:
    """The registered names, sorted (aliases left out)."""
    return sorted(self._entries)

  def __contains__(self, name: object) -> bool:
    return name in self._entries or name in self._aliases

  def _unknown(self, name: str) -> str:
    message = f"unknown {self.kind} {name!r}; registered: {self.names()}"
    if self._aliases:
      pairs = ", ".join(f"{a} = {n}" for a, n in sorted(self._aliases.items()))
      message += f" (aliases: {pairs})"
    return message
