"""launch/evaluate.py: the evaluation-only entry (prompted rows of the results tables)."""

from __future__ import annotations

import json
import os

import pytest

from configs import sokoban as sokoban_config
from hgpo_jax.training import run_records
from launch import evaluate
from launch.experiments import report


@pytest.mark.slow
def test_untrained_evaluation_writes_a_final_eval_line(tmp_path):
  c = sokoban_config.get_config("algo=grpo,model=tiny,smoke")
  with c.unlocked():
    c.seed = 3
    c.mesh.data = 1
    c.eval.num_tasks = 2
  workdir = str(tmp_path / "eval")
  scalars = evaluate.evaluate_untrained(c, workdir)
  with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
    lines = [json.loads(l) for l in f]
  assert len(lines) == 1 and lines[0]["step"] == evaluate.EVAL_STEP
  assert lines[0]["eval/test/num_tasks"] == 2.0
  assert 0.0 <= lines[0]["eval/test/success"] <= 1.0
  assert 1.0 <= lines[0]["eval/test/episode_length"] <= c.env.max_steps
  assert not any(k.startswith("rollout/") for k in lines[0])
  assert lines[0]["eval/test/success"] == scalars["eval/test/success"]
  # the sweep counts it as a finished run and the table reads its held-out success
  assert run_records.is_finished(workdir)
  r = report.summarize_run(lines, 3, "test")
  assert r.eval_final == lines[0]["eval/test/success"] and r.train_final is None
  assert r.eval_best_step == 0


@pytest.mark.slow
def test_rollout_dump_writes_the_evaluated_steps(tmp_path):
  """With rollout.dump the evaluation's steps are a readable dump: one row per counted
  step of each task (the padding slots' are not), and the metrics follow from its rows."""
  from hgpo_jax.advantages import dump
  from hgpo_jax.training import evaluation
  c = sokoban_config.get_config("algo=grpo,model=tiny,smoke")
  with c.unlocked():
    c.seed = 3
    c.mesh.data = 1
    c.eval.num_tasks = 3  # fewer tasks than the pool's slots: padding slots also play
    c.rollout.dump = True
  workdir = str(tmp_path / "eval")
  scalars = evaluate.evaluate_untrained(c, workdir)
  path = evaluation.eval_dump_path(workdir, "test", evaluate.EVAL_STEP)
  assert os.path.basename(path) == "eval_test_000000.jsonl"
  rows = dump.read_rows(path)
  tasks = sorted({r["traj"] for r in rows})
  assert tasks == [0, 1, 2] and all(r["group"] == r["traj"] and r["split"] == "test" for r in rows)
  lengths = [sum(r["traj"] == t for r in rows) for t in tasks]
  assert sum(lengths) / 3 == pytest.approx(scalars["eval/test/episode_length"])
  for t in tasks:
    steps = [r["step"] for r in rows if r["traj"] == t]
    assert steps == list(range(len(steps)))
  won = [any(r["won"] for r in rows if r["traj"] == t) for t in tasks]
  assert sum(won) / 3 == pytest.approx(scalars["eval/test/success"])
  assert all(isinstance(r["action"], str) and r["response"] for r in rows)


@pytest.mark.slow
def test_repeats_evaluate_every_task_with_their_own_keys(tmp_path):
  """`eval.repeats=3`: repeat 0 is the evaluation without repeats, task for task; the
  metrics are the means over the repeats; every repeat's outcomes are recorded."""
  def evaluated(name, repeats):
    c = sokoban_config.get_config("algo=grpo,model=tiny,smoke")
    with c.unlocked():
      c.seed, c.mesh.data, c.eval.num_tasks, c.eval.repeats = 3, 1, 4, repeats
      c.eval.temperature = 1.0  # the draws differ between keys
    workdir = str(tmp_path / name)
    return evaluate.evaluate_untrained(c, workdir), run_records.read_task_results(workdir)

  one, one_tasks = evaluated("one", 1)
  three, three_tasks = evaluated("three", 3)
  (records,) = three_tasks.values()
  assert [r["repeat"] for r in records] == [0, 1, 2] * 4
  assert [r["index"] for r in records] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
  (base,) = one_tasks.values()
  assert [{k: r[k] for k in base[0]} for r in records if r["repeat"] == 0] == base
  assert "repeat" not in base[0] and "eval/test/repeats" not in one
  lengths = [r["length"] for r in records]
  assert three["eval/test/episode_length"] == pytest.approx(sum(lengths) / 12)
  assert three["eval/test/success"] == pytest.approx(sum(r["won"] for r in records) / 12)
  assert three["eval/test/num_tasks"] == 4.0 and three["eval/test/repeats"] == 3.0
  # the repeats drew other episodes (T=1.0): not three copies of repeat 0
  assert len({tuple(r["length"] for r in records if r["repeat"] == k) for k in range(3)}) > 1


