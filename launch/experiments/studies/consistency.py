"""Context inconsistency of a real rollout dump (hgpo_jax.analysis.consistency).

  python -m launch.experiments.studies.consistency DUMP.jsonl [--depths 1 2 4] [--gamma 0.95]

Prints, per history depth d, the fraction of anchor-state groups whose members have
different depth-d histories and the share of the within-group return variance that
the history explains (raw and chance-corrected). Dumps come from the trainer's rollout
dump or any JSONL in the format of hgpo_jax.advantages.dump.
"""

from __future__ import annotations

import argparse
import sys

from hgpo_jax.advantages import dump
from hgpo_jax.advantages import grouping
from hgpo_jax.analysis import consistency


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.experiments.studies.consistency",
                              description=__doc__.split("\n")[0])
  p.add_argument("dump", help="rollout dump (JSONL, .jsonl.gz, or - for stdin)")
  p.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
  p.add_argument("--gamma", type=float, default=0.95)
  p.add_argument("--invalid-penalty", type=float, default=0.1)
  args = p.parse_args(argv)
  try:
    rows = dump.read_rows(args.dump)
    res = consistency.context_consistency(rows, args.depths, gamma=args.gamma,
                                          invalid_penalty=args.invalid_penalty)
  except (dump.DumpError, grouping.GroupingError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"anchor groups with >= 2 members: {res['groups']} ({res['rows']} rows)")
  print("depth | groups with mixed histories | return variance explained | chance-corrected")
  for d, m in res["by_depth"].items():
    print(f"{d:>5} | {m['mixed']:>27.3f} | {m['explained']:>25.3f} | {m['explained_adj']:>16.3f}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
