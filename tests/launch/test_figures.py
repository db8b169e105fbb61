"""The documentation's figures (launch/experiments/figures.py): the phase medians computed by hand on
hand-written metrics.jsonl files, the figure written, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launch.experiments import figures

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _write_run(root, env: str, method: str, seed: int, iterations: list[dict]) -> None:
  """A run record: one line per iteration (`time/*` fields), then a final-eval line."""
  run = root / "mini" / env / method / f"seed_{seed}"
  run.mkdir(parents=True)
  lines = [dict(step=i + 1, **{"rollout/success": 0.5}, **t) for i, t in enumerate(iterations)]
  lines.append({"step": len(iterations) + 1, "eval/test/success": 0.25})
  (run / "metrics.jsonl").write_text("".join(json.dumps(l) + "\n" for l in lines))


def _it(gen, env, adv, lp, upd, total, critic=None) -> dict:
  out = {"time/generation_s": gen, "time/env_s": env, "time/advantages_s": adv,
         "time/logprobs_s": lp, "time/update_s": upd, "time/iteration_s": total}
  if critic is not None:
    out["time/critic_update_s"] = critic
  return out


@pytest.fixture
def runs(tmp_path):
  # seed 1: the first iteration (compile) is left out; medians over iterations 2-4:
  # generation median(2, 4, 3) = 3, update median(10, 30, 20) = 20, other per iteration
  # 20-17=3, 41-37=4, 30-27=3 -> 3 (the slow iteration 3 does not move the medians)
  _write_run(tmp_path, "sokoban", "grpo", 1, [
      _it(50, 9, 9, 9, 90, 500), _it(2, 1, 0, 4, 10, 20), _it(4, 1, 0, 2, 30, 41),
      _it(3, 1, 0, 3, 20, 30)])
  _write_run(tmp_path, "sokoban", "grpo", 2, [
      _it(50, 9, 9, 9, 90, 500), _it(5, 1, 0, 5, 40, 60), _it(5, 1, 0, 5, 40, 60),
      _it(5, 1, 0, 5, 40, 60)])
  _write_run(tmp_path, "sokoban", "ppo", 1, [
      _it(50, 9, 9, 9, 90, 500, critic=90), _it(2, 1, 1, 3, 10, 30, critic=12)])
  # an evaluation-only run (a prompted model) has no iterations: left out
  run = tmp_path / "mini" / "sokoban" / "smollm2_prompted" / "seed_1"
  run.mkdir(parents=True)
  (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/test/success": 0.1}) + "\n")
  return tmp_path


def test_run_phases_are_medians_after_the_first_iteration(runs):
  p = figures.run_phases(str(runs / "mini/sokoban/grpo/seed_1/metrics.jsonl"), skip=1)
  assert p == {"generation (sampler)": 3.0, "env steps": 1.0, "advantages + targets": 0.0,
               "log-probs (old, ref)": 3.0, "actor update": 20.0, "critic update": 0.0,
               figures.OTHER: 3.0}
  assert figures.run_phases(str(runs / "mini/sokoban/grpo/seed_1/metrics.jsonl"), skip=4) is None


def test_collect_takes_the_median_over_seeds_in_display_order(runs):
  data = figures.collect(str(runs), "mini", skip=1)
  assert list(data) == ["sokoban"] and list(data["sokoban"]) == ["grpo", "ppo"]
  n, grpo = data["sokoban"]["grpo"]
  assert n == 2
  # two seeds: the median is their mean; seed 2's other is 60 - 51 = 9
  assert grpo["generation (sampler)"] == 4.0 and grpo["actor update"] == 30.0
  assert grpo[figures.OTHER] == 6.0
  assert grpo[figures.TOTAL] == pytest.approx(4 + 1 + 0 + 4 + 30 + 0 + 6)
  _, ppo = data["sokoban"]["ppo"]
  assert ppo["critic update"] == 12.0 and ppo[figures.OTHER] == 1.0
  assert ppo[figures.TOTAL] == pytest.approx(30.0)  # the iteration, all in named phases + other
  table = figures.table(data).splitlines()
  assert table[2] == ("| Sokoban 12x12 | GRPO | 2 | 4.0 | 1.0 | 0.0 | 4.0 | 30.0 | 0.0 | 6.0 "
                      "| 45.0 |")


def test_cli_writes_the_figure_and_errors_in_one_line(runs, tmp_path):
  out = tmp_path / "fig" / "phases.png"
  env = dict(os.environ, PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-m", "launch.experiments.figures", "phases", "--root", str(runs),
                         "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr
  assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert "| Sokoban 12x12 | PPO | 1 |" in proc.stdout
  for args, message in ((["--root", str(tmp_path / "none")], "no run directory"),
                        (["--root", str(runs), "--skip", "9"], "no run under"),
                        (["--root", str(runs), "--skip", "-1"], "--skip must be >= 0"),
                        (["--root", str(runs), "--out", "/proc/none/x.png"], "cannot write")):
    proc = subprocess.run([sys.executable, "-m", "launch.experiments.figures", "phases", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and message in proc.stderr
