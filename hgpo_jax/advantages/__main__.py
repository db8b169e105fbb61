"""Recomputes advantages from a rollout dump (JSONL, one step row per line).

  python -m hgpo_jax.advantages DUMP.jsonl --estimator hgpo --k 2 > with_adv.jsonl

Writes the input rows to stdout in input order, each with "return" (discounted,
after the invalid-action penalty, R~_t of docs/algorithms.md §1) and
"advantage" added. Estimator names come from the registry. Every field of every
registered estimator's options dataclass is a flag (`--field-name VALUE`; booleans take
true/false, a bare flag means true); a flag the chosen estimator does not read is an
error naming the estimator, never ignored. That includes options that only act under
another option (`DEPENDENT_OPTIONS`, e.g. `--bootstrap-truncated` of gae without
`--multi-turn true`). `--gamma` and `--invalid-penalty` set the row batch's return and
score (`grouping.build_row_batch`) and, for estimators that have options of those names
(gae, hae), those options too, so both always agree. Errors print one line to stderr
and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Callable

import numpy as np

from hgpo_jax import runtime
from hgpo_jax.advantages import dump
from hgpo_jax.advantages import grouping
from hgpo_jax.advantages import registry

ROW_BATCH_DEFAULTS = {"gamma": 0.95, "invalid_penalty": 0.1}
"""The row batch's discount and eta when neither the flag nor the estimator sets them."""

_HELP = {
    "gamma": "discount of the `return` column and of GiGPO/HGPO step returns; gae/hae: their "
             "gamma option (default: the estimator's, else 0.95)",
    "invalid_penalty": "eta, subtracted from an invalid row's return and score; gae/hae: their "
                       "invalid_penalty option (default: the estimator's, else 0.1)",
    "norm": "group normalisation (default: the estimator's)",
    "stats": "episode statistics over step rows or trajectories",
    "omega": "GiGPO step-term weight",
    "k": "HGPO deepest context level K",
    "alpha": "HGPO weight exponent",
    "weights": "HGPO level weights (k+1)^alpha (paper), (k+2)^alpha (recipe) or "
               "inverse_variance (precision of each level's group mean)",
    "base_group": "HGPO: add the episode advantage as an extra item",
    "enable_similarity": "GiGPO: group near-identical anchor observations (difflib ratio)",
    "similarity_thresh": "GiGPO: ratio needed to join a cluster (default 0.95)",
}

HOST_FLAGS = {"subgoal_compare": ("hae", ("token_ids", "text"),
                                  "hae: how the consistency penalty compares subgoals "
                                  "(hae.hae_fields_from_dump; default: token_ids when the "
                                  "dump rows carry response_ids, else text)")}
"""Flags read on the host (by an estimator's `<name>_fields_from_dump`), not options fields:
flag -> (estimator, choices, help)."""

DEPENDENT_OPTIONS: dict[tuple[str, str], tuple[str, Callable[[Any, dict], bool]]] = {
    ("gae", "bootstrap_truncated"): ("--multi-turn true", lambda o, h: o.multi_turn),
    ("gigpo", "similarity_thresh"): ("--enable-similarity", lambda o, h: o.enable_similarity),
    ("gigpo", "ddof"): ("--norm mean_std", lambda o, h: o.norm == "mean_std"),
    ("grpo", "ddof"): ("--norm mean_std", lambda o, h: o.norm == "mean_std"),
    ("grpo", "epsilon"): ("--norm mean_std", lambda o, h: o.norm == "mean_std"),
    ("hgpo", "ddof"): ("--norm mean_std", lambda o, h: o.norm == "mean_std"),
    ("hgpo", "variance_prior"): ("--weights inverse_variance",
                                 lambda o, h: o.weights == "inverse_variance"),
    ("hgpo", "alpha"): ("--weights paper or recipe", lambda o, h: o.weights != "inverse_variance"),
    ("hgpo", "base_ddof"): ("--base-group", lambda o, h: o.base_group),
    ("hgpo", "stats"): ("--base-group", lambda o, h: o.base_group),
    ("hae", "keep_penalty_mode"): ("a non-zero --keep-penalty", lambda o, h: o.keep_penalty != 0),
    ("hae", "subgoal_compare"): ("a non-zero --keep-consistency-penalty",
                                 lambda o, h: o.keep_consistency_penalty != 0),
}
"""(estimator, option) -> (what it needs, test on (options, host flags)): an option that
acts only under another one; giving it explicitly without that is an error."""


