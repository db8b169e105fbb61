"""The phase line: drawn only on a terminal, silent otherwise, clocks per phase and iteration."""

import io
import re

import pytest

from hgpo_jax import progress


class FakeClock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


class Terminal(io.StringIO):
  def isatty(self):
    return True


def test_not_a_terminal_writes_nothing_and_starts_no_thread():
  stream = io.StringIO()
  with progress.PhaseReporter(stream=stream) as reporter:
    assert not reporter.enabled
    progress.phase("rollout", "step 1/50 (32 slots active)")
    progress.phase("update", "mini-batch 1/4")
    assert reporter._thread is None and reporter._bar is None
    # The phase is still recorded (for `line()`), just not drawn.
    assert reporter.line().startswith("update mini-batch 1/4 | ")
  assert stream.getvalue() == ""


def test_terminal_draws_phase_detail_and_elapsed_times():
  clock, stream = FakeClock(), Terminal()
  with progress.PhaseReporter(stream=stream, clock=clock, refresh_s=0) as reporter:
    assert reporter.enabled
    reporter.start_iteration()
    clock.now += 2.0
    progress.phase("rollout", "step 3/50 (12 slots active)")
    clock.now += 1.5
    assert reporter.line() == "rollout step 3/50 (12 slots active) | phase 1.5 s | iteration 3.5 s"
    progress.phase("rollout", "step 4/50 (9 slots active)")  # same phase: clock keeps running
    clock.now += 0.5
    assert reporter.line() == "rollout step 4/50 (9 slots active) | phase 2.0 s | iteration 4.0 s"
    progress.phase("log-probs")  # new phase: its clock restarts
    clock.now += 0.25
    assert reporter.line() == "log-probs | phase 0.2 s | iteration 4.2 s"
    reporter.start_iteration()  # a new iteration: both clocks restart, no stale phase
    assert reporter.line() == "starting | phase 0.0 s | iteration 0.0 s"
  out = stream.getvalue()
  assert "rollout step 3/50 (12 slots active) | phase 0.0 s | iteration 2.0 s" in out
  assert "rollout step 4/50 (9 slots active) | phase 1.5 s | iteration 3.5 s" in out
  assert "log-probs | phase 0.0 s" in out


def test_redraw_thread_moves_the_clock_and_stops_on_close():
  stream = Terminal()
  reporter = progress.PhaseReporter(stream=stream, refresh_s=0.01)
  reporter.phase("update", "mini-batch 2/4")
  thread = reporter._thread
  assert thread is not None and thread.daemon
  # Wait (bounded) until the thread has redrawn the line at least twice more.
  for _ in range(500):
    if stream.getvalue().count("update mini-batch 2/4") >= 3:
      break
    thread.join(0.01)
  assert stream.getvalue().count("update mini-batch 2/4") >= 3
  reporter.close()
  assert not thread.is_alive()
  reporter.close()  # idempotent
  written = stream.getvalue()
  reporter.phase("checkpoint")  # after close: recorded, never drawn
  assert stream.getvalue() == written


def test_module_phase_without_reporter_is_a_noop_and_nesting_restores():
  assert progress.active() is None
  progress.phase("evaluation", "valid_unseen")  # no reporter: nothing happens
  outer = progress.PhaseReporter(enabled=False)
  with outer:
    with progress.PhaseReporter(enabled=False) as inner:
      progress.phase("checkpoint")
      assert progress.active() is inner
    assert progress.active() is outer
    progress.phase("evaluation", "valid_unseen")
  assert progress.active() is None
  assert outer.line().startswith("evaluation valid_unseen | ")
  assert inner.line().startswith("checkpoint | ")


@pytest.mark.parametrize("enabled", [False, True])
def test_explicit_enabled_overrides_terminal_detection(enabled):
  stream = Terminal() if not enabled else io.StringIO()
  with progress.PhaseReporter(enabled=enabled, stream=stream, refresh_s=0) as reporter:
    reporter.phase("update", "mini-batch 1/1")
  assert bool(stream.getvalue()) == enabled
  if enabled:
    assert re.search(r"update mini-batch 1/1 \| phase \d+\.\d s", stream.getvalue())


def test_phase_times_sum_each_phase_and_name_it_on_the_live_line():
  clock, stream = FakeClock(), Terminal()
  times = progress.PhaseTimes(clock=clock)
  with progress.PhaseReporter(stream=stream, clock=clock, refresh_s=0) as reporter:
    for step in range(2):  # a phase entered twice sums its seconds
      with times.phase("generation", name="rollout", detail=f"step {step}"):
        clock.now += 1.5
      with times.phase("env"):  # no name: the live line keeps the rollout phase
        clock.now += 0.25
    assert reporter.line().startswith("rollout step 1 | ")
  assert times.seconds == {"generation": 3.0, "env": 0.5}
  assert times.metrics() == {"time/generation_s": 3.0, "time/env_s": 0.5}


def test_phase_times_count_a_block_that_raises():
  clock = FakeClock()
  times = progress.PhaseTimes(clock=clock)
  with pytest.raises(RuntimeError):
    with times.phase("update"):
      clock.now += 2.0
      raise RuntimeError("dead env server")
  assert times.seconds == {"update": 2.0}
