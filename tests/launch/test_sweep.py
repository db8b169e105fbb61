"""The suite sweep and its results renderer (launch/experiments/sweep.py, launch/experiments/suites.py, launch/experiments/report.py).

The renderer is checked on hand-written metrics.jsonl files whose table cells are
computed by hand below; the sweep's resumability with a fake runner (no training).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import json
import os
import shlex
import subprocess
import sys

import pytest

from env_servers.webshop.dataset import Shop
from env_servers.webshop.env import goal_query
from hgpo_jax.models.tokenizer import tiny_tokenizer
from hgpo_jax.training import run_records
from launch.experiments import report
from launch.experiments import suites
from launch.experiments import sweep

ENV = suites.Environment(name="toy", label="Toy", config="configs/sokoban.py", args="dim=6",
                         heldout_split="valid_unseen",
                         overrides={"train.num_iterations": 5, "env.eval_splits": ("valid_unseen",)},
                         num_trajectories=16, group_size=8)
METHODS = (
    suites.Method("a", "Method A", "algo=grpo"),
    suites.Method("b", "Method B", "algo=gigpo"),
    suites.Method("c", "Method C", "algo=ppo", grouped=False),
    suites.Method("e", "Method E", "algo=rloo"),
    suites.Method("d", "Method D", "algo=hgpo"),
    suites.Method("p", "Prompted P", "algo=grpo,model=smollm2-135m", kind=suites.PROMPTED),
)
SUITE = suites.Suite(name="toy_suite", version="toy_v1", environments=(ENV,), methods=METHODS,
                     seeds=(1, 2, 3), reference="a", description="synthetic")
PENDING = {"c": "ConfigError: estimator 'gae' is not trainable yet"}


def pending(env, method):
  del env
  return PENDING.get(method.name)


def _write(root, method, seed, lines, env=ENV.name):
  rd = suites.run_dir(root, SUITE, env, method, seed)
  os.makedirs(rd, exist_ok=True)
  with open(os.path.join(rd, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for line in lines:
      f.write(json.dumps(line) + "\n")
  return rd


def _train_run(success, periodic_eval, final_eval, length=10.0, invalid=0.0):
  """Lines as the trainer writes them: one per iteration (eval at the last one), then the
  final evaluation at step num_iterations + 1."""
  lines = []
  for i, s in enumerate(success, start=1):
    line = {"step": i, "rollout/success": s, "rollout/episode_length": 8.0,
            "rollout/invalid_rate": 0.0}
    if i == len(success):
      line["eval/valid_unseen/success"] = periodic_eval
    lines.append(line)
  lines.append({"step": len(success) + 1, "eval/valid_unseen/success": final_eval,
                "eval/valid_unseen/episode_length": length,
                "eval/valid_unseen/invalid_rate": invalid})
  return lines


# Method A (the reference): per seed train success, periodic eval (it. 5), final eval,
# eval episode length and invalid rate.
A = {1: ([0.1, 0.3, 0.5, 0.6, 0.7], 0.5, 0.4, 10.0, 0.0),    # last 3: 0.6,  50 % at it. 3
     2: ([0.2, 0.2, 0.4, 0.4, 0.55], 0.25, 0.3, 12.0, 0.1),  # last 3: 0.45, 50 % at it. 5
     3: ([0.0, 0.6, 0.3, 0.3, 0.3], 0.75, 0.5, 14.0, 0.2)}   # last 3: 0.3,  50 % at it. 2
# Method B: train final - A = +0.1, -0.1, +0.05 (mixed signs: within noise);
# final eval - A = +0.1, +0.2, +0.3 (all positive: outside noise).
B = {1: ([0.7] * 5, 0.1, 0.5), 2: ([0.35] * 5, 0.1, 0.5), 3: ([0.35] * 5, 0.1, 0.8)}


@pytest.fixture
def runs(tmp_path):
  root = str(tmp_path / "runs")
  for seed, (succ, per, fin, length, inv) in A.items():
    _write(root, "a", seed, _train_run(succ, per, fin, length, inv))
  for seed, (succ, per, fin) in B.items():
    _write(root, "b", seed, _train_run(succ, per, fin))
  for seed in (1, 2, 3):
    _write(root, "e", seed, _train_run([0.2] * 5, 0.2, 0.2))
    _write(root, "p", seed, [{"step": 0, "eval/valid_unseen/success": 0.1 * seed,
                              "eval/valid_unseen/episode_length": 20.0,
                              "eval/valid_unseen/invalid_rate": 0.0}])
  # D: killed mid-run (no final evaluation): not counted, reported as unfinished.
  _write(root, "d", 1, _train_run([0.9] * 3, 0.9, 0.9)[:3])
  return root


def _rows(md: str) -> dict[str, list[str]]:
  out = {}
  for line in md.splitlines():
    if not line.startswith("| "):
      continue
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if cells[0] != "Method":  # the header
      out[cells[0]] = cells[1:]
  return out


def test_table_cells_hand_computed(runs, tmp_path):
  paths = report.render(runs, SUITE, str(tmp_path / "results"), "CMD", pending=pending)
  with open(paths["md"], encoding="utf-8") as f:
    md = f.read()
  rows = _rows(md)
  # columns: seeds, train, eval, best, iters, length, invalid, note
  # A train: mean(0.6, 0.45, 0.3) = 0.45, sample std 0.15; final eval 0.4 ± 0.1;
  # best = 0.75 (seed 3, periodic eval at it. 5); 50 % at it. 3, 5, 2: mean 3.33,
  # std sqrt(((1/3)^2 + (5/3)^2 + (4/3)^2) / 2) = 1.53; length 12 ± 2; invalid 10 ± 10 %.
  assert rows["Method A"] == ["3 (ref)", "45.0 ± 15.0", "40.0 ± 10.0", "best 75.0 (seed 3, it. 5)",
                              "3.3 ± 1.5", "12.0 ± 2.0", "10.0 ± 10.0", "(ref)", ""]
  # B: train 0.7, 0.35, 0.35 -> 46.7 ± 20.2 within noise of A; eval 0.5, 0.5, 0.8 ->
  # 60.0 ± 17.3 (diffs all > 0: no mark); its peak is a final evaluation (step 6 in the
  # file: the weights after iteration 5); only seed 1 reaches 50 % (at it. 1).
  assert rows["Method B"][:5] == ["3", "46.7 ± 20.2 ≈", "60.0 ± 17.3", "best 80.0 (seed 3, it. 5)",
                                  "1.0 (1/3 seeds)"]
  # Detectable difference: t(0.975, 2) = 4.303 times the std of the paired differences
  # over sqrt(3): train diffs +0.1, -0.1, +0.05 (std 0.10408) -> 25.9 points; eval diffs
  # +0.1, +0.2, +0.3 (std 0.1) -> 24.8 points.
  assert rows["Method B"][7] == "25.9 / 24.8"
  # E: train diffs -0.4, -0.25, -0.1 (std 0.15) -> 37.3; prompted P: eval diffs -0.3, -0.1,
  # -0.2 (std 0.1) -> 24.8, no training column.
  assert rows["Method E"][7] == "37.3 / 24.8" and rows["Prompted P"][7] == "— / 24.8"
  # The power line: median paired std 0.15 (train: B 0.104, E 0.15 ... median of B, E)
  assert "Held-out success: the split's default number of games." in md
  assert rows["Method E"][4] == "not reached (> 5)"
  assert rows["Method E"][1:3] == ["20.0 ± 0.0", "20.0 ± 0.0"]  # diffs -0.4,-0.25,-0.1 / -0.2,-0.1,-0.3
  assert rows["Method C"][0] == "pending" and "not trainable" in rows["Method C"][-1]
  assert rows["Method D"][0] == "0" and rows["Method D"][-1] == "1 unfinished"
  # Prompted: evaluation only; success 0.1, 0.2, 0.3; the peak is the start (no training).
  assert rows["Prompted P"][:5] == ["3", "— (no training)", "20.0 ± 10.0", "best 30.0 (seed 3, start)",
                                    "—"]
  for key in ("command: `CMD`", "suite: toy_suite, version toy_v1", "git: ", "packages: jax ",
              "machine: "):
    assert key in md, key
  # 6 methods x 3 seeds: A, B, E and P finished (12); D has one unfinished run and two not
  # started; C cannot run (pending, 3).
  assert ("**Sweep in progress: 12 of 18 runs finished** (1 unfinished, 2 not started, "
          "3 pending)") in md


def test_a_finished_sweep_has_no_progress_line(runs):
  cells = report.build_cells(runs, SUITE, lambda env, method: None)
  assert report.progress_line(cells, SUITE).startswith("**Sweep in progress: 12 of 18 runs")
  for seed in (1, 2, 3):
    _write(runs, "d", seed, _train_run([0.2] * 5, 0.2, 0.2))
  # Only C's runs are left, and C cannot run (pending): nothing is in progress.
  assert report.progress_line(report.build_cells(runs, SUITE, pending), SUITE) is None
  for seed in (1, 2, 3):
    _write(runs, "c", seed, _train_run([0.2] * 5, 0.2, 0.2))
  assert report.progress_line(report.build_cells(runs, SUITE, lambda env, method: None),
                              SUITE) is None


def test_equal_paired_differences_detect_nothing(runs, tmp_path):
  """Two or more seeds whose differences from the reference are all equal (held-out success
  moves in whole games) have no spread: the cell says so instead of a detectable 0.0."""
  for seed, final in ((1, 0.5), (2, 0.4), (3, 0.6)):  # A's final evals + 0.1 on every seed
    _write(runs, "e", seed, _train_run([0.2] * 5, 0.2, final))
  rows = _rows(open(report.render(runs, SUITE, str(tmp_path / "r"), "CMD",
                                  pending=pending)["md"], encoding="utf-8").read())
  assert rows["Method E"][7] == "37.3 / n/a (equal paired differences)"
  assert rows["Method D"][7] == "—"  # no finished seed: no cell


def test_detectable_difference_and_seeds_to_detect():
  assert report.detectable_difference([0.1]) is None
  assert report.detectable_difference([0.0625, 0.0625]) is None  # no spread: measures nothing
  assert report.detectable_difference([0.1, 0.2, 0.3]) == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
  # std 0.1 and a 10-point target: n = 6 gives 2.571 * 0.1 / sqrt(6) = 0.105 > 0.1, n = 7
  # gives 2.447 * 0.1 / sqrt(7) = 0.0925.
  assert report.seeds_to_detect(0.1, 0.1) == 7
  assert report.seeds_to_detect(10.0, 0.1) is None


def test_render_refuses_mixed_trainer_revisions_unless_told(runs, tmp_path, capsys, monkeypatch):
  for method, revision in (("a", "abc123"), ("b", "def456")):
    with open(os.path.join(suites.run_dir(runs, SUITE, "toy", method, 1), "log.txt"), "w",
              encoding="utf-8") as f:
      f.write(f"{report.REVISION_PREFIX}{revision}\n")
  with pytest.raises(report.MixedRevisionsError,
                     match="column 'toy' .* 3 trainer revisions .*abc123 \\(1 runs\\)"):
    report.render(runs, SUITE, str(tmp_path / "results"), "CMD", pending=pending)
  assert not os.path.exists(tmp_path / "results")  # nothing written
  paths = report.render(runs, SUITE, str(tmp_path / "results"), "CMD", pending=pending,
                        allow_mixed_revisions=True)
  md = open(paths["md"], encoding="utf-8").read()
  assert "**Mixed trainer revisions**" in md and "def456 (1 runs)" in md
  monkeypatch.setitem(suites.SUITES, "toy_suite", SUITE)
  monkeypatch.setattr(suites, "pending_reason", pending)
  assert sweep.main(["render", "--suite", "toy_suite", "--root", runs, "--out",
                     str(tmp_path / "r2")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("launch.experiments.sweep: error: the finished runs of column 'toy' under")
  assert err.count("\n") == 1


def test_render_puts_the_reading_under_the_tables(runs, tmp_path, monkeypatch, capsys):
  """`render --reading FILE`: the file's text under "## Reading", after the last table
  and before the footer, and the command says it; a missing file: one-line error."""
  monkeypatch.setitem(suites.SUITES, "toy_suite", SUITE)
  monkeypatch.setattr(suites, "pending_reason", pending)
  reading = tmp_path / "reading.md"
  reading.write_text("Method B beats A held out (+20 points).\n", encoding="utf-8")
  out = tmp_path / "results"
  assert sweep.main(["render", "--suite", "toy_suite", "--root", runs, "--out", str(out),
                     "--reading", str(reading)]) == 0
  md = (out / "toy_suite.md").read_text(encoding="utf-8")
  last_row = md.rindex("| Prompted P |")
  at = md.index("## Reading\n\nMethod B beats A held out (+20 points).\n")
  assert last_row < at < md.index("\n---\n") < md.index("--reading")
  capsys.readouterr()
  assert sweep.main(["render", "--suite", "toy_suite", "--root", runs, "--out", str(out),
                     "--reading", str(tmp_path / "none.md")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("launch.experiments.sweep: error: --reading") and err.count("\n") == 1
  plain = report.render(runs, SUITE, str(tmp_path / "plain"), "CMD", pending=pending)
  assert "## Reading" not in open(plain["md"], encoding="utf-8").read()


def test_the_record_files_of_finished_runs_render_the_same_table(runs, tmp_path, monkeypatch,
                                                                 capsys):
  """`plan --records` lists metrics.jsonl, log.txt and, where written, eval_tasks.jsonl
  of each finished run (not of the killed one); a root holding only those files renders
  the same cells and game-by-game lines, and the sweep counts its runs as done (a later
  sweep resumes from committed records)."""
  monkeypatch.setitem(suites.SUITES, "toy_suite", SUITE)
  monkeypatch.setattr(suites, "pending_reason", pending)
  finished = [(m, s) for m in "abep" for s in (1, 2, 3)]
  for method, seed in finished + [("d", 1)]:  # the killed run logged its command too
    _log_command(runs, method, seed, suites.command(runs, SUITE, ENV, SUITE.method(method), seed))
  checkpoint = os.path.join(suites.run_dir(runs, SUITE, "toy", "a", 1), "checkpoints", "1")
  os.makedirs(checkpoint)
  with_games = {("a", 1): 6, ("p", 1): 0}
  for (method, seed), step in with_games.items():
    _write_games(suites.run_dir(runs, SUITE, "toy", method, seed), step, [True, False, seed == 1])
  capsys.readouterr()
  assert sweep.main(["plan", "--suite", "toy_suite", "--root", runs, "--records"]) == 0
  listed = capsys.readouterr().out.split()
  assert listed == [os.path.join(suites.run_dir(runs, SUITE, "toy", m, s), f)
                    for m, s in finished for f in report.RECORD_FILES
                    if f != "eval_tasks.jsonl" or (m, s) in with_games]
  copy = str(tmp_path / "records")
  for path in listed:
    dst = os.path.join(copy, os.path.relpath(path, runs))
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(path, encoding="utf-8") as src, open(dst, "w", encoding="utf-8") as out:
      out.write(src.read())
  texts = [open(report.render(root, SUITE, str(tmp_path / name), "CMD", pending=pending)["md"],
                encoding="utf-8").read() for root, name in ((runs, "from_runs"), (copy, "from_records"))]
  tables = [_rows(t) for t in texts]
  for t in tables:  # D's note counts the killed run, which has no records
    t.pop("Method D")
  assert tables[0] == tables[1] and len(tables[0]) == 5
  games = [[l for l in t.splitlines() if l.startswith("- Method")] for t in texts]
  assert games[0] == games[1] and len(games[0]) == 1
  assert [e["status"] for e in sweep.plan_suite(SUITE, copy, methods=["a"], pending=pending)] \
      == ["done"] * 3


def test_columns_may_come_from_different_trainer_revisions(runs, tmp_path):
  """One revision per column is a table (methods are compared within a column); the
  footer lists each column's revision. A second revision inside a column is refused."""
  other = suites.Environment(name="toy2", label="Toy two", config="configs/sokoban.py",
                             args="dim=6", heldout_split="valid_unseen", overrides={})
  two = suites.Suite(name="toy_suite", version="toy_v1", environments=(ENV, other),
                     methods=METHODS, seeds=(1, 2, 3), reference="a")
  for seed, (succ, per, fin, length, inv) in A.items():
    _write(runs, "a", seed, _train_run(succ, per, fin, length, inv), env="toy2")
  for env, revision in (("toy", "abc123"), ("toy2", "def456")):
    for method in ("a", "b", "d", "e", "p"):
      for seed in (1, 2, 3):
        workdir = suites.run_dir(runs, two, env, method, seed)
        if os.path.isdir(workdir):
          with open(os.path.join(workdir, "log.txt"), "w", encoding="utf-8") as f:
            f.write(f"{report.REVISION_PREFIX}{revision}\n")
  paths = report.render(runs, two, str(tmp_path / "results"), "CMD", pending=pending)
  md = open(paths["md"], encoding="utf-8").read()
  assert "Mixed trainer revisions" not in md and "methods are compared within a column only" in md
  assert ("trainer revisions of the runs: Toy: abc123 (12 runs); Toy two: def456 (3 runs)"
          in md)
  with open(os.path.join(suites.run_dir(runs, two, "toy2", "a", 1), "log.txt"), "w",
            encoding="utf-8") as f:
    f.write(f"{report.REVISION_PREFIX}abc123\n")
  with pytest.raises(report.MixedRevisionsError, match="column 'toy2'"):
    report.render(runs, two, str(tmp_path / "r2"), "CMD", pending=pending)


