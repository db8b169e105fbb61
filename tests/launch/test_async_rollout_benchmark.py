"""`python -m launch.benchmarks.async_rollout`: its arguments and one side of it."""

from launch.benchmarks import async_rollout


def test_bad_arguments_are_one_line(capsys):
  assert async_rollout.main(["--iterations", "2"]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--iterations must be > 2" in err


def test_a_side_is_the_trainer_with_its_staleness_and_env_latency():
  lines = async_rollout.run_side(async_rollout.DEFAULT_CONFIG, [], 1, 50.0, 3)
  assert [line["step"] for line in lines] == [3]  # iterations after the first two
  assert lines[0]["async/staleness"] == 1.0
  assert lines[0]["time/env_s"] >= 0.05  # at least one delayed Step call
