"""Memoised text generation for TextWorld's PDDL engine: same transcripts, ~10x faster.

Stock textworld 1.7 spends most of an ALFWorld step re-deriving text: every admissible
command and every feedback sentence goes through `ContextSensitiveGrammar.derive`, which
re-parses its template string with TatSu (`textgen._parse_and_convert`), re-parses each
rule condition (`Rule.parse_conjunctive_query`) and deep-copies the derivation context
(`textgen.copy_context`) for every symbol (a cProfile of 40 steps in a generated kitchen:
of 13.9 s, 8.8 s TatSu parsing and 4.1 s deepcopy).

Why each replacement is exact:
  * `_parse_and_convert(text, rule_name)` is a pure function of its arguments; the cache
    hands out a deep copy of the parsed symbols, because derivation assigns contexts to
    them, so callers still receive fresh objects.
  * `Rule.parse_conjunctive_query(expr)` is pure; the returned Rule is only read
    (matched against the state), never mutated.
  * `copy_context` deep-copied `variables` (name -> EntityInfo) and `mapping`
    (Placeholder -> Variable); derivation only rebinds keys of these dicts and reads the
    values, so copying the dicts (not their values) gives the same text.
  * `fast_downward.pddl2sas(domain, problem)` (the PDDL -> SAS translation, ~4 per game
    start: `PddlEnv.load` and `reset` each build a PddlState, which translates twice) is
    a pure function of the texts; PddlState only reads the returned task (actions,
    types, objects, init). Memoising it makes `reset` after `load`, and the N resets of
    one game in a group rollout, skip the translation.
The equivalence is tested by comparing patched and stock transcripts (observation,
admissible commands, won) in separate processes (tests/env_servers/test_alfworld_speedup.py).

The patch is process-wide (it replaces module attributes); `apply()` and `restore()` are
idempotent and restore the exact original objects.
"""

from __future__ import annotations

import copy
import functools

# Bounded so a long-lived server that sees many distinct goal sentences stays small.
_CACHE_SIZE = 1 << 16
# Translated tasks are large (~1 MB each): keep the recent games only.
_TASK_CACHE_SIZE = 64
_originals: dict[str, object] = {}


def is_applied() -> bool:
  return bool(_originals)


def apply() -> None:
  """Installs the memoised functions into textworld (no-op when already applied)."""
  if _originals:
    return
  import fast_downward
  import textworld.envs.pddl.textgen as textgen
  from textworld.logic import Rule

  parse = textgen._parse_and_convert
  query = Rule.__dict__["parse_conjunctive_query"]
  parse_query = query.__func__

  @functools.lru_cache(maxsize=_CACHE_SIZE)
  def _cached_parse(text, rule_name):
    return parse(text, rule_name=rule_name)

  def parse_and_convert(text, rule_name="symbols", trace=False):
    del trace  # only prints TatSu's parse trace
    return copy.deepcopy(_cached_parse(text, rule_name))

  def copy_context(context):
    return {
        "state": context["state"],
        "facts": context["facts"],
        "variables": dict(context["variables"]),
        "mapping": dict(context["mapping"]),
        "entity_infos": context["entity_infos"],
    }

  @functools.lru_cache(maxsize=_CACHE_SIZE)
  def _cached_query(expr):
    return parse_query(Rule, expr)

  def parse_conjunctive_query(cls, expr):
    del cls  # always Rule: subclasses do not override the parse
    return _cached_query(expr)

  translate = fast_downward.pddl2sas

  @functools.lru_cache(maxsize=_TASK_CACHE_SIZE)
  def pddl2sas(domain, problem, verbose=False, optimize=False):
    return translate(domain, problem, verbose=verbose, optimize=optimize)

  _originals.update(parse=parse, copy_context=textgen.copy_context, query=query,
                    translate=translate)
  fast_downward.pddl2sas = pddl2sas
  textgen._parse_and_convert = parse_and_convert
  textgen.copy_context = copy_context
  Rule.parse_conjunctive_query = classmethod(parse_conjunctive_query)


def restore() -> None:
  """Puts the stock textworld functions back (no-op when not applied)."""
  if not _originals:
    return
  import fast_downward
  import textworld.envs.pddl.textgen as textgen
  from textworld.logic import Rule

  fast_downward.pddl2sas = _originals["translate"]
  textgen._parse_and_convert = _originals["parse"]
  textgen.copy_context = _originals["copy_context"]
  Rule.parse_conjunctive_query = _originals["query"]
  _originals.clear()
