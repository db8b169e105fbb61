"""`python -m launch.cpu_numerics {witness,probe,cost} ...`: the package doc says what each does."""

import sys

from launch import cpu_numerics
from launch.cpu_numerics import cost, probe, witness

COMMANDS = {"witness": witness.main, "probe": probe.main, "cost": cost.main}


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if argv and argv[0] in ("-h", "--help"):
    print(cpu_numerics.__doc__)
    return 0
  if not argv or argv[0] not in COMMANDS:
    got = f"'{argv[0]}'" if argv else "none"
    print(f"python -m launch.cpu_numerics: error: name a command: {', '.join(COMMANDS)} "
          f"(got {got})", file=sys.stderr)
    return 2
  return COMMANDS[argv[0]](argv[1:]) or 0


if __name__ == "__main__":
  sys.exit(main())
