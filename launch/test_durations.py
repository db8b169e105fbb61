"""The test suite's time per file and per test, from pytest's JUnit XML reports.

  python -m pytest -n 2 -m "not network" tests --junitxml=cold.xml   # a fresh compile cache
  python -m pytest -n 2 -m "not network" tests --junitxml=warm.xml   # the same cache again
  python -m launch.test_durations cold.xml warm.xml --labels cold,warm \
      --out results/test_durations.md [--command "..."] [--top 40] \
      [--order tests/durations.json]

Each report's time of a test is its setup, call and teardown together (pytest's default
`junit_duration_report`), so a module-scoped fixture's cost lands on the first test that
builds it. The table gives, per file, the number of tests and the summed seconds of each
report (largest first in the first report), then the slowest tests of the first report. Test seconds are summed over the pytest-xdist workers, so
they add to about `workers x wall time`.

`--order FILE` also writes the first report's seconds per file as JSON, slowest first: the
order in which tests/conftest.py hands files to the pytest-xdist workers (longest first, so
no long file starts last). Write it from a cold run.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import xml.etree.ElementTree as ET


def read_report(path: str) -> dict[str, float]:
  """test id (file::name) -> seconds, from one JUnit XML report."""
  try:
    root = ET.parse(path).getroot()
  except (OSError, ET.ParseError) as e:
    raise SystemExit(f"test_durations: cannot read {path}: {e}")
  times = {}
  for case in root.iter("testcase"):
    # classname is the dotted module path (plus a class): tests.training.test_losses[.Cls]
    parts = [p for p in case.get("classname", "").split(".") if not p[:1].isupper()]
    module = "/".join(parts) + ".py"
    times[f"{module}::{case.get('name')}"] = float(case.get("time") or 0.0)
  if not times:
    raise SystemExit(f"test_durations: {path} holds no test cases")
  return times


def per_file(times: dict[str, float]) -> dict[str, tuple[float, int]]:
  """file -> (summed seconds, number of tests)."""
  out: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
  for test, seconds in times.items():
    entry = out[test.split("::")[0]]
    entry[0] += seconds
    entry[1] += 1
  return {f: (s, n) for f, (s, n) in out.items()}


def file_order(times: dict[str, float]) -> dict[str, float]:
  """file -> summed seconds (one decimal), slowest first (ties by name)."""
  files = per_file(times)
  return {f: round(files[f][0], 1) for f in sorted(files, key=lambda f: (-files[f][0], f))}


def render(reports: list[dict[str, float]], labels: list[str], command: str, top: int) -> str:
  files = [per_file(r) for r in reports]
  order = sorted(files[0], key=lambda f: -files[0][f][0])
  head = " | ".join(f"{label} s" for label in labels)
  lines = ["# Test-suite durations", ""]
  if command:
    lines += [f"Command: `{command}`", ""]
  totals = ", ".join(f"{label} {sum(r.values()):.0f} s over {len(r)} tests"
                     for label, r in zip(labels, reports))
  lines += [f"Summed test seconds (setup + call + teardown, both workers): {totals}.", "",
            "## Per file", "", f"| file | tests | {head} |",
            "|---|---:|" + "---:|" * len(labels)]
  for f in order:
    cells = " | ".join(f"{fs[f][0]:.1f}" if f in fs else "-" for fs in files)
    lines.append(f"| {f} | {files[0][f][1]} | {cells} |")
  lines += ["", f"## The {top} slowest tests ({labels[0]})", "", f"| test | {head} |",
            "|---|" + "---:|" * len(labels)]
  for test in sorted(reports[0], key=lambda t: -reports[0][t])[:top]:
    cells = " | ".join(f"{r[test]:.1f}" if test in r else "-" for r in reports)
    lines.append(f"| {test} | {cells} |")
  return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="launch.test_durations",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("reports", nargs="+", help="JUnit XML files (pytest --junitxml)")
  parser.add_argument("--labels", default="", help="comma-separated, one per report")
  parser.add_argument("--out", default="-", help="markdown file to write (- = stdout)")
  parser.add_argument("--command", default="", help="the command the reports came from")
  parser.add_argument("--top", type=int, default=40)
  parser.add_argument("--order", default="",
                      help="also write the first report's seconds per file as JSON (tests/durations.json)")
  args = parser.parse_args(argv)
  labels = [s.strip() for s in args.labels.split(",") if s.strip()] or [
      f"report {i + 1}" for i in range(len(args.reports))]
  if len(labels) != len(args.reports):
    parser.error(f"--labels names {len(labels)} reports, {len(args.reports)} given")
  reports = [read_report(p) for p in args.reports]
  text = render(reports, labels, args.command, args.top)
  if args.order:
    with open(args.order, "w", encoding="utf-8") as f:
      json.dump(file_order(reports[0]), f, indent=0)
      f.write("\n")
  if args.out == "-":
    sys.stdout.write(text)
  else:
    with open(args.out, "w", encoding="utf-8") as f:
      f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