def test_table_holds_no_machine_paths(runs, tmp_path):
  """A run root outside the working directory is shown as a placeholder, not its path."""
  paths = report.render(runs, SUITE, str(tmp_path / "results"), f"python -m x --root {runs}",
                        pending=pending)
  md = open(paths["md"], encoding="utf-8").read()
  assert str(tmp_path) not in md and "--root '<run root>'" not in md
  assert "`python -m x --root <run root>` (runs under `<run root>`" in md


def test_csv_numbers(runs, tmp_path):
  paths = report.render(runs, SUITE, str(tmp_path / "results"), "CMD", pending=pending)
  with open(paths["csv"], encoding="utf-8") as f:
    rows = {r["method"]: r for r in csv.DictReader(f)}
  a, b = rows["a"], rows["b"]
  assert float(a["train_final_mean"]) == pytest.approx(0.45, abs=1e-9)
  assert float(a["train_final_std"]) == pytest.approx(0.15, abs=1e-9)
  assert float(a["iters_to_50_mean"]) == pytest.approx(10 / 3, abs=1e-5)
  assert a["iters_to_50_reached"] == "3/3"
  assert (a["eval_best"], a["eval_best_seed"], a["eval_best_step"]) == ("0.75", "3", "5")
  assert a["train_within_noise"] == "" and a["eval_within_noise"] == ""  # the reference
  assert b["train_within_noise"] == "true" and b["eval_within_noise"] == "false"
  assert rows["c"]["status"] == "pending" and rows["d"]["status"] == "not run"
  assert rows["p"]["train_final_mean"] == "" and float(rows["p"]["eval_final_mean"]) == pytest.approx(0.2)


