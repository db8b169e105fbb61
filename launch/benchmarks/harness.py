"""What the benchmarks share: median timing, a baseline revision's tree, the FLOP/s line.

* `median_seconds(fn, reps)`: one side, the median wall time of `reps` calls (each call's
  result waited for: a JAX array's `block_until_ready`, anything else as it returns),
  timed by the trainer's phase timer (`hgpo_jax.progress.PhaseTimes`).
* `alternating_medians(sides, reps)`: several sides, their calls alternating repetition by
  repetition, so that load on a shared machine falls on every side alike.
* `revision_tree(rev)`: the repository at a named revision, a temporary `git worktree`
  (removed afterwards): the one way a benchmark compares with an earlier revision, which
  it takes as a required argument (`--baseline-rev`), never a default.
* `flops_line(name, flops, seconds, peak)`: FLOPs per call, FLOP/s and MFU in one line.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
from typing import Any, Callable, Iterator

from hgpo_jax import progress
from hgpo_jax.cost import hardware

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _wait(result: Any) -> Any:
  """`result` once the device has computed it (JAX arrays, pytrees of them)."""
  import jax
  return jax.block_until_ready(result)


def median_seconds(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
  """(median seconds over `reps` calls of `fn`, the last call's result)."""
  times, result = [], None
  for _ in range(reps):
    timer = progress.PhaseTimes()
    with timer.phase("call"):
      result = _wait(fn())
    times.append(timer.seconds["call"])
  return statistics.median(times), result


def alternating_medians(sides: dict[str, Callable[[], Any]], reps: int, *, warmup: int = 0,
                        per_call: int = 1) -> dict[str, float]:
  """Median seconds of each side's call over `reps` repetitions, the sides alternating
  repetition by repetition, after `warmup` untimed calls each (compilation); each time is
  divided by `per_call` (a call that runs that many steps)."""
  for fn in sides.values():
    for _ in range(warmup):
      _wait(fn())
  times = {name: [] for name in sides}
  for _ in range(reps):
    timer = progress.PhaseTimes()  # the trainer's timer: one phase per side
    for name, fn in sides.items():
      with timer.phase(name):
        _wait(fn())
      times[name].append(timer.seconds[name] / per_call)
  return {name: statistics.median(t) for name, t in times.items()}


@contextlib.contextmanager
def revision_tree(rev: str, prog: str) -> Iterator[str]:
  """The repository at git revision `rev` as a temporary worktree (its path), removed on
  exit. Exits with one line naming `prog` when the revision cannot be checked out (a clone
  with history is needed)."""
  path = os.path.join(tempfile.mkdtemp(prefix="baseline_"), "tree")
  try:
    subprocess.run(["git", "worktree", "add", "--detach", path, rev], cwd=REPO_ROOT,
                   check=True, capture_output=True, text=True)
  except (OSError, subprocess.CalledProcessError) as e:
    raise SystemExit(f"{prog}: error: cannot check out {rev!r} into a worktree (a git clone "
                     f"with history is needed): {getattr(e, 'stderr', e)}".strip()) from None
  try:
    yield path
  finally:
    subprocess.run(["git", "worktree", "remove", "--force", path], cwd=REPO_ROOT,
                   capture_output=True)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def flops_line(name: str, flops: float, seconds: float, peak: hardware.Peak) -> str:
  """One benchmark line: FLOPs per call, achieved FLOP/s and MFU against the peak."""
  rate = flops / seconds if seconds > 0 else 0.0
  return (f"{name}: {flops / 1e9:.3f} GFLOP per call, {rate / 1e9:.2f} GFLOP/s, "
          f"MFU {100 * hardware.mfu(flops, seconds, peak):.2f}% of "
          f"{peak.flops_per_s / 1e9:.1f} GFLOP/s ({peak.source})")
