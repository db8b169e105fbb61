"""`ruff check` over the repository (rules and line length in pyproject.toml [tool.ruff]).

This is how CI lints: `.ci/run` runs `make test`, which runs this file. Fix a failure
with the rule's advice (`ruff check --fix` applies the safe fixes); a line that must
break a rule carries `# noqa: CODE  (why)`. `ruff format` is not used.
"""

import os
import subprocess
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff(*args, stdin=None):
  return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO_ROOT, input=stdin,
                        capture_output=True, text=True, timeout=120)


def test_ruff_check_passes():
  result = _ruff("check", "--no-cache", "--output-format", "concise", ".")
  assert result.returncode == 0, "ruff check found problems:\n" + result.stdout + result.stderr


def test_ruff_reads_the_project_config():
  # The check above is only as strict as the config: an unused import and an import of
  # tests/ from the package must both be reported with the project's settings.
  result = _ruff("check", "--no-cache", "--output-format", "concise",
                 "--stdin-filename", "launch/benchmarks/lint_probe.py", "-",
                 stdin="import os\nfrom tests.advantages import advantage_cases\n")
  assert result.returncode == 1, result.stdout + result.stderr
  codes = sorted(line.split()[1] for line in result.stdout.splitlines() if "lint_probe.py:" in line)
  assert codes == ["F401", "F401", "TID251"], result.stdout


def test_no_pylint_pragmas_remain():
  # ruff is the one linter: a pylint pragma comment would suppress nothing and
  # only mislead a reader about which tool runs.
  listed = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO_ROOT, capture_output=True,
                          text=True, check=True).stdout.split()
  offenders = [path for path in listed
               if "pylint" + ":" in open(os.path.join(REPO_ROOT, path), encoding="utf-8").read()]
  assert offenders == []