def test_paired_bootstrap_marks_noise():
  # Mean of a resample lies in [min, max] of the diffs: all-positive diffs never contain 0.
  lo, hi = report.paired_bootstrap([0.1, 0.2, 0.3])
  assert 0.1 - 1e-12 <= lo < hi <= 0.3 + 1e-12
  # Mixed signs, 3 seeds: an all-(-0.1) resample has probability 1/27 = 3.7 % > 2.5 %, so
  # the 2.5th percentile is -0.1 (and the 97.5th is 0.1 by symmetry of the counts).
  lo, hi = report.paired_bootstrap([0.1, -0.1, 0.05])
  assert lo == pytest.approx(-0.1) and hi == pytest.approx(0.1)
  assert report.paired_bootstrap([0.2, 0.2]) == pytest.approx((0.2, 0.2))
  assert report.paired_bootstrap([0.1, -0.1, 0.05]) == report.paired_bootstrap([0.1, -0.1, 0.05])
  one = [report.SeedResult(1, 0.5, None, 5, 0.5, 0.5, 5, None, None, None, None, ())]
  assert report.within_noise(one, one, "eval_final") is None  # < 2 paired seeds


def test_best_eval_is_earliest_peak_and_never_a_mean():
  lines = _train_run([0.1, 0.2, 0.3], 0.9, 0.9)
  lines[0]["eval/valid_unseen/success"] = 0.9  # same peak at it. 1 and 3 and the final
  r = report.summarize_run(lines, 7, "valid_unseen")
  assert (r.eval_best, r.eval_best_step, r.iters_to_threshold) == (0.9, 1, None)
  assert r.train_final == pytest.approx(0.2)


