"""AlfworldEnv: walkthroughs win, wrong orders do not, ALFWorld's text, errors, data_dir."""

import dataclasses
import json
import random

import pytest

from env_servers import base
from env_servers.alfworld import games
from env_servers.alfworld.env import AlfworldEnv

_STATE_CHANGE = ("clean ", "heat ", "cool ")


@pytest.fixture(scope="module")
def env():
  e = AlfworldEnv()
  yield e
  e.close()


def _records(split):
  return games.load_frozen(games.frozen_set_file(split))


def _play(env, task_id, actions):
  """Returns [(obs, reward, terminated, truncated, info)] after reset + actions."""
  obs, info = env.reset(options={"task_id": task_id})
  out = [(obs, 0.0, False, False, info)]
  for a in actions:
    out.append(env.step(a))
    if out[-1][2] or out[-1][3]:
      break
  return out


def _assert_walkthrough_wins(env, record):
  steps = _play(env, record.task_id, record.walkthrough)
  obs, info = steps[0][0], steps[0][4]
  assert obs.startswith("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room.")
  assert obs.endswith(f"Your task is to: {record.task_sentence}.")
  assert info[base.TASK_TYPE] == record.task_type and info["task_id"] == record.task_id
  assert len(steps) == len(record.walkthrough) + 1  # no early end
  for i, (obs, reward, terminated, truncated, info) in enumerate(steps[1:], start=1):
    last = i == len(record.walkthrough)
    expected = (10.0, True, True) if last else (0.0, False, False)
    assert (reward, terminated, info[base.WON]) == expected
    assert not truncated
    assert info[base.ANCHOR_OBS] == obs and obs != "Nothing happens."
    assert "help" not in info[base.ADMISSIBLE]
    if not last:
      assert record.walkthrough[i] in info[base.ADMISSIBLE]


# One game of each task type across the three splits: the fast, always-run subset.
_FAST = [(s, i) for s, i in (("train", 0), ("train", 1), ("valid_seen", 2), ("valid_seen", 3),
                             ("valid_unseen", 4), ("valid_unseen", 5))]


@pytest.mark.parametrize("split,index", _FAST)
def test_walkthrough_wins_fast_subset(env, split, index):
  record = next(r for r in _records(split) if r.trial == f"trial_s0_{index:05d}")
  _assert_walkthrough_wins(env, record)


@pytest.mark.slow
@pytest.mark.parametrize("split", games.SPLITS)
def test_every_frozen_game_is_won_by_its_walkthrough(env, split):
  for record in _records(split):
    _assert_walkthrough_wins(env, record)


def test_wrong_order_does_not_win(env):
  checked = 0
  for record in _records("valid_seen"):
    wt = list(record.walkthrough)
    change = [i for i, a in enumerate(wt) if a.startswith(_STATE_CHANGE)]
    if not change:
      continue
    # Place the object first, then do the state change: the goal needs both at once.
    i = change[0]
    wrong = wt[:i] + wt[i + 1:] + [wt[i - 1], wt[i]] if wt[i - 1].startswith("go to ") else None
    if wrong is None:
      continue
    steps = _play(env, record.task_id, wrong)
    assert len(steps) == len(wrong) + 1
    assert steps[len(wt) - 1][0].startswith("You move")  # placed, but not yet changed
    assert not any(s[4][base.WON] for s in steps)
    assert all(s[1] == 0.0 for s in steps)
    checked += 1
    if checked == 4:
      break
  assert checked == 4


def test_inadmissible_and_garbage_actions_say_nothing_happens(env):
  record = _records("train")[0]
  env.reset(options={"task_id": record.task_id})
  first_admissible = None
  for action in ["fly to the moon", "", "   ", "take apple 99 from fridge 7", "x" * 100_000,
                 None, 42, "go to\nfridge 1"]:
    obs, reward, terminated, truncated, info = env.step(action)
    assert obs == "Nothing happens." == info[base.ANCHOR_OBS]
    assert (reward, terminated, truncated, info[base.WON]) == (0.0, False, False, False)
    first_admissible = first_admissible or info[base.ADMISSIBLE]
    assert info[base.ADMISSIBLE] == first_admissible  # nothing changed
  # Those steps counted toward the limit but the walkthrough still wins.
  for action in record.walkthrough:
    obs, reward, terminated, truncated, info = env.step(action)
  assert terminated and reward == 10.0


def test_truncation_at_max_steps_and_step_after_end():
  env = AlfworldEnv(max_steps="3", speedup="true")
  record = _records("train")[0]
  env.reset(options={"task_id": record.task_id})
  flags = [env.step("look")[2:4] for _ in range(3)]
  assert flags == [(False, False), (False, False), (False, True)]
  with pytest.raises(RuntimeError, match="call reset"):
    env.step("look")
  env.close()


def test_catalog_and_seeded_reset(env):
  assert env.splits() == list(games.SPLITS)
  ids = env.task_ids("valid_unseen")
  assert len(ids) == 24 and ids == sorted(ids)
  assert ids[0].startswith("valid_unseen/")
  _, info_a = env.reset(seed=7, options={"split": "valid_unseen"})
  _, info_b = env.reset(seed=7, options={"split": "valid_unseen"})
  assert info_a["task_id"] == info_b["task_id"] and info_a["task_id"] in ids


