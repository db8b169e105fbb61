"""Rollout dumps (JSONL read/write) and the command-line tool's options and errors."""

import contextlib
import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

import advantage_cases
from hgpo_jax.advantages import __main__ as cli
from hgpo_jax.advantages import DumpError
from hgpo_jax.advantages import read_rows
from hgpo_jax.advantages import registry
from hgpo_jax.advantages import write_rows


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_round_trip_keeps_strings_and_extra_fields(tmp_path, suffix):
  rows = advantage_cases.golden_rows()
  rows[0]["anchor_obs"] = "Kitchen: a mug ☕ \"quoted\"\nsecond line"
  rows[1]["prompt_tokens"] = np.arange(3)  # numpy arrays become lists
  rows[2]["done"] = True
  path = str(tmp_path / ("dump" + suffix))
  write_rows(path, rows)
  back = read_rows(path)
  assert back[0]["anchor_obs"] == rows[0]["anchor_obs"]
  assert back[1]["prompt_tokens"] == [0, 1, 2]
  assert back[2]["done"] is True
  assert [r["reward"] for r in back] == [r["reward"] for r in rows]


@pytest.mark.parametrize("line,message", [
    ("{not json", "malformed row: Expecting property name"),
    ('[1, 2]', "expected a JSON object, got list"),
    ('{"group": "g", "traj": "t", "step": 0, "anchor_obs": "A", "reward": 0.0}',
     "missing field 'valid'"),
    ('{"group": "g", "traj": "t", "step": true, "anchor_obs": "A", "reward": 0.0, "valid": true}',
     "field 'step' has bool True, expected int"),
    ('{"group": "g", "traj": "t", "step": 0, "anchor_obs": 3, "reward": 0.0, "valid": true}',
     "field 'anchor_obs' has int 3, expected str"),
    ('{"group": "g", "traj": "t", "step": 0, "anchor_obs": "A", "reward": NaN, "valid": true}',
     "expected a finite number"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, message):
  path = tmp_path / "bad.jsonl"
  good = json.dumps(advantage_cases.golden_rows()[0])
  path.write_text(good + "\n\n" + line + "\n")
  with pytest.raises(DumpError) as err:
    read_rows(str(path))
  assert f"{path}:3: " in str(err.value) and message in str(err.value)


def test_missing_and_empty_files(tmp_path):
  with pytest.raises(DumpError, match="cannot open rollout dump"):
    read_rows(str(tmp_path / "nope.jsonl"))
  (tmp_path / "empty.jsonl").write_text("\n")
  with pytest.raises(DumpError, match="has no rows"):
    read_rows(str(tmp_path / "empty.jsonl"))


def test_cli_estimator_choices_come_from_registry():
  action = next(a for a in cli.build_parser()._actions if a.dest == "estimator")
  assert list(action.choices) == registry.names()
  assert {"grpo", "rloo", "gigpo", "hgpo"} <= set(action.choices)


@pytest.fixture
def golden_dump(tmp_path):
  path = tmp_path / "golden.jsonl"
  write_rows(str(path), advantage_cases.golden_rows())
  return str(path)


@pytest.mark.parametrize("argv,message", [
    (["--estimator", "grpo", "--omega", "2"], "--omega do not apply to estimator 'grpo'"),
    (["--estimator", "gigpo", "--k", "2", "--base-group"],
     "--base-group, --k do not apply to estimator 'gigpo'"),
    (["--estimator", "hgpo", "--k", "-1"], "option k=-1 must be a non-negative integer"),
    (["--estimator", "hgpo", "--capacity", "4"], "capacity 4 is smaller than the 19 rows"),
])
def test_cli_usage_errors_exit_2(golden_dump, capsys, argv, message):
  assert cli.main([golden_dump] + argv) == 2
  err = capsys.readouterr().err
  assert message in err and err.count("\n") == 1


def test_cli_critic_estimator_without_critic_fields_fails_clearly(golden_dump, capsys):
  critic = [n for n in registry.names() if registry.get(n).needs_critic]
  assert critic  # gae / hae
  for name in critic:
    assert cli.main([golden_dump, "--estimator", name]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and name in err


def test_cli_custom_gamma_penalty_and_gzip(tmp_path, capsys):
  path = str(tmp_path / "d.jsonl.gz")
  write_rows(path, advantage_cases.golden_rows())
  assert cli.main([path, "--estimator", "rloo", "--gamma", "0.5", "--invalid-penalty", "1"]) == 0
  out = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
  # Row 11 (g2/t4 step 1, invalid): R = 0.5 * (0 + 0.5 * 10) - 1 = 1.5; score 10 - 1 = 9.
  assert out[11]["return"] == pytest.approx(1.5)
  # RLOO rows, group g2 = 9 rows with scores 10 x5, 9, 0 x3 -> mean 59/9.
  assert out[11]["advantage"] == pytest.approx((9 - 59 / 9) * 9 / 8, rel=1e-6)


def test_cli_subprocess_malformed_row_exit_code_2(tmp_path):
  path = tmp_path / "bad.jsonl"
  rows = advantage_cases.golden_rows()
  path.write_text("".join(json.dumps(r) + "\n" for r in rows[:5]) + '{"group": "g1"}\n')
  proc = subprocess.run([sys.executable, "-m", "hgpo_jax.advantages", str(path),
                         "--estimator", "hgpo"], capture_output=True, text=True, timeout=120,
                        check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr == f"error: {path}:6: malformed row: missing field 'traj'\n"


def test_cli_has_a_flag_for_every_option_of_every_estimator():
  dests = {a.dest for a in cli.build_parser()._actions}
  for name in registry.names():
    for f in dataclasses.fields(registry.get(name).options_cls):
      assert f.name in dests, (name, f.name)


@pytest.mark.parametrize("argv,message", [
    # options of other estimators
    (["--estimator", "grpo", "--keep-penalty", "-0.3"], "--keep-penalty do not apply to estimator 'grpo'"),
    (["--estimator", "rloo", "--norm-adv", "false"], "--norm-adv do not apply to estimator 'rloo'"),
    (["--estimator", "hgpo", "--subgoal-compare", "text"],
     "--subgoal-compare do not apply to estimator 'hgpo'"),
    (["--estimator", "gigpo", "--lam", "0.9"], "--lam do not apply to estimator 'gigpo'"),
    # options that act only under another one
    (["--estimator", "gigpo", "--similarity-thresh", "0.5"],
     "--similarity-thresh change nothing for estimator 'gigpo' as given (--similarity-thresh "
     "needs --enable-similarity)"),
    (["--estimator", "grpo", "--norm", "mean", "--epsilon", "0.1"], "--epsilon needs --norm mean_std"),
    (["--estimator", "hgpo", "--variance-prior", "3"], "--variance-prior needs --weights inverse_variance"),
    (["--estimator", "hgpo", "--stats", "trajectories"], "--stats needs --base-group"),
    (["--estimator", "hgpo", "--base-group", "--stats", "trajectories", "--weights",
      "inverse_variance"], "has no weight for the base_group"),
    (["--estimator", "grpo", "--base-group", "true"], "--base-group do not apply to estimator 'grpo'"),
    (["--estimator", "grpo", "--norm-adv", "maybe"], "expected true or false"),
])
def test_cli_refuses_flags_the_estimator_does_not_read(golden_dump, capsys, argv, message):
  with contextlib.suppress(SystemExit):  # argparse type errors exit with status 2 themselves
    assert cli.main([golden_dump] + argv) == 2
  err = capsys.readouterr().err
  assert message in err


def test_cli_dependent_options_of_critic_estimators(golden_dump, capsys):
  for argv, message in (
      (["--estimator", "gae", "--bootstrap-truncated"], "--bootstrap-truncated needs --multi-turn true"),
      (["--estimator", "hae", "--keep-penalty-mode", "fixed"],
       "--keep-penalty-mode needs a non-zero --keep-penalty"),
      (["--estimator", "hae", "--keep-penalty", "-0.3", "--subgoal-compare", "text"],
       "--subgoal-compare needs a non-zero --keep-consistency-penalty"),
      (["--estimator", "hae", "--first-turn-keep", "never"], "first_turn_keep='never'")):
    assert cli.main([golden_dump] + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
