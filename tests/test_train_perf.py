"""The trainer's perf/ metrics (compiled FLOPs, FLOP/s, MFU) and its profiler window."""

import glob
import os

import pytest

from configs import sokoban as sokoban_config
from hgpo_jax.cost import hardware
from hgpo_jax import train
from hgpo_jax.training import experiment
from hgpo_jax.training import run_records


@pytest.mark.slow
def test_iterations_report_flops_mfu_and_write_a_profile(tmp_path):
  c = sokoban_config.get_config("algo=hgpo,k=2,smoke")
  with c.unlocked():
    c.mesh.data = 1
    c.eval.at_end = False
    c.profile.iterations = 1  # trace the second iteration (skip=1: the first compiles)
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(experiment.from_config(c), workdir)
  lines = [l for l in run_records.read_metrics(workdir)
           if "perf/update_flops" in l]
  assert len(lines) == c.train.num_iterations
  peak = hardware.device_peak(dtype=c.model.dtype).flops_per_s
  for l in lines:
    # Each iteration: every mini-batch once per PPO epoch; log-probs of old + reference.
    assert l["perf/update_flops"] > 0 and l["perf/logprobs_flops"] > 0
    assert l["perf/update_flop_per_s"] == pytest.approx(l["perf/update_flops"] / l["time/update_s"], rel=1e-6)
    assert l["perf/update_mfu"] == pytest.approx(l["perf/update_flop_per_s"] / peak, rel=1e-6)
    assert 0 < l["perf/update_mfu"] < 1 and 0 < l["perf/logprobs_mfu"] < 1
    assert l["perf/peak_flop_per_s"] == peak
  traces = glob.glob(os.path.join(workdir, "profile", "**", "*.xplane.pb"), recursive=True)
  assert len(traces) == 1
