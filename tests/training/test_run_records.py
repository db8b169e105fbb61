"""`run_records`: the one reader of run directories (metrics lines, finished runs, the
suite and grid layouts, per-task outcomes)."""

from __future__ import annotations

import json
import os

from hgpo_jax.training import metrics as metrics_lib
from hgpo_jax.training import run_records


def _write(run_dir, lines):
  os.makedirs(run_dir, exist_ok=True)
  with open(os.path.join(run_dir, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for line in lines:
      f.write(json.dumps(line) + "\n")


def test_training_lines_keep_the_last_line_of_each_step_in_step_order(tmp_path):
  run = str(tmp_path / "run")
  _write(run, [{"step": 2, "rollout/success": 0.5}, {"step": 1, "rollout/success": 0.25},
               {"step": 2, "rollout/success": 0.75}, {"step": 2, "eval/x/success": 1.0}])
  assert [(l["step"], l["rollout/success"]) for l in run_records.training_lines(run)] == [
      (1, 0.25), (2, 0.75)]
  assert len(run_records.read_metrics(run)) == 4


def test_a_run_is_finished_by_its_final_evaluation_only(tmp_path):
  run = str(tmp_path / "run")
  assert not run_records.is_finished(run)  # no directory
  _write(run, [{"step": 1, "rollout/success": 0.0, "eval/x/success": 0.5}])
  assert not run_records.is_finished(run)  # a periodic evaluation rides on an iteration
  _write(run, [{"step": 1, "rollout/success": 0.0}, {"step": 1, "eval/x/success": 0.5}])
  assert run_records.is_finished(run)
  with open(run_records.metrics_path(run), "a", encoding="utf-8") as f:
    f.write('{"step": 2, "rollo')  # a line cut by a kill
  assert not run_records.is_finished(run)


def test_find_runs_walks_the_suite_layout_and_find_grid_runs_the_grid_layout(tmp_path):
  for env, method, seed in [("sokoban", "grpo", 1), ("sokoban", "grpo", 0),
                            ("alfworld", "hgpo", 3)]:
    _write(str(tmp_path / "suite" / env / method / f"seed_{seed}"), [{"step": 0}])
  os.makedirs(tmp_path / "suite" / "sokoban" / "grpo" / "seed_9")  # no metrics: not a run
  os.makedirs(tmp_path / "suite" / "sokoban" / "grpo" / "notes")
  base = str(tmp_path / "suite")
  assert [r[:3] for r in run_records.find_runs(base)] == [
      ("alfworld", "hgpo", 3), ("sokoban", "grpo", 0), ("sokoban", "grpo", 1)]
  assert [r[2] for r in run_records.find_runs(base, "sokoban", "grpo")] == [0, 1]
  assert run_records.find_runs(base, "webshop") == []
  _write(str(tmp_path / "grid[1]" / "lr_1e-4" / "seed_2"), [{"step": 0}])
  _write(str(tmp_path / "grid[1]" / "base" / "seed_10"), [{"step": 0}])
  _write(str(tmp_path / "grid[1]" / "base" / "seed_9"), [{"step": 0}])
  runs = run_records.find_grid_runs(str(tmp_path / "grid[1]"))  # a glob character in the root
  assert [r[:2] for r in runs] == [("base", 9), ("base", 10), ("lr_1e-4", 2)]
  assert runs[0][2] == str(tmp_path / "grid[1]" / "base" / "seed_9")


def test_task_results_keep_the_last_record_of_a_task_evaluated_twice(tmp_path):
  run = str(tmp_path / "run")
  assert run_records.read_task_results(run) == {}
  os.makedirs(run)
  metrics_lib.write_task_results(run, 3, "valid", [
      {"index": 1, "won": False}, {"index": 0, "won": True}])
  metrics_lib.write_task_results(run, 3, "valid", [{"index": 1, "won": True}])  # resumed
  got = run_records.read_task_results(run)
  assert list(got) == [(3, "valid")]
  assert [(r["index"], r["won"]) for r in got[(3, "valid")]] == [(0, True), (1, True)]
