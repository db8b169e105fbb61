"""The metric comparison of `launch.benchmarks.smollm2_iteration` (what its report line says)."""

from launch.benchmarks import smollm2_iteration


def _line(step, **metrics):
  return {"step": step, **metrics}


def test_compare_reports_equal_rollouts_and_the_largest_relative_train_difference():
  base = [_line(1, **{"rollout/success": 0.5, "train/kl": 0.0, "train/loss": 2.0}),
          _line(2, **{"rollout/success": 0.25, "train/kl": 0.05, "train/loss": 1.0})]
  other = [_line(1, **{"rollout/success": 0.5, "train/kl": 1e-3, "train/loss": 2.2}),
           _line(2, **{"rollout/success": 0.25, "train/kl": 0.3, "train/loss": 1.0})]
  # train/kl 0 at iteration 1 has no relative difference; 0.05 -> 0.3 is 5x
  assert smollm2_iteration._compare(base, other) == (
      "rollout metrics equal; largest relative difference of train/* 5 "
      "(train/kl at iteration 2: 0.05 vs 0.3)")


def test_compare_flags_differing_rollouts():
  base = [_line(1, **{"rollout/success": 0.5, "train/loss": 2.0})]
  other = [_line(1, **{"rollout/success": 0.75, "train/loss": 2.0})]
  assert smollm2_iteration._compare(base, other).startswith("rollout metrics DIFFER; largest relative "
                                                    "difference of train/* 0 ()")


def test_detail_gives_median_phase_times_and_mfu():
  phases = {"generation_s": [40.0, 42.0, 41.0], "logprobs_s": [46.0, 47.0, 45.0],
            "update_s": [188.0, 190.0, 180.0]}
  mfu = {"logprobs_mfu": [0.44, 0.46, 0.45], "update_mfu": []}  # no update MFU recorded
  assert smollm2_iteration._detail(phases, mfu) == (
      "generation 41.0 s, logprobs 46.0 s, update 188.0 s, logprobs MFU 0.45")
