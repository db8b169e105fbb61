"""Text Sokoban: golden level, solvable by construction, invariants, speed."""

import random

import pytest

from env_servers import base
from env_servers.sokoban import env as sokoban

GOLDEN_GRID = "\n".join(["#######", "###__##", "##_$._#", "##@*###", "#___###", "#___###",
                         "#######"])


def _reset(env, task_id):
  return env.reset(seed=0, options={"task_id": task_id, "split": task_id.split("-")[0]})


def test_golden_level_and_transcript():
  env = sokoban.SokobanEnv()
  obs, info = _reset(env, "train-00000")
  assert obs == f"{sokoban.INSTRUCTIONS}\n{GOLDEN_GRID}\nBoxes on targets: 1/2."
  assert info[base.ANCHOR_OBS] == GOLDEN_GRID
  assert info[base.ADMISSIBLE] == ["up", "down"]
  assert info["walkthrough"] == "down up up right up right left right left"
  assert (info[base.WON], info[base.SCORE]) == (False, 0.5)
  obs, reward, terminated, truncated, info = env.step("left")  # into a wall
  assert obs == f"You cannot move left.\n{GOLDEN_GRID}\nBoxes on targets: 1/2."
  assert (reward, terminated, truncated) == (0.0, False, False)
  env.step("up")
  obs, reward, terminated, truncated, info = env.step("right")  # pushes the last box home
  assert info[base.ANCHOR_OBS].splitlines()[2] == "##_@*_#"
  assert obs.endswith("Boxes on targets: 2/2.")
  assert (reward, terminated, truncated, info[base.WON]) == (10.0, True, False, True)


@pytest.mark.parametrize("split,count", [("train", 150), ("test", 50)])
def test_every_walkthrough_solves_its_level(split, count):
  env = sokoban.SokobanEnv()
  for task_id in env.task_ids(split)[:count]:
    _, info = _reset(env, task_id)
    assert not info[base.WON], task_id  # generation never yields a solved start
    moves = info["walkthrough"].split()
    for i, move in enumerate(moves):
      assert move in info[base.ADMISSIBLE], (task_id, i)
      _, reward, terminated, truncated, info = env.step(move)
      if terminated:
        break
    assert terminated and reward == sokoban.SOLVED_REWARD and info[base.WON], task_id
    assert not truncated


def test_levels_are_deterministic_and_splits_disjoint():
  a, b = sokoban.SokobanEnv(), sokoban.SokobanEnv()
  grids = {}
  for task_id in a.task_ids("train")[:40] + a.task_ids("test")[:40]:
    _, info_a = _reset(a, task_id)
    _, info_b = b.reset(seed=123, options={"task_id": task_id})  # seed does not matter
    assert info_a[base.ANCHOR_OBS] == info_b[base.ANCHOR_OBS]
    grids[task_id] = info_a[base.ANCHOR_OBS]
  assert len(set(grids.values())) >= 75  # procedural: nearly all distinct
  assert sokoban.SokobanEnv().level_seed("train-00999") == 999
  assert sokoban.SokobanEnv().level_seed("test-00000") == 1_000_000
  assert len(a.task_ids("train")) == 1000 and len(a.task_ids("test")) == 200
  assert a.splits() == ["train", "test"]


def test_admissible_actions_are_exactly_the_moves_that_change_state():
  env, rng = sokoban.SokobanEnv(), random.Random(0)
  for task_id in env.task_ids("train")[:30]:
    _, info = _reset(env, task_id)
    taken = []
    for _ in range(10):
      admissible, before = info[base.ADMISSIBLE], info[base.ANCHOR_OBS]
      for move in sokoban.MOVES:
        probe = sokoban.SokobanEnv()  # replays the prefix, then tries `move`
        _reset(probe, task_id)
        for done_move in taken:
          probe.step(done_move)
        _, _, _, _, probe_info = probe.step(move)
        assert (probe_info[base.ANCHOR_OBS] != before) == (move in admissible), (task_id, move)
      taken.append(rng.choice(admissible))
      _, _, terminated, _, info = env.step(taken[-1])
      if terminated:
        break


def test_invalid_action_and_truncation():
  env = sokoban.SokobanEnv(max_steps=3)
  _, info = _reset(env, "test-00007")
  grid = info[base.ANCHOR_OBS]
  obs, reward, terminated, truncated, info = env.step("fly away")
  assert obs.startswith("Invalid action 'fly away'; valid actions: up, down, left, right.\n")
  assert info[base.ANCHOR_OBS] == grid and (reward, terminated, truncated) == (0, False, False)
  env.step("")
  _, _, terminated, truncated, _ = env.step("x" * 10**6)
  assert (terminated, truncated) == (False, True)  # 3 steps, invalid ones count
  with pytest.raises(ValueError, match="unknown task id 'train-99999'"):
    _reset(env, "train-99999")
  with pytest.raises(ValueError, match="need dim >= 5"):
    sokoban.SokobanEnv(dim=3)


