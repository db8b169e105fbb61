"""launch.experiments.studies.long_runs: the long-run report from sweep run directories."""

import csv
import json
import os

from launch.experiments import report
from launch.experiments.studies import long_runs


def _run(root, method, seed, successes, extra=None, dumps=()):
  d = os.path.join(root, "mini", "alfworld_mini", method, f"seed_{seed}")
  os.makedirs(os.path.join(d, "rollouts"))
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for it, s in enumerate(successes, 1):
      f.write(json.dumps(dict({"step": it, "rollout/success": s, "rollout/invalid_rate": 0.0,
                               "critic/explained_variance": 0.1 * it}, **(extra or {}))) + "\n")
    f.write(json.dumps({"step": len(successes) + 1, "eval/valid_unseen/success": 0.25}) + "\n")
  with open(os.path.join(d, "log.txt"), "w") as f:
    f.write(f"{report.REVISION_PREFIX}abc123\n")
  for i, rows in enumerate(dumps, 1):
    with open(os.path.join(d, "rollouts", f"iter_{i:06d}.jsonl"), "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in rows)
  return d


def test_segment_positions_restart_at_turn_zero_and_every_non_keep_turn():
  rows = [dict(traj=0, step=s, switch=w) for s, w in
          enumerate(["KEEP", "KEEP", "SWITCH", "KEEP", None, "KEEP"])]
  pos = long_runs.segment_positions(rows)
  assert [pos[(0, s)] for s in range(6)] == [0, 1, 0, 1, 0, 1]


def test_report_files_from_two_methods(tmp_path):
  root = str(tmp_path / "runs")
  hiper = {"critic/explained_variance_low": 0.2, "critic/explained_variance_high": 0.1,
           "critic/explained_variance_term": 0.3, "rollout/switch_rate": 0.5,
           "rollout/subgoal_change_rate": 0.4}
  rows = [dict(traj=0, step=0, switch="SWITCH", advantage=1.0),
          dict(traj=0, step=1, switch="KEEP", advantage=-1.0),
          dict(traj=0, step=2, switch="KEEP", advantage=3.0)]
  _run(root, "hiper", 1, [0.0, 0.5] * 6, hiper, dumps=[rows, rows])
  _run(root, "hiper", 2, [0.5, 1.0] * 6, hiper)
  _run(root, "ppo", 1, [0.25] * 12)
  reading = tmp_path / "reading.md"
  reading.write_text("It learns.\n")
  out = str(tmp_path / "out" / "long")
  assert long_runs.main(["--root", root, "--out", out, "--reading", str(reading)]) == 0
  md = open(out + ".md").read()
  # success at iteration 10 (index 9: 0.5 and 1.0 over the two HiPER seeds) and the last 10
  assert "| HiPER | 1, 2 | 12/12 | 75.0 ± 35.4 |" in md
  assert "| PPO (critic) | 1 | 12 | 25.0 |" in md
  assert "| 25.0 ± 0.0 |" in md  # the held-out evaluation at the end
  assert "`critic/explained_variance_term` | 0.30 ± 0.00 | 0.30 ± 0.00 |" in md
  # advantage by segment position, from the dumps of seed 1 (one per half)
  assert "| first half (1 dumps) | 0 | 1 | +1.000 | 1.000 |" in md
  assert "| second half (1 dumps) | 2 | 1 | +3.000 | 3.000 |" in md
  assert "abc123 (3 runs)" in md and md.rstrip().endswith("It learns.")
  with open(out + ".csv") as f:
    lines = list(csv.DictReader(f))
  assert len(lines) == 36 and lines[0]["method"] == "hiper"
  assert float(lines[0]["rollout/switch_rate"]) == 0.5 and lines[-1]["rollout/switch_rate"] == ""
  assert os.path.getsize(out + ".png") > 0


def test_missing_runs_are_a_one_line_error(tmp_path, capsys):
  assert long_runs.main(["--root", str(tmp_path), "--out", str(tmp_path / "x")]) == 2
  assert "no runs of hiper" in capsys.readouterr().err