@pytest.mark.slow
def test_grouped_repeats_play_each_task_as_one_group(tmp_path):
  """`eval.group_repeats`: greedy, each of a task's evaluations in its group is the
  ungrouped greedy evaluation's episode (the group's identical prompts give identical
  actions); at T=1.0 the group's members draw their own episodes; the outcomes, metrics
  and dumps are kept per evaluation as with separate passes."""
  from hgpo_jax.advantages import dump
  from hgpo_jax.training import evaluation

  def evaluated(name, repeats, grouped, temperature):
    c = sokoban_config.get_config("algo=grpo,model=tiny,smoke")
    with c.unlocked():
      c.seed, c.mesh.data, c.eval.num_tasks, c.eval.repeats = 3, 1, 3, repeats
      c.eval.group_repeats, c.eval.temperature, c.rollout.dump = grouped, temperature, True
    workdir = str(tmp_path / name)
    out = evaluate.evaluate_untrained(c, workdir)
    (records,) = run_records.read_task_results(workdir).values()
    return out, records, workdir

  _, single, _ = evaluated("single", 1, False, 0.0)
  greedy, grouped, workdir = evaluated("grouped", 4, True, 0.0)
  assert [r["repeat"] for r in grouped] == [0, 1, 2, 3] * 3
  for r in grouped:
    assert {k: r[k] for k in single[0]} == single[r["index"]]
  assert greedy["eval/test/repeats"] == 4.0 and greedy["eval/test/num_tasks"] == 3.0
  assert greedy["eval/test/episode_length"] == pytest.approx(
      sum(r["length"] for r in single) / 3)
  for k in range(4):
    rows = dump.read_rows(evaluation.eval_dump_path(workdir, "test", evaluate.EVAL_STEP, repeat=k))
    assert sorted({r["traj"] for r in rows}) == [0, 1, 2]
    assert [sum(r["traj"] == t for r in rows) for t in range(3)] == [s["length"] for s in single]

  drawn, records, workdir = evaluated("drawn", 4, True, 1.0)
  lengths = [r["length"] for r in records]
  assert drawn["eval/test/episode_length"] == pytest.approx(sum(lengths) / 12)
  assert drawn["eval/test/success"] == pytest.approx(sum(r["won"] for r in records) / 12)
  # the members of a group drew other episodes: not four copies of one
  actions = [tuple(r["action"] for r in dump.read_rows(evaluation.eval_dump_path(
      workdir, "test", evaluate.EVAL_STEP, repeat=k))) for k in range(4)]
  assert len(set(actions)) > 1


def test_grouped_repeats_must_divide_the_slots():
  from hgpo_jax.training import experiment
  c = sokoban_config.get_config("algo=grpo,model=tiny,smoke")
  c.eval.repeats, c.eval.group_repeats = 3, True
  with pytest.raises(experiment.ConfigError,
                     match=r"^config\.eval\.group_repeats .*eval\.repeats=3 .* 4 env slots .*divide them$"):
    experiment.from_config(c)
  c.eval.group_repeats = False  # separate passes take any count
  experiment.from_config(c)


def test_bad_repeats_are_one_line():
  from hgpo_jax.training import experiment
  c = sokoban_config.get_config("algo=grpo,model=tiny,smoke")
  c.eval.repeats = 0
  with pytest.raises(experiment.ConfigError, match=r"^config\.eval\.repeats=0 must be >= 1$"):
    experiment.from_config(c)


def test_empty_eval_splits_are_refused(tmp_path):
  from hgpo_jax import train
  c = sokoban_config.get_config("algo=grpo,model=tiny,smoke")
  with c.unlocked():
    c.env.eval_splits = ()
  with pytest.raises(train.ConfigError, match="eval_splits is empty"):
    evaluate.evaluate_untrained(c, str(tmp_path / "e"))
