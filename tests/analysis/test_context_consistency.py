"""Context inconsistency of a rollout dump, on a hand-made dump with known answers."""

import json

import pytest

from hgpo_jax.analysis import consistency
from launch.experiments.studies import consistency as cli

# One task, five trajectories. Anchor X is reached after A (t1, t2, t5) or after B
# (t3, t4); X is the last step; reaching X from A pays 10 except in t5.
TRAJS = [("t1", ["A", "X"], [0, 10]), ("t2", ["A", "X"], [0, 10]), ("t3", ["B", "X"], [0, 0]),
         ("t4", ["B", "X"], [0, 0]), ("t5", ["A", "X"], [0, 0])]


def rows():
  return [dict(group="g", traj=t, step=s, anchor_obs=obs[s], reward=float(rew[s]), valid=True)
          for t, obs, rew in TRAJS for s in range(2)]


def test_hand_made_dump():
  """Anchor groups with >= 2 members: A (returns 9.5, 9.5, 0), X (10, 10, 0, 0, 0), B (0, 0).
  Depth 1: only X mixes histories (A, A, B, B, A) -> mixed = 1/3.
  SS_total = SS_A + SS_X = 1083/18 + 120. X's history subgroups: after A {10, 10, 0}
  (mean 20/3), after B {0, 0}: SS_between = 3 (20/3 - 4)^2 + 2 * 4^2 = 160/3, so
  explained = (160/3) / (3243/18) = 960/3243. Chance-corrected: 10 rows in 4 subgroups,
  MS_w = (SS_total - SS_between) / 6, one extra subgroup:
  (SS_between - MS_w) / SS_total. Depth 2 equals depth 1 (X is at step 1: its history
  is the whole prefix); depth 4 too."""
  res = consistency.context_consistency(rows(), depths=(1, 2, 4))
  assert res["groups"] == 3 and res["rows"] == 10
  ss_total = 1083 / 18 + 120
  ss_between = 160 / 3
  ms_w = (ss_total - ss_between) / 6
  for d in (1, 2, 4):
    m = res["by_depth"][d]
    assert m["mixed"] == pytest.approx(1 / 3)
    assert m["explained"] == pytest.approx(960 / 3243, rel=1e-6)
    assert m["explained_adj"] == pytest.approx((ss_between - ms_w) / ss_total, rel=1e-6)


def test_longer_histories_split_further():
  """Two trajectories reach X via (C, A) and two via (D, A): X's depth-1 history is A
  for all, its depth-2 history splits in two, and its returns follow that split exactly."""
  trajs = [("u1", ["C", "A", "X"], [0, 0, 10]), ("u2", ["C", "A", "X"], [0, 0, 10]),
           ("u3", ["D", "A", "X"], [0, 0, 0]), ("u4", ["D", "A", "X"], [0, 0, 0])]
  rs = [dict(group="g", traj=t, step=s, anchor_obs=obs[s], reward=float(rew[s]), valid=True)
        for t, obs, rew in trajs for s in range(3)]
  res = consistency.context_consistency(rs, depths=(1, 2))
  # Groups: C, D, A, X. Depth 1: A's members all follow C or D -> A mixes; X all follow A.
  assert res["by_depth"][1]["mixed"] == pytest.approx(1 / 4)
  assert res["by_depth"][2]["mixed"] == pytest.approx(2 / 4)
  assert res["by_depth"][2]["explained"] == pytest.approx(1.0)
  assert res["by_depth"][1]["explained"] < 1.0


def test_command_prints_the_table(tmp_path, capsys):
  path = tmp_path / "dump.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
  assert cli.main([str(path), "--depths", "1", "2"]) == 0
  out = capsys.readouterr().out
  assert "anchor groups with >= 2 members: 3 (10 rows)" in out
  assert f"{960 / 3243:.3f}" in out


def test_bad_input_is_one_line(tmp_path, capsys):
  path = tmp_path / "dump.jsonl"
  path.write_text('{"group": "g"}\n')
  assert cli.main([str(path)]) == 2
  assert capsys.readouterr().err.startswith("error: ")
  with pytest.raises(ValueError, match="depths must be"):
    consistency.context_consistency(rows(), depths=(0,))
