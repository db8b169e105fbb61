"""Recomputes advantages from a rollout dump (JSONL, one step row per line).

  python -m hgpo_jax.advantages DUMP.jsonl --estimator hgpo --k 2 > with_adv.jsonl

Writes the input rows to stdout in input order, each with "return" (discounted,
after the invalid-action penalty, R~_t of docs/algorithms.md §1) and
"advantage" added. Estimator names come from the registry; options that the
chosen estimator does not have are rejected. Errors print one line to stderr and
exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np

from hgpo_jax import runtime
from hgpo_jax.advantages import dump
from hgpo_jax.advantages import grouping
from hgpo_jax.advantages import registry

# CLI flag (argparse dest) -> estimator option field of the same meaning.
_ESTIMATOR_FLAGS = ("norm", "stats", "omega", "k", "alpha", "weights", "base_group",
                    "enable_similarity", "similarity_thresh")


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m hgpo_jax.advantages",
      description="Recompute per-step advantages from a JSONL rollout dump.")
  p.add_argument("dump", help="rollout dump (JSONL, .jsonl.gz, or - for stdin)")
  p.add_argument("--estimator", required=True, choices=registry.names())
  p.add_argument("--gamma", type=float, default=0.95, help="discount of the step return")
  p.add_argument("--invalid-penalty", type=float, default=0.1,
                 help="eta, subtracted from an invalid row's return and score")
  p.add_argument("--norm", choices=("mean_std", "mean"), default=None,
                 help="group normalisation (default: the estimator's)")
  p.add_argument("--stats", choices=("rows", "trajectories"), default=None,
                 help="episode statistics over step rows or trajectories")
  p.add_argument("--omega", type=float, default=None, help="GiGPO step-term weight")
  p.add_argument("--k", type=int, default=None, help="HGPO deepest context level K")
  p.add_argument("--alpha", type=float, default=None, help="HGPO weight exponent")
  p.add_argument("--weights", choices=("paper", "recipe", "inverse_variance"), default=None,
                 help="HGPO level weights (k+1)^alpha (paper), (k+2)^alpha (recipe) or "
                      "inverse_variance (precision of each level's group mean)")
  p.add_argument("--base-group", action="store_const", const=True, default=None,
                 help="HGPO: add the episode advantage as an extra item")
  p.add_argument("--enable-similarity", action="store_const", const=True, default=None,
                 help="GiGPO: group near-identical anchor observations (difflib ratio)")
  p.add_argument("--similarity-thresh", type=float, default=None,
                 help="GiGPO: ratio needed to join a cluster (default 0.95)")
  p.add_argument("--capacity", type=int, default=None,
                 help="padded row count (default: next power of two)")
  return p


class _UsageError(Exception):
  pass


def _options(estimator: registry.Estimator, args: argparse.Namespace):
  fields = {f.name for f in dataclasses.fields(estimator.options_cls)}
  given = {f: getattr(args, f) for f in _ESTIMATOR_FLAGS if getattr(args, f) is not None}
  foreign = sorted(f for f in given if f not in fields)
  if foreign:
    flags = ", ".join("--" + f.replace("_", "-") for f in foreign)
    raise _UsageError(f"option(s) {flags} do not apply to estimator {estimator.name!r}")
  try:
    return estimator.options(**given)
  except (TypeError, ValueError) as e:
    raise _UsageError(str(e)) from None


def _critic_fields(estimator: registry.Estimator, rows: list[dict]) -> dict[str, np.ndarray]:
  """Critic estimators name a `<name>_fields_from_dump(rows)` hook in their module."""
  if not estimator.needs_critic:
    return {}
  module = sys.modules[estimator.fn.__module__]
  hook = getattr(module, f"{estimator.name}_fields_from_dump", None)
  if hook is None:
    raise _UsageError(f"estimator {estimator.name!r} needs critic values and its module defines "
                      f"no {estimator.name}_fields_from_dump(rows); it cannot run from a dump")
  try:
    return hook(rows)
  except ValueError as e:
    raise _UsageError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  try:
    rows = dump.read_rows(args.dump)
    estimator = registry.get(args.estimator)
    options = _options(estimator, args)
    n = len(rows)
    capacity = args.capacity or 1 << max(n - 1, 1).bit_length()
    grouped = grouping.build_row_batch(
        rows, num_levels=getattr(options, "k", 0) + 1, gamma=args.gamma,
        invalid_penalty=args.invalid_penalty, capacity=capacity,
        extra_fields=_critic_fields(estimator, rows), **grouping.grouping_options(options))
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