def _bool(text: str) -> bool:
  low = str(text).strip().lower()
  if low in ("true", "1", "yes"):
    return True
  if low in ("false", "0", "no"):
    return False
  raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def option_fields() -> dict[str, tuple[type, set[str]]]:
  """Every options field of the registered estimators: name -> (type, estimators)."""
  types = {"float": float, "int": int, "str": str, "bool": bool}
  out: dict[str, tuple[type, set[str]]] = {}
  for name in registry.names():
    for f in dataclasses.fields(registry.get(name).options_cls):
      typ = f.type if isinstance(f.type, type) else types[str(f.type)]
      prev = out.get(f.name)
      if prev is not None and prev[0] is not typ:
        raise TypeError(f"option {f.name!r} is {prev[0].__name__} and {typ.__name__} in "
                        "different estimators; the CLI needs one type per name")
      out[f.name] = (typ, (prev[1] if prev else set()) | {name})
  for name in ROW_BATCH_DEFAULTS:
    out.setdefault(name, (float, set()))
  return out


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m hgpo_jax.advantages",
      description="Recompute per-step advantages from a JSONL rollout dump.")
  p.add_argument("dump", help="rollout dump (JSONL, .jsonl.gz, or - for stdin)")
  p.add_argument("--estimator", required=True, choices=registry.names())
  for field, (typ, owners) in sorted(option_fields().items()):
    flag = "--" + field.replace("_", "-")
    where = "" if field in ROW_BATCH_DEFAULTS else f" [{', '.join(sorted(owners))}]"
    help_text = _HELP.get(field, "option " + field) + where
    if typ is bool:
      p.add_argument(flag, dest=field, type=_bool, nargs="?", const=True, default=None,
                     metavar="true|false", help=help_text)
    else:
      p.add_argument(flag, dest=field, type=typ, default=None, help=help_text)
  for field, (_, choices, help_text) in HOST_FLAGS.items():
    p.add_argument("--" + field.replace("_", "-"), dest=field, choices=choices, default=None,
                   help=help_text)
  p.add_argument("--capacity", type=int, default=None,
                 help="padded row count (default: next power of two)")
  return p


class _UsageError(Exception):
  pass


def _flag(field: str) -> str:
  return "--" + field.replace("_", "-")


def _options(estimator: registry.Estimator, args: argparse.Namespace):
  """The estimator's options from the flags; raises _UsageError for a flag it does not read."""
  fields = {f.name for f in dataclasses.fields(estimator.options_cls)}
  given = {f: getattr(args, f) for f in option_fields() if getattr(args, f) is not None}
  host = {f: getattr(args, f) for f in HOST_FLAGS if getattr(args, f) is not None}
  foreign = sorted(f for f in given if f not in fields and f not in ROW_BATCH_DEFAULTS)
  foreign += sorted(f for f in host if HOST_FLAGS[f][0] != estimator.name)
  if foreign:
    flags = ", ".join(_flag(f) for f in foreign)
    raise _UsageError(f"option(s) {flags} do not apply to estimator {estimator.name!r}")
  try:
    options = estimator.options(**{k: v for k, v in given.items() if k in fields})
  except (TypeError, ValueError) as e:
    raise _UsageError(str(e)) from None
  idle = sorted(f for f in list(given) + list(host)
                if (estimator.name, f) in DEPENDENT_OPTIONS
                and not DEPENDENT_OPTIONS[estimator.name, f][1](options, host))
  if idle:
    needs = "; ".join(f"{_flag(f)} needs {DEPENDENT_OPTIONS[estimator.name, f][0]}" for f in idle)
    raise _UsageError(f"option(s) {', '.join(map(_flag, idle))} change nothing for estimator "
                      f"{estimator.name!r} as given ({needs})")
  return options, host


def _row_batch_args(options: Any, args: argparse.Namespace) -> dict[str, float]:
  """gamma and eta of the row batch: the flag, else the estimator's option, else the default."""
  return {k: (getattr(args, k) if getattr(args, k) is not None else getattr(options, k, default))
          for k, default in ROW_BATCH_DEFAULTS.items()}


def _critic_fields(estimator: registry.Estimator, rows: list[dict], host: dict
                   ) -> dict[str, np.ndarray]:
  """Critic estimators name a `<name>_fields_from_dump(rows)` hook in their module."""
  if not estimator.needs_critic:
    return {}
  module = sys.modules[estimator.fn.__module__]
  hook = getattr(module, f"{estimator.name}_fields_from_dump", None)
  if hook is None:
    raise _UsageError(f"estimator {estimator.name!r} needs critic values and its module defines "
                      f"no {estimator.name}_fields_from_dump(rows); it cannot run from a dump")
  try:
    return hook(rows, **host)
  except ValueError as e:
    raise _UsageError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    rows = dump.read_rows(args.dump)
    estimator = registry.get(args.estimator)
    options, host = _options(estimator, args)
    n = len(rows)
    capacity = args.capacity or 1 << max(n - 1, 1).bit_length()
    grouped = grouping.build_row_batch(
        rows, num_levels=getattr(options, "k", 0) + 1, capacity=capacity,
        extra_fields=_critic_fields(estimator, rows, host), **_row_batch_args(options, args),
        **grouping.grouping_options(options))
  except (_UsageError, dump.DumpError, grouping.GroupingError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  runtime.pin_cpu_isa()
  runtime.enable_compilation_cache()
  out = estimator(grouped.batch, options)
  returns = grouped.to_input_order(grouped.batch.returns)
  advantage = grouped.to_input_order(np.asarray(out.advantage))
  for row, ret, adv in zip(rows, returns, advantage):
    row["return"] = float(ret)
    row["advantage"] = float(adv)
  try:
    dump.write_rows("-", rows)
  except BrokenPipeError:  # e.g. piped into `head`: not an error of this tool
    sys.stdout = None
  return 0


if __name__ == "__main__":
  sys.exit(main())
