"""The benchmarks' shared harness (launch/benchmarks/harness.py): medians of alternating
sides, a baseline revision as a required argument, and its one-line refusals."""

import subprocess
import sys
import time

import pytest

from launch.benchmarks import harness


class _Clock:
  """A perf_counter that only the sides advance (each by its call's cost), and the order
  in which the sides were called."""

  def __init__(self):
    self.now, self.calls = 0.0, []

  def __call__(self):
    return self.now


def test_alternating_medians_alternate_and_take_the_median(monkeypatch):
  clock = _Clock()
  monkeypatch.setattr(time, "perf_counter", clock)  # the phase timer's clock
  cost = {"a": iter([1.0, 9.0, 2.0, 7.0]), "b": iter([4.0, 4.0, 40.0, 6.0])}

  def side(name):
    def call():
      clock.calls.append(name)
      clock.now += next(cost[name])
    return call

  med = harness.alternating_medians({"a": side("a"), "b": side("b")}, reps=3, warmup=1,
                                    per_call=2)
  assert clock.calls == ["a", "b", "a", "b", "a", "b", "a", "b"]  # warm-ups, then alternating
  assert med == {"a": 7.0 / 2, "b": 6.0 / 2}  # medians of (9, 2, 7) and (4, 40, 6), per step
  seconds, result = harness.median_seconds(lambda: 5, reps=1)
  assert result == 5 and seconds == 0.0


def test_a_revision_that_cannot_be_checked_out_is_one_line():
  with pytest.raises(SystemExit, match=r"^decode_step: error: cannot check out 'no-such-rev'"):
    with harness.revision_tree("no-such-rev", "decode_step"):
      pass


def test_the_baseline_revision_is_a_required_argument():
  """No commit-hash defaults: the SmolLM2 side-by-side refuses a baseline side without
  --baseline-rev (exit 2, one `prog: error:` line), before any run."""
  done = subprocess.run([sys.executable, "-m", "launch.benchmarks.smollm2_iteration",
                         "--sides", "baseline,current"], capture_output=True, text=True,
                        timeout=120)
  assert done.returncode == 2
  assert done.stderr.strip().splitlines()[-1] == (
      "python -m launch.benchmarks.smollm2_iteration: error: --sides includes baseline: "
      "name its revision with --baseline-rev REV")