def test_user_errors_are_one_line_and_name_the_thing(env, tmp_path):
  with pytest.raises(ValueError, match="unknown ALFWorld task id 'train/nope/trial_0'"):
    env.reset(options={"task_id": "train/nope/trial_0"})
  with pytest.raises(ValueError, match="unknown ALFWorld split 'test'"):
    env.reset(options={"task_id": "test/x/trial_0"})
  with pytest.raises(ValueError, match="not in split 'valid_seen'"):
    env.reset(options={"task_id": env.task_ids("train")[0], "split": "valid_seen"})
  missing = tmp_path / "no_such_dir"
  with pytest.raises(games.GameFileError, match=f"ALFWorld data dir {missing} does not exist"):
    AlfworldEnv(data_dir=str(missing))
  with pytest.raises(games.GameFileError, match="no games under"):
    AlfworldEnv(data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="max_steps='many' is not an integer"):
    AlfworldEnv(max_steps="many")
  with pytest.raises(ValueError, match="speedup='maybe' is not a boolean"):
    AlfworldEnv(speedup="maybe")


def test_corrupt_game_files_name_the_file(tmp_path):
  good, second = _records("valid_seen")[:2]
  games.write_game_dir(good, str(tmp_path))
  path = games.write_game_dir(second, str(tmp_path))
  env = AlfworldEnv(data_dir=str(tmp_path))
  # Corrupt the second game after the scan: JSON garbage.
  with open(path, "w", encoding="utf-8") as f:
    f.write('{"pddl_domain": ')
  with pytest.raises(games.GameFileError, match=f"corrupt ALFWorld game file {path}"):
    env.reset(options={"task_id": second.task_id})
  # Valid JSON, unparsable PDDL problem: the engine's error is named with the task id.
  game = second.game_json()
  game["pddl_problem"] = "(define (problem broken"
  with open(path, "w", encoding="utf-8") as f:
    json.dump(game, f)
  with pytest.raises(games.GameFileError, match=f"corrupt ALFWorld game {second.task_id}"):
    env.reset(options={"task_id": second.task_id})
  env.close()


def test_official_layout_plays_like_the_frozen_set(env, tmp_path):
  """A data_dir in ALFWorld's json_2.1.1 layout, with ALFWorld's collect_game_files rules."""
  records = _records("valid_seen")[:3] + _records("valid_unseen")[:1]
  for r in records:
    games.write_game_dir(r, str(tmp_path))
  # An unsolvable game, a movable-receptacle variant and a traj without a game are skipped.
  unsolvable = dataclasses.replace(records[0], trial="trial_unsolvable")
  p = games.write_game_dir(unsolvable, str(tmp_path))
  game = json.loads(open(p, encoding="utf-8").read())
  game["solvable"] = False
  with open(p, "w", encoding="utf-8") as f:
    json.dump(game, f)
  movable = dataclasses.replace(records[1], pddl_params={**records[1].pddl_params,
                                                         "mrecep_target": "Bowl"},
                                trial="trial_movable")
  games.write_game_dir(movable, str(tmp_path))
  (tmp_path / "valid_seen" / records[2].task_dir / "trial_no_game").mkdir()
  (tmp_path / "valid_seen" / records[2].task_dir / "trial_no_game" / "traj_data.json").write_text(
      json.dumps({"task_type": records[2].task_type}))

  official = AlfworldEnv(data_dir=str(tmp_path))
  assert official.splits() == ["valid_seen", "valid_unseen"]
  assert official.task_ids("valid_seen") == sorted(r.task_id for r in records[:3])
  assert official.task_ids("valid_unseen") == [records[3].task_id]
  rng = random.Random(0)
  for r in records[:1]:
    # Same transcript through both sources, including random admissible actions.
    actions = list(r.walkthrough)
    a = _play(official, r.task_id, actions)
    b = _play(env, r.task_id, actions)
    assert [(s[0], s[1], s[2], s[4][base.ADMISSIBLE]) for s in a] == \
           [(s[0], s[1], s[2], s[4][base.ADMISSIBLE]) for s in b]
    assert a[-1][2] and a[-1][4][base.WON]
    obs, info = official.reset(options={"task_id": r.task_id})
    for _ in range(5):
      obs, _, _, _, info = official.step(rng.choice(info[base.ADMISSIBLE]))
  official.close()
  with pytest.raises(games.GameFileError, match="it is one split; point data_dir at its parent"):
    AlfworldEnv(data_dir=str(tmp_path / "valid_seen"))


def test_one_engine_is_reused_across_resets(env):
  """Each new PddlEnv copies and dlopens a 33 MB libdownward.so that is never unloaded;
  resets must re-load the game into the same engine (a leak filled /tmp before)."""
  ids = env.task_ids("valid_seen")[:3]
  env.reset(options={"task_id": ids[0]})
  engine = env._engine
  lib = engine.unwrapped.downward_lib if hasattr(engine, "unwrapped") else None
  for task_id in ids[1:] + ids[:1]:
    obs, info = env.reset(options={"task_id": task_id})
    assert env._engine is engine
    assert "Your task is to:" in obs and info["admissible_actions"]
  if lib is not None:
    assert engine.unwrapped.downward_lib is lib
