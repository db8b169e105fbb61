"""`python -m launch.experiments.paired_seeds`: two settings seed by seed, against a hand
count."""

import json
import math

import pytest

from launch.experiments import paired_seeds


def _run(tmp_path, name, train, heldout):
  """A finished run: iterations with these train successes, then a final evaluation."""
  d = tmp_path / name
  d.mkdir()
  with open(d / "metrics.jsonl", "w") as f:
    for step, s in enumerate(train, 1):
      f.write(json.dumps({"step": step, "rollout/success": s}) + "\n")
    f.write(json.dumps({"step": len(train) + 1, "eval/valid_unseen/success": heldout}) + "\n")
  return str(d)


def test_paired_differences_with_the_t_interval(tmp_path, capsys):
  a = [_run(tmp_path, "a1", [0, 0.5, 0.5, 0.5], 0.25), _run(tmp_path, "a2", [0, 1, 1, 1], 0.5),
       _run(tmp_path, "a3", [0, 0.5, 1, 0], 0.25)]
  b = [_run(tmp_path, "b1", [0, 0, 0, 0], 0.25), _run(tmp_path, "b2", [0, 1, 0.5, 0.5], 0.5),
       _run(tmp_path, "b3", [1, 0, 0.5, 0.5], 0.5)]
  out = paired_seeds.compare(a, b, "valid_unseen")
  # last-3 means: a (0.5, 1, 0.5), b (0, 2/3, 1/3); differences (-0.5, -1/3, -1/6)
  assert [x for p in out["pairs"] for x in p["train_final"]] == pytest.approx(
      [0.5, 0.0, 1.0, 2 / 3, 0.5, 1 / 3])
  train = out["fields"]["train_final"]
  assert train["diff"] == pytest.approx(-1 / 3)
  sd = math.sqrt(((1 / 6) ** 2 + 0 + (1 / 6) ** 2) / 2)  # of (-1/2, -1/3, -1/6)
  half = 4.303 * sd / math.sqrt(3)
  assert train["interval"] == pytest.approx((-1 / 3 - half, -1 / 3 + half))
  held = out["fields"]["eval_final"]
  assert held["diff"] == pytest.approx(0.25 / 3) and held["a"][0] == pytest.approx(1 / 3)
  assert paired_seeds.main(["--a", *a, "--b", *b]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0] == ("pair 1: train success, last 3 iterations a 50.0 %, b 0.0 %; held-out "
                      "success at the end a 25.0 %, b 25.0 %")
  assert lines[3].startswith("train success, last 3 iterations: a 66.7 ± 28.9 %, b 33.3 ± 33.3 %; "
                             "b - a -33.3 points, 95 % t interval over 3 seeds [-74.7, +8.1]")
  assert lines[3].endswith("(within seed noise)")


def test_unpaired_or_unfinished_runs_are_one_line(tmp_path, capsys):
  a = _run(tmp_path, "a", [0, 1], 0.5)
  cut = tmp_path / "cut"
  cut.mkdir()
  (cut / "metrics.jsonl").write_text(json.dumps({"step": 1, "rollout/success": 0.5}) + "\n")
  for argv in (["--a", a, "--b", a, a], ["--a", a, "--b", str(cut)]):
    assert paired_seeds.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("paired_seeds: ") and err.count("\n") == 1
