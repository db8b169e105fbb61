"""The metric comparison of `launch.benchmarks.iteration` (what its report line says)."""

from launch.benchmarks import iteration


def _line(step, **metrics):
  return {"step": step, **metrics}


def test_compare_reports_equal_rollouts_and_the_largest_relative_train_difference():
  base = [_line(1, **{"rollout/success": 0.5, "train/kl": 0.0, "train/loss": 2.0}),
          _line(2, **{"rollout/success": 0.25, "train/kl": 0.05, "train/loss": 1.0})]
  other = [_line(1, **{"rollout/success": 0.5, "train/kl": 1e-3, "train/loss": 2.2}),
           _line(2, **{"rollout/success": 0.25, "train/kl": 0.3, "train/loss": 1.0})]
  # train/kl 0 at iteration 1 has no relative difference; 0.05 -> 0.3 is 5x
  assert iteration._compare(base, other) == (
      "rollout metrics equal; largest relative difference of train/* 5 "
      "(train/kl at iteration 2: 0.05 vs 0.3)")


def test_compare_flags_differing_rollouts():
  base = [_line(1, **{"rollout/success": 0.5, "train/loss": 2.0})]
  other = [_line(1, **{"rollout/success": 0.75, "train/loss": 2.0})]
  assert iteration._compare(base, other).startswith("rollout metrics DIFFER; largest relative "
                                                    "difference of train/* 0 ()")
