"""ALFWorld-mini (env_servers/alfworld/mini.py): the committed frozen suite is what the
command generates, byte for byte, and has the shape the suite promises."""

from __future__ import annotations

import collections
import filecmp
import json
import os
import re

import pytest

from env_servers.alfworld import env as env_lib
from env_servers.alfworld import games
from env_servers.alfworld import generator
from env_servers.alfworld import mini

VERSIONS = sorted(mini.SUITES)  # every published version stays regenerable


def _committed(split: str, version: str = mini.SUITE.version) -> list[games.GameRecord]:
  return games.load_frozen(os.path.join(mini.suite_dir(version), f"{split}.json.gz"))


def _bytes(record: games.GameRecord) -> bytes:
  return json.dumps(record.to_json(), sort_keys=True).encode("utf-8")


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("split", ["train", "valid_seen", "valid_unseen"])
def test_first_games_regenerate_byte_identical(split, version):
  from env_servers.alfworld import speedup
  speedup.apply()
  committed = _committed(split, version)
  for index in range(2):
    game = mini.generate_game(split, index, mini.SUITES[version])
    assert _bytes(game) == _bytes(committed[index]), (version, split, index)


@pytest.mark.slow
@pytest.mark.parametrize("version", VERSIONS)
def test_split_file_regenerates_byte_identical(tmp_path, version):
  mini.write_suite(str(tmp_path), mini.SUITES[version], splits=("valid_seen",), log=lambda _: None)
  assert filecmp.cmp(tmp_path / "valid_seen.json.gz",
                     os.path.join(mini.suite_dir(version), "valid_seen.json.gz"), shallow=False)


@pytest.mark.parametrize("version", VERSIONS)
def test_suite_shape(version):
  suite = mini.SUITES[version]
  counts = dict(suite.counts)
  c = generator._constants()
  by_split = {s: _committed(s, version) for s in counts}
  for split, records in by_split.items():
    assert len(records) == counts[split]
    rooms = set(c.TEST_SCENE_NUMBERS if split == "valid_unseen" else c.TRAIN_SCENE_NUMBERS)
    types = collections.Counter(r.task_type for r in records)
    n = len(suite.task_types)  # types cycle over the tuple (a type may be listed twice)
    assert types == collections.Counter(suite.task_types[i % n] for i in range(len(records)))
    assert [r.task_type for r in records[:n]] == list(suite.task_types)[:len(records)]
    for r in records:
      assert r.floorplan in rooms, (split, r.trial)
      assert suite.plan_steps[0] <= len(r.walkthrough) <= suite.plan_steps[1], r.walkthrough
      receptacles = re.findall(r"^\(receptacleType \S+ (\w+)Type\)$", r.pddl_problem, re.M)
      assert suite.receptacles[0] <= len(receptacles) <= suite.receptacles[1], receptacles
      assert len(set(receptacles)) == len(receptacles)  # one instance per class
      objects = set(re.findall(r"^\(objectType \S+ (\w+)Type\)$", r.pddl_problem, re.M))
      p = r.pddl_params
      distractors = objects - {p["object_target"], p["toggle_target"]}
      assert suite.distractor_classes[0] <= len(distractors) <= suite.distractor_classes[1]
  assert {"pick_and_place_simple", "look_at_obj_in_light"} <= set(suite.task_types)
  assert set(suite.task_types) & {"pick_clean_then_place_in_recep", "pick_heat_then_place_in_recep",
                                  "pick_cool_then_place_in_recep"}
  # held-out rooms are unseen in training; every game is distinct
  assert not ({r.floorplan for r in by_split["train"]}
              & {r.floorplan for r in by_split["valid_unseen"]})
  problems = [r.pddl_problem for rs in by_split.values() for r in rs]
  assert len(set(problems)) == len(problems)
  size = sum(os.path.getsize(os.path.join(mini.suite_dir(version), f"{s}.json.gz")) for s in counts)
  assert size < 200_000, size


