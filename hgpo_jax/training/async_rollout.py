"""Rollout ahead of the update: bounded-staleness training (`train.max_staleness = k > 0`).

With k = 0 the trainer plays iteration t's rollout with the weights after iteration t - 1,
then updates: rollout and update take turns. With k > 0 a rollout thread (`Rollouter`)
plays the batches of later iterations while the learner updates, on the same devices or
on devices of its own (`mesh.rollout_devices`), so env latency and host work (and with
split devices the sampler's compute) hide behind the update:

  batch t is sampled with the weights after iteration t - 1 - k
  (the initial weights for t <= k),

a fixed lag, so a run is as deterministic as a synchronous one: `max_staleness=1` equals a
synchronous loop whose iteration t trains on the batch sampled with the weights after
iteration t - 2 (verl's one-step-off-policy; tests/training/test_async_rollout.py). Every
group of a batch is sampled by one policy version; each row is trained exactly
min(t, k) versions after the weights that sampled it (`async/staleness`). The learner
publishes a copy of its parameters after each update (the update donates its buffers);
the thread keeps the versions it still needs (split placement, `mesh.rollout_devices`:
on the sampler's own devices, where the thread plays while the learner computes on the
others: `place`). The sampler and the env pool are the
thread's while it plays a batch: the held-out evaluation takes them between batches
(`paused`), as tunix's rollout lock does during weight sync.

A checkpoint saves the versions the pending batches will be sampled with, so a resumed run
regenerates those batches exactly (`pending_versions`, `restore_versions`).

The rollout correction is the companion of k > 0: the sampler's log-probs travel with
the rows, and `train.rollout_is` weights the update by pi_old / pi_rollout (docs/
algorithms.md §9.9).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp


def sampled_version(iteration: int, max_staleness: int) -> int:
  """The version of the weights batch `iteration` is sampled with: the weights after
  iteration `iteration - 1 - max_staleness` (-1: the initial weights)."""
  return max(iteration - 1 - max_staleness, -1)


def copy_params(params: Any) -> Any:
  """A device copy of `params` that an update donating `params` leaves intact."""
  return jax.tree.map(jnp.copy, params)


class Synchronous:
  """`max_staleness=0`: the batch of an iteration is played when the learner asks for it,
  with the current weights, which the sampler follows after every update (`rebind`)."""

  def __init__(self, play: Callable[[int], Any], rebind: Callable[[], None]):
    self._play, self._rebind = play, rebind

  def take(self, iteration: int) -> tuple[Any, dict[str, float]]:
    return self._play(iteration), {}

  def publish(self, iteration: int, params: Any) -> None:
    self._rebind()

  def for_evaluation(self):
    return contextlib.nullcontext()

  def pending_versions(self, done: int) -> None:
    return None

  def close(self) -> None:
    pass


class Rollouter:
  """Plays the batches of iterations `start, start + 1, ...` in a thread, each with the
  weights its iteration is sampled with (`sampled_version`), at most `max_staleness`
  batches ahead of the learner.

  Args:
    play: `play(iteration, params) -> rollout`: one iteration's batch with those weights
      (the trainer's rollout with its sampler pointed at them).
    start: the first iteration to play.
    max_staleness: k >= 1.
    versions: {version: params} the first batches need (the initial weights at version
      `start - 1`, or a checkpoint's saved versions, `restored_versions`).
    rebind: points the sampler at the learner's current weights (for evaluation).
    place: the params as the sampler keeps a version of them: a copy that an update
      donating the learner's buffers leaves intact, on the sampler's devices (default
      `copy_params`: shared placement; split placement moves them to the sampler's mesh,
      `run.SamplerWeights.copy`). Applied to `versions` and to every published version;
      `play` receives placed params.
    finish: applied to a batch in the learner's thread when it is taken (several
      processes: the gather of every process's rows, a collective that the thread must
      not issue beside the learner's); default none.
  """

  def __init__(self, play: Callable[[int, Any], Any], start: int, end: int,
               max_staleness: int, versions: dict[int, Any], rebind: Callable[[], None],
               place: Callable[[Any], Any] = None, finish: Callable[[Any], Any] = None):
    if max_staleness < 1:
      raise ValueError(f"Rollouter needs max_staleness >= 1, got {max_staleness}")
    self._play, self._next, self._end, self.k = play, start, end, max_staleness
    self._rebind = rebind
    self._place = place or copy_params
    self._finish = finish or (lambda ro: ro)
    self._versions = {v: self._place(p) for v, p in versions.items()}
    self._batches: dict[int, tuple[Any, float]] = {}
    self._cond = threading.Condition()
    self._lock = threading.Lock()  # held while a batch plays: the sampler and the pool
    self._error: BaseException | None = None
    self._stop = False
    self._thread = threading.Thread(target=self._run, name="rollouter", daemon=True)
    self._thread.start()

  def _run(self) -> None:
    try:
      while True:
        with self._cond:
          it = self._next
          need = sampled_version(it, self.k)
          t0 = time.perf_counter()
          self._cond.wait_for(lambda: self._stop or it >= self._end or (
              need in self._versions and len(self._batches) < self.k + 1))
          if self._stop or it >= self._end:
            return
          waited = time.perf_counter() - t0
          params = self._versions[need]
        with self._lock:
          ro = self._play(it, params)
        with self._cond:
          self._batches[it] = (ro, waited)
          self._next = it + 1
          self._cond.notify_all()
    except BaseException as e:  # noqa: BLE001  (re-raised in the learner's thread)
      with self._cond:
        self._error = e
        self._cond.notify_all()

  def take(self, iteration: int) -> tuple[Any, dict[str, float]]:
    """Batch `iteration` (waiting for it) and the `async/*` metrics: its staleness, the
    seconds the learner waited for it and the seconds the thread waited for its weights."""
    t0 = time.perf_counter()
    with self._cond:
      self._cond.wait_for(lambda: iteration in self._batches or self._error is not None)
      if iteration not in self._batches:  # the thread failed before playing it
        raise self._error
      ro, rollout_wait = self._batches.pop(iteration)
      # versions no later batch is sampled with (kept until now: a checkpoint after this
      # iteration saves the versions of the batches not taken yet)
      for v in [v for v in self._versions if v < sampled_version(iteration + 1, self.k)]:
        del self._versions[v]
      self._cond.notify_all()
    staleness = iteration - 1 - sampled_version(iteration, self.k)
    ro = self._finish(ro)
    return ro, {"async/staleness": float(staleness),
                "async/learner_wait_s": time.perf_counter() - t0,
                "async/rollout_wait_s": rollout_wait}

  def publish(self, iteration: int, params: Any) -> None:
    """The weights after `iteration` (placed, a copy: the next update donates `params`)."""
    copy = self._place(params)
    with self._cond:
      self._versions[iteration] = copy
      self._cond.notify_all()

  def pending_versions(self, done: int) -> dict[str, Any]:
    """After `done` finished iterations: the weights of the batches not yet trained on
    that are older than the checkpoint's own params, by lag (`checkpoint_versions`)."""
    with self._cond:
      return {f"lag{j}": self._versions[max(done - 1 - j, -1)] for j in range(1, self.k + 1)}

  @contextlib.contextmanager
  def for_evaluation(self):
    """A context in which no batch plays and the sampler holds the learner's current
    weights: the sampler and the env pool are the caller's (the held-out evaluation)."""
    with self._lock:
      self._rebind()
      yield

  def close(self) -> None:
    with self._cond:
      self._stop = True
      self._cond.notify_all()
    self._thread.join()


def restored_versions(saved: dict[str, Any], done: int, max_staleness: int,
                      current: Any) -> dict[int, Any]:
  """The versions a run resumed after `done` iterations starts its thread with: the saved
  ones by lag (`Rollouter.pending_versions`) and the checkpoint's own params (`Rollouter`
  places a copy of each: the first update donates the buffers they may share with the
  train state)."""
  out = {max(done - 1 - j, -1): saved[f"lag{j}"] for j in range(1, max_staleness + 1)}
  out[done - 1] = current
  return out
