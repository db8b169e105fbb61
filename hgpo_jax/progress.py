"""The phases of a training iteration: their live console line and their timer.

`PhaseTimes` is the one timer of the trainer, the rollout and the benchmarks: a block
timed as `with times.phase("update", name="update"):` names its phase on the live line
(when `name` is given) and adds its wall seconds to `times.seconds["update"]`, which the
trainer writes as `time/update_s` (verl's `marked_timer(name, timing_raw)`). A phase
entered several times in an iteration (the rollout's generation and env steps, turn after
turn) sums its seconds.

The live line: the iteration bar of the trainer moves once per iteration, which on a small
machine can take minutes; a second line shows what is running meanwhile, with elapsed
times, e.g.

    iterations:  0%|          | 0/2 [00:41<?, ?it/s]
    rollout step 3/50 (12 slots active) | phase 38.2 s | iteration 41.0 s

It is drawn only when the stream (default: stderr) is a terminal. Otherwise (CI logs,
`nohup`, a file) the reporter records the phase and writes nothing, so logs hold only
the iteration lines; the per-phase wall times are in `metrics.jsonl` (`time/*`) anyway.

Usage (the trainer owns one reporter; code deeper down calls the module function):

    with progress.PhaseReporter(enabled=None if jax.process_index() == 0 else False) as reporter:
      for it in range(num_iterations):
        reporter.start_iteration()
        progress.phase("rollout", f"step {t}/{T} ({n} slots active)")   # anywhere
        progress.phase("log-probs")
        progress.phase("update", f"mini-batch {i}/{n}")
        progress.phase("checkpoint")
        progress.phase("evaluation", "valid_unseen")

`enabled=None` means "if the stream is a terminal"; `False` turns it off (e.g. on every
process but the first). The phase clock restarts when the phase *name* changes, not
when only the detail changes (so "rollout" counts the whole rollout, step after step).
While a phase runs, a daemon thread redraws the line every `refresh_s` seconds, so the
elapsed time keeps moving during a long update.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from typing import Callable, Iterator, Optional, TextIO

import tqdm

_ACTIVE: Optional["PhaseReporter"] = None
_ACTIVE_LOCK = threading.Lock()


def phase(name: str, detail: str = "") -> None:
  """Reports a phase to the active reporter (the innermost `with PhaseReporter()`).

  A no-op when no reporter is active, so library code (rollout, update) may call it
  unconditionally.
  """
  reporter = _ACTIVE
  if reporter is not None:
    reporter.phase(name, detail)


class PhaseTimes:
  """Wall seconds per phase, summed over the blocks that name it.

  Args:
    clock: seconds (injectable for tests; default `time.perf_counter`, looked up at each
      call).
  """

  def __init__(self, clock: Optional[Callable[[], float]] = None):
    self.seconds: dict[str, float] = {}
    self._clock = clock or (lambda: time.perf_counter())

  @contextlib.contextmanager
  def phase(self, key: str, name: Optional[str] = None, detail: str = "") -> Iterator[None]:
    """Times the block as phase `key`; with `name`, first enters console phase `name`
    (`phase(name, detail)`). The seconds are added even when the block raises."""
    if name is not None:
      phase(name, detail)
    start = self._clock()
    try:
      yield
    finally:
      self.seconds[key] = self.seconds.get(key, 0.0) + self._clock() - start

  def metrics(self) -> dict[str, float]:
    """The seconds as metrics: `time/<key>_s`."""
    return {f"time/{key}_s": value for key, value in self.seconds.items()}


def active() -> Optional["PhaseReporter"]:
  """The reporter `phase()` forwards to, or None."""
  return _ACTIVE


class PhaseReporter:
  """Shows the current phase and its elapsed time on a second tqdm line.

  Args:
    enabled: True / False, or None = only when `stream` is a terminal.
    stream: where to draw (default `sys.stderr`).
    position: tqdm line position (0 is the trainer's iteration bar).
    refresh_s: redraw interval of the live line; <= 0 disables the redraw thread
      (the line then changes only on `phase` calls).
    clock: monotonic seconds (injectable for tests).
  """

  def __init__(self, enabled: Optional[bool] = None, *, stream: Optional[TextIO] = None,
               position: int = 1, refresh_s: float = 1.0,
               clock: Callable[[], float] = time.monotonic):
    self._stream = sys.stderr if stream is None else stream
    if enabled is None:
      isatty = getattr(self._stream, "isatty", None)
      enabled = bool(isatty and isatty())
    self.enabled = bool(enabled)
    self._position = position
    self._refresh_s = refresh_s
    self._clock = clock
    self._lock = threading.Lock()
    self._name = ""
    self._detail = ""
    now = clock()
    self._phase_start = now
    self._iteration_start = now
    self._bar: Optional[tqdm.tqdm] = None
    self._stop = threading.Event()
    self._thread: Optional[threading.Thread] = None
    self._previous: Optional[PhaseReporter] = None
    self._closed = False

  # ---- what the trainer calls ----------------------------------------------------------

  def start_iteration(self) -> None:
    """Restarts the iteration and phase clocks (call at the top of every iteration);
    the line reads "starting" until the first `phase` call of the iteration."""
    with self._lock:
      self._iteration_start = self._phase_start = self._clock()
      self._name, self._detail = "", ""
    self._draw()

  def phase(self, name: str, detail: str = "") -> None:
    """Enters phase `name` (restarts the phase clock if the name changed) with `detail`."""
    with self._lock:
      if name != self._name:
        self._phase_start = self._clock()
      self._name, self._detail = name, detail
    self._draw()

  def line(self) -> str:
    """The text of the live line, e.g. 'update mini-batch 2/4 | phase 3.1 s | iteration 40.2 s'."""
    with self._lock:
      now = self._clock()
      what = " ".join(part for part in (self._name, self._detail) if part) or "starting"
      return (f"{what} | phase {now - self._phase_start:.1f} s"
              f" | iteration {now - self._iteration_start:.1f} s")

  def close(self) -> None:
    """Stops the redraw thread and removes the line; idempotent."""
    if self._closed:
      return
    self._closed = True
    self._stop.set()
    if self._thread is not None:
      self._thread.join()
    if self._bar is not None:
      self._bar.close()
      self._bar = None

  # ---- context manager: makes this the reporter `progress.phase` forwards to ------------

  def __enter__(self) -> "PhaseReporter":
    global _ACTIVE
    with _ACTIVE_LOCK:
      self._previous, _ACTIVE = _ACTIVE, self
    return self

  def __exit__(self, *exc) -> None:
    global _ACTIVE
    with _ACTIVE_LOCK:
      if _ACTIVE is self:
        _ACTIVE = self._previous
    self.close()

  # ---- drawing -------------------------------------------------------------------------

  def _draw(self) -> None:
    if not self.enabled or self._closed:
      return
    if self._bar is None:
      self._bar = tqdm.tqdm(total=0, bar_format="{desc}", position=self._position,
                            leave=False, file=self._stream, dynamic_ncols=True)
      if self._refresh_s > 0:
        self._thread = threading.Thread(target=self._refresh_loop, name="phase-progress",
                                        daemon=True)
        self._thread.start()
    self._bar.set_description_str(self.line(), refresh=True)

  def _refresh_loop(self) -> None:
    while not self._stop.wait(self._refresh_s):
      bar = self._bar
      if bar is not None:
        bar.set_description_str(self.line(), refresh=True)