def test_mini_v3_extends_mini_v2():
  """mini_v3 draws with mini_v2's streams: its train and valid_seen games are mini_v2's and
  its first 12 held-out games too, byte for byte; 36 more held-out games follow."""
  for split in ("train", "valid_seen", "valid_unseen"):
    v2, v3 = _committed(split, "mini_v2"), _committed(split, "mini_v3")
    assert [_bytes(g) for g in v3[:len(v2)]] == [_bytes(g) for g in v2], split
  assert len(_committed("valid_unseen", "mini_v3")) == 48


def test_mini_v4_extends_mini_v3():
  """mini_v4 draws with mini_v2's streams too: its valid_seen and 48 held-out games are
  mini_v3's and its first 2 train games too, byte for byte; 62 more train games follow,
  on train rooms that are not the held-out games' (test_suite_shape)."""
  for split in ("train", "valid_seen", "valid_unseen"):
    v3, v4 = _committed(split, "mini_v3"), _committed(split, "mini_v4")
    assert [_bytes(g) for g in v4[:len(v3)]] == [_bytes(g) for g in v3], split
  assert len(_committed("train", "mini_v4")) == 64
  assert len(_committed("valid_unseen", "mini_v4")) == 48


@pytest.mark.parametrize("version,hide", [("mini_v1", ""), ("mini_v2", "look,inventory,examine"),
                                          ("mini_v3", "look,inventory,examine"),
                                          ("mini_v4", "look,inventory,examine")])
def test_env_plays_the_suite_folder(version, hide):
  env = env_lib.AlfworldEnv(data_dir=mini.suite_dir(version), max_steps=20, hide_actions=hide)
  try:
    assert env.splits() == ["train", "valid_seen", "valid_unseen"]
    ids = env.task_ids("valid_unseen")
    assert len(ids) == dict(mini.SUITES[version].counts)["valid_unseen"]
    record = {r.task_id: r for r in _committed("valid_unseen", version)}[ids[0]]
    obs, info = env.reset(options={"task_id": ids[0]})
    assert "Your task is to:" in obs and len(info["admissible_actions"]) <= 40
    hidden = [a for a in info["admissible_actions"] if a.split()[0] in ("look", "inventory", "examine")]
    assert bool(hidden) != bool(hide), info["admissible_actions"]  # listed unless hidden
    for cmd in record.walkthrough:
      assert cmd in info["admissible_actions"], cmd
      obs, reward, terminated, truncated, info = env.step(cmd)
    assert terminated and reward == env_lib.WIN_REWARD and not truncated
  finally:
    env.close()


def test_hidden_commands_stay_playable():
  env = env_lib.AlfworldEnv(data_dir=mini.suite_dir("mini_v2"), max_steps=5,
                            hide_actions="look,inventory,examine")
  try:
    obs, info = env.reset(options={"task_id": env.task_ids("train")[0]})
    assert "inventory" not in info["admissible_actions"] and "help" not in info["admissible_actions"]
    obs, *_ = env.step("inventory")
    assert obs == "You are not carrying anything."
  finally:
    env.close()


def test_unknown_suite_is_refused():
  with pytest.raises(ValueError, match="unknown ALFWorld-mini suite 'mini_v9'"):
    mini.suite_dir("mini_v9")


def test_random_play_is_deterministic_and_monotone_in_horizon(tmp_path):
  records = _committed("valid_unseen", "mini_v1")[:2]
  games.save_frozen(records, str(tmp_path / "valid_unseen.json.gz"), split="valid_unseen")
  a = mini.random_play(str(tmp_path), "valid_unseen", 3, horizons=(5, 10, 20))
  b = mini.random_play(str(tmp_path), "valid_unseen", 3, horizons=(5, 10, 20))
  assert a == b
  assert all(0.0 <= r <= 1.0 for r in a.values()) and a[5] <= a[10] <= a[20]
  assert all(abs(r * 6 - round(r * 6)) < 1e-9 for r in a.values())  # 2 games x 3 episodes