def test_plot_is_written(runs, tmp_path):
  paths = report.render(runs, SUITE, str(tmp_path / "results"), "CMD", pending=pending)
  with open(paths["png"], "rb") as f:
    data = f.read()
  assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_is_finished(tmp_path):
  rd = str(tmp_path / "r")
  assert not run_records.is_finished(rd)
  os.makedirs(rd)
  with open(os.path.join(rd, "metrics.jsonl"), "w", encoding="utf-8") as f:
    f.write(json.dumps({"step": 1, "rollout/success": 0.1, "eval/x/success": 0.2}) + "\n")
  assert not run_records.is_finished(rd)  # a periodic evaluation is not the final one
  with open(os.path.join(rd, "metrics.jsonl"), "a", encoding="utf-8") as f:
    f.write('{"step": 2, "eval/x/succ')  # cut by a kill
  assert not run_records.is_finished(rd)


class FakeRunner:
  """Records calls; writes a finished (or, for `unfinished`, a killed) run."""

  def __init__(self, rc=0, unfinished=()):
    self.calls, self.rc, self.unfinished = [], rc, set(unfinished)

  def __call__(self, cmd, workdir):
    self.calls.append(workdir)
    os.makedirs(workdir, exist_ok=True)
    lines = _train_run([0.5] * 5, 0.5, 0.5)
    if os.path.basename(os.path.dirname(workdir)) in self.unfinished:
      lines = lines[:2]
    with open(os.path.join(workdir, "metrics.jsonl"), "a", encoding="utf-8") as f:
      f.writelines(json.dumps(l) + "\n" for l in lines)
    return self.rc


def test_suite_runs_are_resumable(tmp_path):
  root = str(tmp_path / "sweeps")
  logs = []
  first = FakeRunner(unfinished={"b"})
  failures = sweep.run_suite(SUITE, root, runner=first, pending=pending, log=logs.append)
  # 5 runnable methods (c is pending) x 3 seeds; b's runs end without a final evaluation.
  assert len(first.calls) == 15 and failures == 3
  assert not any("/c/" in w for w in first.calls)
  assert sum("pending" in l for l in logs) == 3
  second = FakeRunner()
  assert sweep.run_suite(SUITE, root, runner=second, pending=pending, log=logs.append) == 0
  # Only the unfinished runs are launched again, in their own workdirs (the trainer
  # resumes there from the checkpoint); finished runs are skipped.
  assert sorted(second.calls) == sorted(suites.run_dir(root, SUITE, "toy", "b", s) for s in (1, 2, 3))
  third = FakeRunner()
  assert sweep.run_suite(SUITE, root, runner=third, pending=pending, log=logs.append) == 0
  assert third.calls == []
  # a selection: one method, one seed
  entries = sweep.plan_suite(SUITE, root, methods=["a"], seeds=[2], pending=pending)
  assert [(e["method"], e["seed"], e["status"]) for e in entries] == [("a", 2, "done")]
  with pytest.raises(ValueError, match="seeds \\[4\\]"):
    sweep.plan_suite(SUITE, root, seeds=[4], pending=pending)


def test_run_logs_record_the_trainer_revision_and_the_footer_counts_them(runs, tmp_path,
                                                                        monkeypatch):
  monkeypatch.setattr(sweep.subprocess, "call", lambda *a, **k: 0)
  workdir = suites.run_dir(runs, SUITE, "toy", "a", 1)
  sweep.subprocess_runner([sys.executable, "-c", "pass"], workdir)
  with open(os.path.join(workdir, "log.txt"), encoding="utf-8") as f:
    first, command = f.readline(), f.readline()
  assert first == report.REVISION_PREFIX + report.git_revision() + "\n"
  # committed records carry no machine path: the interpreter is logged as `python`
  assert command == "$ python -c pass\n"
  with open(os.path.join(suites.run_dir(runs, SUITE, "toy", "b", 2), "log.txt"), "w",
            encoding="utf-8") as f:  # a resumed run: its last launch counts
    f.write(f"{report.REVISION_PREFIX}old\n$ x 'a b'\n{report.REVISION_PREFIX}abc123\n$ y\n")
  assert report.read_run_log(suites.run_dir(runs, SUITE, "toy", "b", 2)) == report.RunLog(
      revisions=["old", "abc123"], commands=[["x", "a b"], ["y"]])
  line = [l for l in report.footer(SUITE, "CMD", runs) if l.startswith("trainer revisions")][0]
  # finished runs: a x3, b x3, e x3, p x3 (d is unfinished and not counted)
  expected = sorted([f"{report.git_revision()} (1 runs)", "abc123 (1 runs)",
                     "not recorded (10 runs)"])
  assert line == "trainer revisions of the runs: " + ", ".join(expected)


