"""`python -m launch.experiments.paired_games`: game-by-game comparison over several
evaluations per policy, against a hand count."""

import json

import pytest

from launch.experiments import paired_games
from launch.experiments import report


def _run(tmp_path, name, wins, split="valid_unseen", games=None):
  d = tmp_path / name
  d.mkdir()
  games = games or [f"g{i}" for i in range(len(wins))]
  with open(d / "eval_tasks.jsonl", "w") as f:
    for step, won_at in ((5, [False] * len(wins)), (20, wins)):  # the last step counts
      for i, (g, w) in enumerate(zip(games, won_at)):
        f.write(json.dumps({"step": step, "split": split, "index": i, "task_id": g,
                            "won": w, "return": float(w), "length": 3}) + "\n")
  return str(d)


def test_the_difference_is_of_per_game_means_with_the_paired_interval(tmp_path, capsys):
  a = [_run(tmp_path, "a1", [1, 0, 0, 0]), _run(tmp_path, "a2", [0, 0, 1, 0])]
  b = [_run(tmp_path, "b1", [1, 1, 0, 0]), _run(tmp_path, "b2", [1, 1, 0, 1])]
  out = paired_games.compare(a, b, "valid_unseen")
  # per game: a means (.5, 0, .5, 0), b means (1, 1, 0, .5): differences (.5, 1, -.5, .5)
  assert out["wins"] == {"a": [1, 1], "b": [2, 3]}
  assert out["success"] == {"a": 0.25, "b": 0.625} and out["diff"] == 0.375
  assert out["interval"] == report.paired_bootstrap([0.5, 1.0, -0.5, 0.5])
  assert (out["b_ahead"], out["b_behind"]) == (3, 1)
  assert paired_games.main(["--a", *a, "--b", *b]) == 0
  assert capsys.readouterr().out.splitlines()[-1].startswith("b - a: +37.5 points")


def test_a_run_with_repeats_counts_each_repeat_as_one_evaluation(tmp_path):
  """One run directory holding two repeats (`eval.repeats=2`) == two run directories."""
  d = tmp_path / "rep"
  d.mkdir()
  with open(d / "eval_tasks.jsonl", "w") as f:
    for r, wins in enumerate(([1, 0, 0, 0], [0, 0, 1, 0])):
      for i, w in enumerate(wins):
        f.write(json.dumps({"step": 20, "split": "valid_unseen", "index": i,
                            "task_id": f"g{i}", "won": w, "return": float(w), "length": 3,
                            "repeat": r}) + "\n")
  b = [_run(tmp_path, "b1", [1, 1, 0, 0]), _run(tmp_path, "b2", [1, 1, 0, 1])]
  two = paired_games.compare([_run(tmp_path, "a1", [1, 0, 0, 0]),
                              _run(tmp_path, "a2", [0, 0, 1, 0])], b, "valid_unseen")
  assert paired_games.compare([str(d)], b, "valid_unseen") == two
  assert report.final_games(str(d), "valid_unseen") == (0.5, 0.0, 0.5, 0.0)


def test_runs_of_other_games_or_without_the_split_are_one_line(tmp_path, capsys):
  a = _run(tmp_path, "a", [1, 0])
  other = _run(tmp_path, "o", [1, 0], games=["g0", "x"])
  with pytest.raises(ValueError, match="evaluated other games"):
    paired_games.compare([a], [other], "valid_unseen")
  assert paired_games.main(["--a", a, "--b", a, "--split", "test"]) == 2
  assert capsys.readouterr().err.count("\n") == 1
