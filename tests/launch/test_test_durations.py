"""launch.test_durations: per-file and per-test seconds from pytest's JUnit XML reports."""

import json
import os

import conftest
import pytest

from launch import test_durations

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.training.test_losses" name="test_a" time="1.5"/>
<testcase classname="tests.training.test_losses" name="test_b[k3]" time="0.5"/>
<testcase classname="tests.test_train.TestGroup" name="test_c" time="4.0"/>
<testcase classname="tests.test_learning" name="test_d" time="10.25"><skipped/></testcase>
</testsuite></testsuites>
"""


def _write(tmp_path, name, text):
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def test_reports_sum_per_file_and_list_the_slowest(tmp_path):
  cold = _write(tmp_path, "cold.xml", REPORT)
  warm = _write(tmp_path, "warm.xml", REPORT.replace('time="4.0"', 'time="1.0"'))
  times = test_durations.read_report(cold)
  assert times == {"tests/training/test_losses.py::test_a": 1.5,
                   "tests/training/test_losses.py::test_b[k3]": 0.5,
                   "tests/test_train.py::test_c": 4.0, "tests/test_learning.py::test_d": 10.25}
  assert test_durations.per_file(times)["tests/training/test_losses.py"] == (2.0, 2)
  out = tmp_path / "table.md"
  assert test_durations.main([cold, warm, "--labels", "cold,warm", "--out", str(out),
                              "--command", "pytest tests", "--top", "2"]) == 0
  text = out.read_text()
  assert "cold 16 s over 4 tests, warm 13 s over 4 tests" in text
  rows = [l for l in text.splitlines() if l.startswith("| tests/")]
  assert rows[:3] == ["| tests/test_learning.py | 1 | 10.2 | 10.2 |",
                      "| tests/test_train.py | 1 | 4.0 | 1.0 |",
                      "| tests/training/test_losses.py | 2 | 2.0 | 2.0 |"]
  assert rows[3:] == ["| tests/test_learning.py::test_d | 10.2 | 10.2 |",
                      "| tests/test_train.py::test_c | 4.0 | 1.0 |"]


def test_bad_reports_and_labels_are_one_line(tmp_path, capsys):
  with pytest.raises(SystemExit, match="cannot read"):
    test_durations.main([str(tmp_path / "missing.xml")])
  empty = _write(tmp_path, "empty.xml", "<testsuites></testsuites>")
  with pytest.raises(SystemExit, match="holds no test cases"):
    test_durations.main([empty])
  with pytest.raises(SystemExit):
    test_durations.main([empty, "--labels", "a,b"])
  assert "--labels names 2 reports, 1 given" in capsys.readouterr().err


def test_order_file_lists_the_files_slowest_first(tmp_path):
  cold = _write(tmp_path, "cold.xml", REPORT)
  order = tmp_path / "durations.json"
  assert test_durations.main([cold, "--out", str(tmp_path / "t.md"), "--order", str(order)]) == 0
  recorded = json.loads(order.read_text())
  assert list(recorded.items()) == [("tests/test_learning.py", 10.2), ("tests/test_train.py", 4.0),
                                    ("tests/training/test_losses.py", 2.0)]


def test_the_suite_hands_out_the_slowest_recorded_files_first():
  paths = ["tests/a.py", "tests/b.py", "tests/c.py", "tests/d.py"]
  seconds = {"tests/c.py": 5.0, "tests/a.py": 1.0, "tests/gone.py": 9.0}
  assert conftest.module_order(paths, seconds) == ["tests/c.py", "tests/a.py", "tests/b.py",
                                                  "tests/d.py"]
  assert conftest.module_order(paths, {}) == paths


def test_the_committed_order_is_a_cold_run_of_most_of_the_suite():
  """tests/durations.json names existing test files, slowest first (what --order writes)."""
  with open(conftest.DURATIONS_FILE, encoding="utf-8") as f:
    recorded = json.load(f)
  root = os.path.dirname(os.path.dirname(conftest.DURATIONS_FILE))
  present = [p for p in recorded if os.path.exists(os.path.join(root, p))]
  assert len(present) >= 0.9 * len(recorded) and len(present) >= 50, len(present)
  assert list(recorded.values()) == sorted(recorded.values(), reverse=True)