def _log_command(root, method, seed, cmd):
  with open(os.path.join(suites.run_dir(root, SUITE, "toy", method, seed), "log.txt"), "a",
            encoding="utf-8") as f:
    f.write(f"{report.REVISION_PREFIX}abc123\n{report.COMMAND_PREFIX}{shlex.join(cmd)}\n")


def test_a_run_of_another_command_is_stale_neither_resumed_nor_rendered(runs, tmp_path,
                                                                        monkeypatch, capsys):
  """A run whose log records another command than its cell's (a run of an older suite
  definition) is refused by the sweep and by the render; the interpreter and the workdir
  (a moved run root) are not compared."""
  method = SUITE.method("a")
  cmd = suites.command(runs, SUITE, ENV, method, 1, python="/elsewhere/bin/python")
  moved = [a if not a.startswith("--workdir=") else "--workdir=/old/root/a/seed_1" for a in cmd]
  _log_command(runs, "a", 1, moved)
  assert report.stale_runs(runs, SUITE) == []
  report.render(runs, SUITE, str(tmp_path / "ok"), "CMD", pending=pending,  # not refused
                allow_mixed_revisions=True)
  def old(seed):  # the command of an older definition of the suite
    return [a.replace("train.num_iterations=5", "train.num_iterations=4")
            for a in suites.command(runs, SUITE, ENV, method, seed)]
  _log_command(runs, "a", 2, old(2))
  _log_command(runs, "a", 3, suites.command(runs, SUITE, ENV, method, 3)
               + ["--config.eval.num_tasks=24"])
  expected_reason = ("it ran with --config.train.num_iterations=4 where the suite's command "
                     "has --config.train.num_iterations=5")
  assert report.stale_runs(runs, SUITE) == [
      ("toy/a/seed_2", expected_reason),
      ("toy/a/seed_3", "it ran with --config.eval.num_tasks=24 where the suite's command has "
                       "(nothing more)")]
  with pytest.raises(report.StaleRunError,
                     match="2 finished run\\(s\\) .* toy_v1's commands, first toy/a/seed_2: it "
                           "ran with --config.train.num_iterations=4"):
    report.render(runs, SUITE, str(tmp_path / "results"), "CMD", pending=pending)
  assert not os.path.exists(tmp_path / "results")  # nothing written
  monkeypatch.setitem(suites.SUITES, "toy_suite", SUITE)
  monkeypatch.setattr(suites, "pending_reason", pending)
  assert sweep.main(["render", "--suite", "toy_suite", "--root", runs, "--out",
                     str(tmp_path / "r2")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("launch.experiments.sweep: error: 2 finished run(s) under") and err.count("\n") == 1
  # the sweep neither resumes nor replaces a stale run, finished or not, and counts it failed
  _write(runs, "d", 2, _train_run([0.5] * 2, 0.5, 0.5)[:2])
  _log_command(runs, "d", 2, [a.replace("=5", "=4")
                              for a in suites.command(runs, SUITE, ENV, SUITE.method("d"), 2)])
  entries = {(e["method"], e["seed"]): e for e in
             sweep.plan_suite(SUITE, runs, methods=["a", "d"], pending=pending)}
  assert [entries[("a", s)]["status"] for s in (1, 2, 3)] == ["done", "stale", "stale"]
  assert entries[("d", 2)]["status"] == "stale" and entries[("d", 1)]["status"] == "todo"
  assert entries[("a", 2)]["reason"].startswith(expected_reason + "; move ")
  runner, logs = FakeRunner(), []
  assert sweep.run_suite(SUITE, runs, methods=["a", "d"], runner=runner, pending=pending,
                         log=logs.append) == 3
  assert sorted(runner.calls) == [suites.run_dir(runs, SUITE, "toy", "d", s) for s in (1, 3)]
  assert sum(l.startswith("[sweep] STALE    toy/") for l in logs) == 3


def test_failed_run_is_reported_not_skipped(tmp_path):
  root = str(tmp_path / "sweeps")
  runner = FakeRunner(rc=1)
  assert sweep.run_suite(SUITE, root, methods=["a"], seeds=[1], runner=runner,
                         pending=pending, log=lambda _: None) == 1


def test_commands_and_grouping():
  cmd = suites.command("R", SUITE, ENV, SUITE.method("c"), 2, python="py")
  assert cmd[:6] == ["py", "-m", "launch.main", "--config=configs/sokoban.py:algo=ppo,dim=6",
                     "--workdir=R/toy_suite/toy/c/seed_2", "--config.seed=2"]
  assert "--config.rollout.num_groups=16" in cmd and "--config.rollout.group_size=1" in cmd
  assert "--config.env.eval_splits=('valid_unseen',)" in cmd
  grouped = suites.command("R", SUITE, ENV, SUITE.method("a"), 2)
  assert "--config.rollout.num_groups=2" in grouped and "--config.rollout.group_size=8" in grouped
  assert suites.command("R", SUITE, ENV, SUITE.method("p"), 1)[2] == "launch.evaluate"
  assert not any(a.startswith("--cpu_numerics") for a in cmd)
  host = dataclasses.replace(SUITE, cpu_numerics="host_math")
  for method in ("c", "p"):  # trained and prompted cells alike, after the workdir
    assert suites.command("R", host, ENV, host.method(method), 2)[5] == "--cpu_numerics=host_math"


def test_mini_suite_configs_build():
  """The real suite: every ALFWorld-mini cell builds a config on the frozen ALFWorld-mini
  mini_v3 games (48 held-out games, all evaluated) with the suite's sizes, and GRPO passes
  the trainer's validation."""
  env = suites.MINI.env("alfworld_mini")
  assert suites.MINI.version == "mini_v6"
  for method in suites.MINI.methods:
    c = suites.build_config(env, method, 456)
    assert c.env.args.data_dir == "env_servers/alfworld/data/mini_v3" and c.seed == 456
    assert c.eval.num_tasks == 48
    assert c.env.args.hide_actions == "look,inventory,examine"
    assert tuple(c.env.eval_splits) == ("valid_unseen",) and c.env.max_steps == 12
    assert c.rollout.num_groups * c.rollout.group_size == env.num_trajectories
    # the three HiPER blocks need room (configs/common.finish_critic_algo)
    assert c.rollout.max_new_tokens == (128 if method.name == "hiper" else 32)
  assert suites.pending_reason(env, suites.MINI.method("grpo")) is None
  assert os.path.isfile(os.path.join(suites.REPO_ROOT, env.overrides["env.args.data_dir"],
                                     "valid_unseen.json.gz"))


def _write_games(run_dir, step, won):
  from hgpo_jax.training import metrics as metrics_lib
  metrics_lib.write_task_results(run_dir, step, "valid_unseen", [
      {"index": i, "task_id": f"t{i}", "won": w, "return": 10.0 * w, "length": 5}
      for i, w in enumerate(won)])


def test_trained_against_prompted_paired_game_by_game(runs, tmp_path):
  """The per-game records of the final evaluations pair a trained method with the
  prompted one game by game; the line gives the mean difference, the paired bootstrap
  interval over (seed, game) pairs and its verdict, hand-computed here."""
  rd = lambda m, seed: suites.run_dir(runs, SUITE, ENV.name, m, seed)  # noqa: E731
  # seed 1: prompted wins game 0; A wins all four (diffs 0, +1, +1, +1);
  # seed 2: prompted wins none; A wins 1, 2, 3 (0, +1, +1, +1); seed 3 has no records.
  _write_games(rd("p", 1), 0, [True, False, False, False])
  _write_games(rd("a", 1), 2, [False, False, False, False])  # a periodic evaluation...
  _write_games(rd("a", 1), 6, [True, True, True, True])      # ...and the final one counts
  _write_games(rd("p", 2), 0, [False] * 4)
  _write_games(rd("a", 2), 6, [False, True, True, True])
  _write_games(rd("b", 1), 6, [True, True])  # other games (2 not 4): not paired
  results, _ = report.collect(runs, SUITE, ENV, SUITE.method("a"))
  assert [r.eval_games for r in results] == [(True,) * 4, (False, True, True, True), None]
  prompted, _ = report.collect(runs, SUITE, ENV, SUITE.method("p"))
  diffs = report.game_diffs(results, prompted)
  assert diffs == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0]
  lo, hi = report.paired_bootstrap(diffs)
  cells = report.build_cells(runs, SUITE, pending)
  (line,) = [l for l in report.games_lines(cells, ENV) if l.startswith("- Method A")]
  assert line == (f"- Method A: +75.0 points, 95 % interval [{100 * lo:+.1f}, {100 * hi:+.1f}] "
                  "over 8 (seed, game) pairs (2 seeds): trained better.")
  assert lo > 0
  assert not [l for l in report.games_lines(cells, ENV) if l.startswith("- Method B")]
  md = report.markdown(cells, SUITE, ["footer"], per_iteration=True)
  assert "paired game by game" in md and line in md
  assert "- Method A, seed 1: 0.100 0.300 0.500 0.600 0.700" in md
  assert "Train success per iteration" not in report.markdown(cells, SUITE, ["footer"])


def test_trained_methods_against_each_other_paired_game_by_game(runs):
  """Two trained methods pair game by game over the seeds both finished with records of
  the same games (later - earlier in the suite's order); a pair with no shared seed, or a
  column without a prompted method, gives no line. Hand-computed differences."""
  rd = lambda m, seed: suites.run_dir(runs, SUITE, ENV.name, m, seed)  # noqa: E731
  _write_games(rd("p", 1), 0, [False] * 4)
  # seed 1: B - A = 0, +1, 0, -1; seed 2: +1, +1, 0, 0; seed 3: A has no records.
  _write_games(rd("a", 1), 6, [True, False, True, True])
  _write_games(rd("b", 1), 6, [True, True, True, False])
  _write_games(rd("a", 2), 6, [False, False, True, True])
  _write_games(rd("b", 2), 6, [True, True, True, True])
  _write_games(rd("b", 3), 6, [True, True, True, True])
  _write_games(rd("e", 1), 6, [True, True])  # other games: pairs with neither
  cells = report.build_cells(runs, SUITE, pending)
  diffs = [0.0, 1.0, 0.0, -1.0, 1.0, 1.0, 0.0, 0.0]
  assert report.game_diffs(cells[1].results, cells[0].results) == diffs
  lo, hi = report.paired_bootstrap(diffs)
  assert lo < 0 < hi
  assert report.between_lines(cells, ENV) == [
      "Held-out success of the trained methods against each other, paired game by game "
      "(the seeds both finished; paired bootstrap over (seed, game) pairs):", "",
      f"- Method B - Method A: +25.0 points, 95 % interval [{100 * lo:+.1f}, {100 * hi:+.1f}] "
      "over 8 (seed, game) pairs (2 seeds): not separated (the interval contains 0)."]
  # A loses every game of seeds 1 and 3: B - A = 1, 1, 1, 0 | 1, 1, 0, 0 | 1, 1, 1, 1
  _write_games(rd("a", 1), 6, [False] * 4)
  _write_games(rd("a", 3), 6, [False] * 4)
  cells = report.build_cells(runs, SUITE, pending)
  (line,) = report.between_lines(cells, ENV)[2:]
  assert line.startswith("- Method B - Method A: +75.0 points") and line.endswith(
      "over 12 (seed, game) pairs (3 seeds): Method B better.")
  assert line in report.markdown(cells, SUITE, ["footer"])
  no_prompted = dataclasses.replace(SUITE, methods=SUITE.methods[:-1])
  assert report.between_lines(report.build_cells(runs, no_prompted, pending), ENV) == []


def test_llm_suite_cells_train_smollm2_with_lora_on_the_64_game_split():
  """The `llm` suite: SmolLM2-135M with rank-16 adapters, mini_v4's 64 train games, the
  mini suite's 48 held-out games, whole prompts (400 tokens), no reference model; every cell builds and passes the trainer's validation; its quick
  version is the prompted base and HGPO K=2 on the first seed."""
  from hgpo_jax.training import experiment
  suite = suites.get_suite("llm")
  env = suite.env("alfworld_mini")
  for method in suite.methods:
    c = suites.build_config(env, method, 123)
    assert c.model.name == "smollm2-135m" and c.model.lora.rank == 16 and not c.model.remat
    assert c.env.args.data_dir == "env_servers/alfworld/data/mini_v4"
    assert tuple(c.env.eval_splits) == ("valid_unseen",) and c.eval.num_tasks == 48
    assert c.rollout.max_prompt_tokens == 400 and c.rollout.constrained
    assert c.rollout.num_groups * c.rollout.group_size == 8
    assert c.train.mini_batch_rows == 24 and c.train.lr == 2e-4
    assert not c.train.use_kl_loss and c.train.kl_coef == 0.0
    assert suites.pending_reason(env, method) is None
    experiment.from_config(c)
  quick = suites.quick_suite(suite)
  assert [m.name for m in quick.methods] == ["smollm2_prompted", "hgpo_k2"]
  assert quick.seeds == (123,) and suite.reference == "smollm2_prompted"
  with pytest.raises(ValueError, match="no quick version"):
    suites.quick_suite(dataclasses.replace(suite, quick_methods=()))


def test_llm_long_suite_is_point_g_evaluated_in_groups_of_eight():
  """The `llm_long` suite: point G's setting (top-8 adapters, constrained log-probs, 2 x 8,
  lr 1e-4, 20 iterations) in bf16 under `host_math`, jump-forward decoding (K = 3), the
  adapted layers unrolled and zero-advantage steps left out of the update, with 8
  evaluations of every held-out game played as one group;
  every cell passes the trainer's validation; its quick version (`make run-llm`) is the
  prompted base and GiGPO on the first seed."""
  from hgpo_jax.training import experiment
  suite = suites.get_suite("llm_long")
  env = suite.env("alfworld_mini")
  for method in suite.methods:
    c = suites.build_config(env, method, 123)
    assert c.model.lora.rank == 16 and c.model.lora.top_layers == 8
    assert c.train.constrained_logprobs and not c.rollout.format_instructions
    assert c.rollout.max_prompt_tokens == 320
    assert (c.rollout.num_groups, c.rollout.group_size) == (2, 8)
    assert (c.train.lr, c.train.mini_batch_rows, c.train.num_iterations) == (1e-4, 192, 20)
    assert (c.eval.repeats, c.eval.group_repeats, c.eval.num_tasks) == (8, True, 48)
    assert c.model.compute_dtype == "bfloat16"
    assert c.rollout.jump_forward == 3
    assert c.model.adapted_layers == "unrolled" and c.train.skip_zero_advantage
    assert "--cpu_numerics=host_math" in suites.command("R", suite, env, method, 123)
    experiment.from_config(c)
  quick = suites.quick_suite(suite)
  assert [m.name for m in quick.methods] == ["smollm2_prompted", "gigpo"]
  assert quick.seeds == (123,)


def test_sokoban_cells_train_on_two_levels_and_hold_out_the_test_split():
  """Sokoban (suite mini_v5): 12x12 with 4 boxes, the train split's first 2 levels,
  horizon 10, 48 held-out test levels; every cell builds and GRPO passes validation."""
  env = suites.MINI.env("sokoban")
  assert env.seeds == (123, 456, 789)
  for method in suites.MINI.methods:
    c = suites.build_config(env, method, 123)
    assert (c.env.args.dim, c.env.args.num_boxes, c.env.args.train_levels) == (12, 4, 2)
    assert c.env.max_steps == 10 and c.eval.num_tasks == 48
    assert tuple(c.env.eval_splits) == ("test",)
  assert suites.pending_reason(env, suites.MINI.method("grpo")) is None


def test_webshop_mini_cells_use_the_mini_shop_with_a_listed_search():
  """WebShop-mini (suite mini_v6 on): the frozen option-free shop of 24 train and 48 test
  goals, all 48 evaluated, the goal's keyword search listed on the search page, 15 steps,
  and the trainer's validation accepts the cells."""
  env = suites.MINI.env("webshop_mini")
  assert env.methods == ()  # all eight rows (mini_v4)
  for name in (m.name for m in suites.MINI.methods):
    c = suites.build_config(env, suites.MINI.method(name), 123)
    assert c.env.name == "webshop" and c.env.max_steps == 15
    assert (c.env.args.data_dir, c.env.args.search_actions) == (
        "env_servers/webshop/data/mini_v6", "goal")
    assert c.eval.num_tasks == 48
    assert c.rollout.max_prompt_tokens == 256 and tuple(c.env.eval_splits) == ("test",)
    assert c.rollout.max_new_tokens == (128 if name == "hiper" else 64)
    assert suites.pending_reason(env, suites.MINI.method(name)) is None
  # Every listed search fits in the response (the sampler refuses an action that does not).
  tok = tiny_tokenizer()
  shop = Shop.load(os.path.join(suites.REPO_ROOT, env.overrides["env.args.data_dir"]))
  need = [len(tok.encode(f"<action>search[{goal_query(g)}]</action>")) for g in shop.goals.values()]
  assert max(need) == 50 and sum(n > 32 for n in need) == 46
  assert os.path.isfile(os.path.join(suites.REPO_ROOT, env.overrides["env.args.data_dir"],
                                     "goals.json.gz"))


def test_search_mini_cells_play_the_synthetic_questions_with_listed_actions():
  """Search (suite mini_v6 on): the shipped synthetic multi-hop questions with the listed
  searches and answers (constrained decoding), 4 turns, 48 held-out test questions, three
  critic-free methods and the prompted SmolLM2; the others are outside the column."""
  env = suites.MINI.env("search_mini")
  assert env.seeds == (123, 456, 789)
  assert env.methods == ("grpo", "gigpo", "hgpo_k2", "smollm2_prompted")
  for name in env.methods:
    c = suites.build_config(env, suites.MINI.method(name), 123)
    assert (c.env.name, c.env.args.actions, c.env.args.data_dir) == ("search", "listed", "")
    assert c.env.max_steps == 4 and c.eval.num_tasks == 48 and tuple(c.env.eval_splits) == ("test",)
    assert c.rollout.constrained and c.rollout.max_new_tokens == 64
    assert c.env.args.max_candidates == 4
    assert suites.pending_reason(env, suites.MINI.method(name)) is None
  assert "outside this column's budget" in suites.pending_reason(env, suites.MINI.method("ppo"))


def test_plan_counts_iterations_and_evaluations(capsys, tmp_path):
  entry = {"env": "alfworld_mini", "method": "gigpo"}
  assert sweep._iterations(suites.MINI, entry) == 14
  assert sweep._evaluations(suites.MINI, entry) == 1  # the final evaluation only
  assert sweep._evaluations(suites.MINI, dict(entry, method="smollm2_prompted")) == 1
  assert sweep.main(["plan", "--suite", "mini", "--envs", "alfworld_mini", "--methods", "grpo",
                     "rloo", "--root", str(tmp_path), "--iteration-s", "100", "--eval-s", "36"]) == 0
  out = capsys.readouterr().out
  # 2 methods x 5 seeds x 14 iterations; 10 final evaluations; (140 x 100 + 10 x 36) / 3600 h
  assert "10 runs: {'todo': 10}; to run: 10 runs, 140 training iterations, 10 evaluations" in out
  assert "estimated wall time: 4.0 h" in out
  # Sokoban runs the suite's first three seeds only (Environment.seeds)
  assert sweep.main(["plan", "--suite", "mini", "--envs", "sokoban", "--methods", "grpo",
                     "--root", str(tmp_path), "--iteration-s", "100", "--eval-s", "36"]) == 0
  out = capsys.readouterr().out
  assert "3 runs: {'todo': 3}" in out and "seed_1011" not in out


def test_environment_seeds_must_be_suite_seeds():
  env = dataclasses.replace(suites.MINI.env("sokoban"), seeds=(123, 7))
  with pytest.raises(ValueError, match=r"lists seeds \[7\] that are not suite seeds"):
    suites.MINI.seeds_of(env)
  assert suites.MINI.seeds_of(suites.MINI.env("alfworld_mini")) == suites.MINI.seeds
  assert suites.MINI.seeds_of(suites.MINI.env("webshop_mini")) == (123, 456, 789)


def test_quick_suite_is_the_main_jobs_cells_of_the_table():
  quick = suites.quick_suite()
  assert quick.name == suites.MINI.name and quick.version == suites.MINI.version  # same run dirs
  assert [e.name for e in quick.environments] == ["alfworld_mini"]
  assert [m.name for m in quick.methods] == ["grpo", "gigpo", "hgpo_k2"]
  assert quick.seeds == suites.MINI.seeds[:1]
  env, method = quick.env("alfworld_mini"), quick.method("gigpo")
  assert (suites.command("R", quick, env, method, quick.seeds[0])
          == suites.command("R", suites.MINI, env, method, quick.seeds[0]))


def test_unknown_selection_is_one_line_error(capsys, tmp_path):
  assert sweep.main(["plan", "--suite", "mini", "--envs", "alfworld", "--root", str(tmp_path)]) == 2
  err = capsys.readouterr().err
  # one line that names the flag to change
  assert err == ("launch.experiments.sweep: error: --envs: suite 'mini' has no environment 'alfworld'; "
                 "choose from ['alfworld_mini', 'sokoban', 'webshop_mini', 'search_mini']\n")


def test_render_of_one_column_writes_its_own_files(runs, tmp_path, monkeypatch, capsys):
  """`render --envs E`: the column's table beside the suite's (same runs, same cells)."""
  other = suites.Environment(name="toy2", label="Toy two", config="configs/sokoban.py",
                             args="dim=6", heldout_split="valid_unseen", overrides={})
  two = suites.Suite(name="toy_suite", version="toy_v1", environments=(ENV, other),
                     methods=METHODS, seeds=(1, 2, 3), reference="a")
  monkeypatch.setitem(suites.SUITES, "toy_suite", two)
  monkeypatch.setattr(suites, "pending_reason", pending)
  out = tmp_path / "results"
  assert sweep.main(["render", "--suite", "toy_suite", "--root", runs, "--out", str(out),
                     "--envs", "toy"]) == 0
  assert sorted(os.listdir(out)) == ["toy_suite_toy.csv", "toy_suite_toy.md",
                                     "toy_suite_toy_curves.png"]
  md = (out / "toy_suite_toy.md").read_text(encoding="utf-8")
  assert "## Toy " in md and "Toy two" not in md
  assert "`python -m launch.experiments.sweep render --suite toy_suite --root" in md and "--envs toy`" in md
  whole = report.render(runs, SUITE, str(tmp_path / "whole"), "CMD", pending=pending)
  with open(whole["csv"], encoding="utf-8") as f:
    assert (out / "toy_suite_toy.csv").read_text(encoding="utf-8") == f.read()
  capsys.readouterr()
  assert sweep.main(["render", "--suite", "toy_suite", "--root", runs, "--out", str(out),
                     "--envs", "toy3"]) == 2
  assert "suite 'toy_suite' has no environment 'toy3'" in capsys.readouterr().err


def test_committed_run_records_are_finished_runs_of_the_current_suite():
  """What the repository keeps under results/runs (the runs the committed table is
  rendered from): per run directory exactly its record files, a finished run, whose log
  records one trainer revision and the current suite's command for its cell."""
  proc = subprocess.run(["git", "ls-files", "-z", "--", "results/runs"], cwd=suites.REPO_ROOT,
                        capture_output=True, check=False)
  if proc.returncode != 0:
    pytest.skip("not a git checkout: the committed records need `git ls-files`")
  files = collections.defaultdict(set)
  for path in filter(None, proc.stdout.decode().split("\0")):
    files[os.path.dirname(path)].add(os.path.basename(path))
  cells = {suites.run_dir("results/runs", suite, env.name, method.name, seed):
           (suite, env, method, seed)
           for suite in suites.SUITES.values() for env in suite.environments
           for method in suite.methods for seed in suite.seeds_of(env)}
  for run_dir, names in sorted(files.items()):
    assert run_dir in cells, f"{run_dir}: not a run directory of a suite"
    assert set(report.REQUIRED_RECORD_FILES) <= names <= set(report.RECORD_FILES), (
        f"{run_dir}: holds {sorted(names)}")
    workdir = os.path.join(suites.REPO_ROOT, run_dir)
    assert run_records.is_finished(workdir), f"{run_dir}: not finished"
    suite, env, method, seed = cells[run_dir]
    log = report.read_run_log(workdir)
    assert len(set(log.revisions)) == 1 and log.commands, f"{run_dir}: {log.revisions}"
    assert report.stale_reason(
        workdir, suites.command("results/runs", suite, env, method, seed)) is None