def test_random_play_reference_is_deterministic_and_pinned(capsys):
  # The untrained-policy reference of the mini suite's Sokoban column (launch/experiments/suites.py).
  rates = sokoban.random_play("test", 200, dim=6, num_boxes=1, horizons=(10, 15, 20))
  assert rates == {10: 0.56, 15: 0.62, 20: 0.665}
  assert sokoban.main(["--random-play", "200", "--split", "test"]) == 0
  assert capsys.readouterr().out.strip().endswith(
      "56.0 % within 10 steps, 62.0 % within 15 steps, 66.5 % within 20 steps")


def test_train_levels_keep_the_train_split_to_its_first_levels(capsys):
  """`train_levels=N`: the train split is its first N levels (the same levels as the whole
  split's), the test split stays whole, a task id past N is refused; random play over
  such a split goes round-robin (the mini suite's Sokoban calibration, pinned)."""
  env = sokoban.SokobanEnv(dim=12, num_boxes=5, train_levels=4)
  whole = sokoban.SokobanEnv(dim=12, num_boxes=5)
  assert env.task_ids("train") == whole.task_ids("train")[:4] == [
      "train-00000", "train-00001", "train-00002", "train-00003"]
  assert env.task_ids("test") == whole.task_ids("test")
  assert _reset(env, "train-00003")[1][base.ANCHOR_OBS] == _reset(whole, "train-00003")[1][
      base.ANCHOR_OBS]
  with pytest.raises(ValueError, match="unknown task id 'train-00004'.*train_levels=4"):
    env.level_seed("train-00004")
  for bad in (-1, 1001):
    with pytest.raises(ValueError, match=f"train_levels={bad} must be in 0..1000"):
      sokoban.SokobanEnv(train_levels=bad)
  # Fewer episodes than levels: the same numbers as without the option.
  assert sokoban.random_play("train", 3, 12, 5, (10,), train_levels=4) == sokoban.random_play(
      "train", 3, 12, 5, (10,))
  assert sokoban.random_play("train", 400, 12, 5, (10,), train_levels=4) == {10: 0.0875}
  assert sokoban.main(["--random-play", "400", "--split", "train", "--dim", "12", "--boxes", "5",
                       "--horizons", "10", "--train-levels", "4"]) == 0
  assert capsys.readouterr().out.strip() == (
      "sokoban 12x12, 5 box(es), split train, 400 episodes on its first 4 levels: "
      "8.8 % within 10 steps")


def test_no_undo_play_shortest_solutions_and_level_stats(capsys):
  # The calibration options of `--random-play` (docs/environments.md, Sokoban).
  rates = sokoban.random_play("test", 200, dim=6, num_boxes=1, horizons=(10, 15, 20),
                              policy="no-undo")
  assert rates == {10: 0.68, 15: 0.73, 20: 0.75}
  with pytest.raises(ValueError, match="unknown policy 'greedy'"):
    sokoban.random_play("test", 1, policy="greedy")
  golden = sokoban.generate_level(0, 7, 2)  # train-00000: solved by up, right
  assert sokoban.shortest_solution(golden, 20) == 2
  assert sokoban.shortest_solution(golden, 1) is None
  for seed in range(20):
    level = sokoban.generate_level(seed, 8, 2)
    assert sokoban.shortest_solution(level, len(level.walkthrough)) <= len(level.walkthrough)
  stats = sokoban.level_stats("test", 200, dim=6, num_boxes=1, horizons=(10, 15, 20))
  assert stats == {"walkthrough_median": 4.0, "pushes_median": 1.0, "shortest_median": 1.0,
                   "solvable": {10: 1.0, 15: 1.0, 20: 1.0}}
  assert sokoban.main(["--random-play", "200", "--split", "test", "--policy", "no-undo",
                       "--stats"]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert out[0].endswith("policy no-undo: 68.0 % within 10 steps, 73.0 % within 15 steps, "
                         "75.0 % within 20 steps")
  assert out[1] == ("  walkthrough median 4.0 moves, 1.0 pushes; shortest solution median "
                    "1.0 moves; solvable: 100.0 % within 10, 100.0 % within 15, "
                    "100.0 % within 20")
