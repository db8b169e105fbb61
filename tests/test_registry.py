"""`hgpo_jax.registry.Registry`: names, aliases, the one-line error, the lowest floor."""

import ast
import os

import pytest

from hgpo_jax import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fruit() -> registry.Registry:
  r = registry.Registry("fruit")
  r.register("pear", 1)
  r.register("apple", 2, aliases=("malus",))
  return r


def test_names_are_sorted_and_aliases_resolve():
  r = _fruit()
  assert r.names() == ["apple", "pear"]
  assert r.get("pear") == 1 and r.get("apple") == 2 and r.get("malus") == 2
  assert r.canonical("malus") == "apple" and r.canonical("pear") == "pear"
  assert "malus" in r and "apple" in r and "plum" not in r


def test_an_unknown_name_is_a_key_error_naming_every_member_in_one_line():
  r = _fruit()
  with pytest.raises(KeyError) as info:
    r.get("plum")
  assert info.value.args[0] == ("unknown fruit 'plum'; registered: ['apple', 'pear'] "
                                "(aliases: malus = apple)")
  with pytest.raises(KeyError, match=r"unknown fruit 'plum'; registered: \['apple', 'pear'\]"):
    r.canonical("plum")
  bare = registry.Registry("fruit")
  with pytest.raises(KeyError) as info:
    bare.get("plum")
  assert info.value.args[0] == "unknown fruit 'plum'; registered: []"


@pytest.mark.parametrize("name,aliases", [("pear", ()), ("plum", ("malus",)),
                                          ("malus", ()), ("plum", ("pear",))])
def test_a_taken_name_or_alias_is_refused(name, aliases):
  r = _fruit()
  with pytest.raises(ValueError, match="is already registered"):
    r.register(name, 3, aliases=aliases)
  assert r.names() == ["apple", "pear"] and r.get("malus") == 2


def test_unregister_removes_the_name_and_its_aliases():
  r = _fruit()
  r.unregister("malus")
  assert r.names() == ["pear"] and "malus" not in r and "apple" not in r
  r.register("apple", 5, aliases=("malus",))  # free again
  assert r.get("malus") == 5


def test_register_returns_the_entry():
  r = registry.Registry("fruit")
  fn = lambda: 0
  assert r.register("f", fn) is fn


def test_the_registry_imports_nothing_from_the_package():
  """The lowest floor (FLOORS in tests/test_import_graph.py): every module may use it."""
  path = os.path.join(ROOT, "hgpo_jax", "registry.py")
  with open(path, encoding="utf-8") as f:
    tree = ast.parse(f.read(), path)
  imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
  imported += [n.module or "." for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
  assert not [m for m in imported if m.startswith(("hgpo_jax", "."))], imported
