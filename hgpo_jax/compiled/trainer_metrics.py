"""The trainer's per-iteration FLOP metrics (`perf/*`) and its profiler window.

`LearnerFlops` compiles each Learner program once per batch shape and reads its FLOPs with
`hgpo_jax.cost.hlo.compiled_flops`; `iteration_metrics` turns them and the phases' wall
times into FLOP/s and MFU against `hgpo_jax.cost.hardware.device_peak`.
"""

from __future__ import annotations

import os
from typing import Optional

from hgpo_jax.cost import hardware
from hgpo_jax.cost import hlo
from hgpo_jax.models import lora
from hgpo_jax.training import packing


def _abstract(x, sharding):
  import jax
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


class LearnerFlops:
  """Compiled FLOPs per call of `Learner.compute_logprobs` and `Learner.update`, one
  AOT compile per batch shape (served by the persistent compilation cache when the
  trainer has already compiled the same program)."""

  def __init__(self, learner):
    self.learner = learner
    self._cache: dict[tuple, float] = {}

  def per_call(self, batch) -> dict[str, float]:
    """{"logprobs": FLOPs, "update": FLOPs} per device for one mini-batch of `batch`'s
    row width (a host or device TrainBatch), for a packed mini-batch
    (`training.packing.PackedBatch`, whose row count is its own), or for a length-grouped
    one (a tuple of micro-batch PackedBatches: their gradient programs and the step)."""
    if isinstance(batch, tuple):
      return dict(logprobs=sum(self._compiled("logprobs", x) for x in batch),
                  update=sum(self._compiled("accumulate", x) for x in batch)
                  + self._compiled("apply", batch[0]))
    return dict(logprobs=self._compiled("logprobs", batch), update=self._compiled("update", batch))

  def _compiled(self, program: str, batch) -> float:
    """FLOPs of one Learner program ("logprobs", "update", "accumulate", "apply") on
    `batch`'s shapes (a TrainBatch stands for one mini-batch of its row width)."""
    import jax
    ln = self.learner
    rows = batch.num_rows if isinstance(batch, packing.PackedBatch) else ln.config.mini_batch_rows
    if program == "apply":  # clipping and AdamW: the same for every micro-batch shape
      key = (program,)
    else:
      key = (program,) + tuple((rows,) + tuple(x.shape[1:]) + (str(x.dtype),)
                               for x in jax.tree.leaves(batch))
    if key not in self._cache:
      abstract_batch = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct((rows,) + tuple(x.shape[1:]), x.dtype,
                                         sharding=ln.row_sharding), batch)
      state = ln.abstract_state()
      params = state.params
      # the gradients of the trained params (with LoRA: of the adapters only)
      grads = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, "float32", sharding=p.sharding),
                           lora.trainable_params(params))
      if program == "logprobs":
        lowered = ln.compute_logprobs.lower(params, abstract_batch)
      elif program == "update":
        lowered = ln.update.lower(state, abstract_batch)
      elif program == "accumulate":
        lowered = ln.accumulate.lower(params, grads, abstract_batch)
      else:  # the loss metrics' structure does not change the step's FLOPs; it is taken
        # from the trainer's own call so that the compilation cache serves this compile
        _, metrics = jax.eval_shape(ln.accumulate, params, grads, abstract_batch)
        lowered = ln.apply_gradients.lower(state, grads, metrics)
      self._cache[key] = hlo.compiled_flops(lowered.compile())
    return self._cache[key]


def iteration_metrics(counter: LearnerFlops, batch, *, logprob_passes: int, logprobs_s: float,
                      update_s: float, dtype: str = "float32",
                      peak: Optional[hardware.Peak] = None) -> dict[str, float]:
  """`perf/...` metrics of one trainer iteration: FLOPs per device, FLOP/s and MFU of
  the log-prob passes (`logprob_passes` over the batch: old and/or reference) and of the
  updates, from the wall times (`dtype`: the model's compute dtype, which picks the peak)."""
  ln = counter.learner
  if isinstance(batch, (list, tuple)):  # packed or length-grouped mini-batches, each its own shape
    calls = [counter.per_call(b) for b in batch]
  else:
    calls = [counter.per_call(batch)] * (batch.num_rows // ln.config.mini_batch_rows)
  if peak is None:
    peak = hardware.device_peak(dtype=dtype)
  out = {}
  for name, passes, seconds in (("logprobs", logprob_passes, logprobs_s),
                                ("update", ln.config.ppo_epochs, update_s)):
    flops = sum(c[name] for c in calls) * passes
    out[f"perf/{name}_flops"] = flops
    out[f"perf/{name}_flop_per_s"] = flops / seconds if seconds > 0 else 0.0
    out[f"perf/{name}_mfu"] = hardware.mfu(flops, seconds, peak)
  out["perf/peak_flop_per_s"] = peak.flops_per_s
  return out


class ProfileWindow:
  """A `jax.profiler` trace of `iterations` trainer iterations, after `skip` iterations
  of this run (the first one compiles), written to `<workdir>/profile`
  (open with TensorBoard's profile plugin or ui.perfetto.dev)."""

  def __init__(self, workdir: str, first_iteration: int, iterations: int, skip: int = 1):
    self.dir = os.path.join(workdir, "profile")
    self.start = first_iteration + skip
    self.stop = self.start + iterations  # exclusive
    self.active = False
    self.enabled = iterations > 0

  def before(self, it: int) -> None:
    if self.enabled and it == self.start and not self.active:
      import jax
      os.makedirs(self.dir, exist_ok=True)
      # The .xplane.pb is for TensorBoard's profile plugin; the perfetto_trace.json.gz
      # opens in ui.perfetto.dev.
      jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
      self.active = True

  def after(self, it: int) -> None:
    if self.active and it + 1 >= self.stop:
      self.close()

  def close(self) -> None:
    if self.active:
      import jax
      jax.profiler.stop_trace()
      self.active = False
