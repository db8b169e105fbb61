"""Host grouping: ids, returns, ordering, padding and input validation."""

from collections import defaultdict

import numpy as np
import pytest

import advantage_cases
from hgpo_jax.advantages import build_row_batch
from hgpo_jax.advantages import GroupingError


def _partition(ids, valid=None):
  """Set of frozensets of row indices sharing an id (rows with id -1 excluded)."""
  groups = defaultdict(set)
  for i, g in enumerate(ids):
    if g >= 0 and (valid is None or valid[i]):
      groups[g].add(i)
  return {frozenset(s) for s in groups.values()}


def test_golden_groups_per_level():
  """The level groups listed in docs/algorithms.md §11.1."""
  grouped = build_row_batch(advantage_cases.golden_rows(), num_levels=3, capacity=19)
  ctx = [grouped.to_input_order(c) for c in grouped.batch.context_group]
  multi = lambda k: {g for g in _partition(ctx[k]) if len(g) > 1}
  assert multi(0) == {frozenset(s) for s in (
      {0, 3, 7}, {1, 5, 8, 9}, {2, 6}, {10, 12, 14, 16}, {11, 17, 18}, {13, 15})}
  assert multi(1) == {frozenset(s) for s in ({1, 8}, {2, 6}, {11, 17}, {13, 15})}
  assert multi(2) == set()
  # Rows without k predecessors are absent from level k.
  first_steps = [0, 3, 7, 10, 14, 16]
  assert np.all(ctx[1][first_steps] == -1) and np.all(ctx[2][[1, 4, 8, 11, 15, 17]] == -1)
  np.testing.assert_array_equal(grouped.batch.context_group[0], grouped.batch.anchor_group)


def test_context_ids_equal_tuple_keys_on_random_rollouts():
  rng = np.random.default_rng(11)
  for _ in range(30):
    rows = advantage_cases.random_rows(rng)
    grouped = build_row_batch(rows, num_levels=5)
    by_traj = defaultdict(dict)
    for r in rows:
      by_traj[r["traj"]][r["step"]] = r["anchor_obs"]
    for k in range(5):
      window = lambda r: tuple(by_traj[r["traj"]][s] for s in range(r["step"] - k, r["step"] + 1))
      keys = [(r["group"],) + window(r) if r["step"] >= k else None for r in rows]
      expected = defaultdict(set)
      for i, key in enumerate(keys):
        if key is not None:
          expected[key].add(i)
      ids = grouped.to_input_order(grouped.batch.context_group[k])
      assert _partition(ids) == {frozenset(s) for s in expected.values()}
      assert ids.max() < grouped.batch.capacity and ids.dtype == np.int32


def test_ids_dense_sorted_rows_and_padding():
  rows = advantage_cases.random_rows(np.random.default_rng(12), max_rows=100)
  grouped = build_row_batch(rows, num_levels=2, capacity=128)
  b, n = grouped.batch, len(rows)
  assert b.capacity == 128 and b.num_levels == 2
  np.testing.assert_array_equal(b.mask, np.arange(128) < n)
  for ids in (b.group, b.traj, b.anchor_group):
    assert ids.dtype == np.int32
    assert set(ids[:n]) == set(range(ids[:n].max() + 1))  # dense
  # Sorted by (group, traj, step); the permutation maps back.
  key = list(zip(b.group[:n], b.traj[:n], b.step[:n]))
  assert key == sorted(key)
  np.testing.assert_array_equal(grouped.to_input_order(b.step), [r["step"] for r in rows])
  np.testing.assert_array_equal(b.traj_first[:n], b.step[:n] == 0)
  for field in (b.returns, b.score, b.group, b.context_group[1]):
    assert np.all(field[..., n:] == 0)


def test_returns_scores_and_episode_returns():
  rows = [dict(group=0, traj="a", step=s, anchor_obs="x", reward=r, valid=v)
          for s, (r, v) in enumerate([(1.0, True), (0.0, False), (2.0, True)])]
  grouped = build_row_batch(rows[::-1], gamma=0.5, invalid_penalty=0.25)
  b = grouped.batch
  # R_2 = 2, R_1 = 0 + 0.5 * 2 = 1 (minus 0.25: invalid), R_0 = 1 + 0.5 * 1 = 1.5.
  np.testing.assert_allclose(b.returns, [1.5, 0.75, 2.0])
  np.testing.assert_allclose(b.score, [3.0, 2.75, 3.0])
  np.testing.assert_allclose(b.episode_return, [3.0, 3.0, 3.0])
  np.testing.assert_array_equal(b.done, [False, False, True])  # no `done`: last step ends it
  np.testing.assert_array_equal(b.action_valid, [True, False, True])


def test_columns_input_and_extra_fields():
  cols = dict(group=np.array([1, 1, 1]), traj=np.array([5, 5, 6]), step=np.array([1, 0, 0]),
              anchor_obs=["b", "a", "a"], reward=np.array([1.0, 0.0, 0.0]),
              valid=np.array([1, 1, 1]), done=np.array([False, False, True]))
  grouped = build_row_batch(cols, capacity=4,
                            extra_fields={"values": np.array([0.5, 0.25, 0.125], np.float32)})
  np.testing.assert_array_equal(grouped.batch.values, [0.25, 0.5, 0.125, 0.0])
  np.testing.assert_array_equal(grouped.batch.done, [False, False, True, False])
  np.testing.assert_array_equal(grouped.order, [1, 0, 2])
  np.testing.assert_allclose(grouped.to_input_order(grouped.batch.returns), [1.0, 0.95, 0.0])


@pytest.mark.parametrize("edit,message", [
    (lambda rows: rows + [dict(rows[0])], "has step 0 twice"),
    (lambda rows: [r for r in rows if not (r["traj"] == "t1" and r["step"] == 1)],
     "where step 1 was expected"),
    (lambda rows: [dict(r, group="g2") if r["traj"] == "t1" and r["step"] == 2 else r
                   for r in rows], "more than one group"),
    (lambda rows: [{k: v for k, v in r.items() if k != "reward"} for r in rows],
     "lack required field(s) ['reward']"),
    (lambda rows: [dict(r, reward=float("nan")) for r in rows], "non-finite"),
    (lambda rows: [dict(r, step=-1) if i == 0 else r for i, r in enumerate(rows)], ">= 0"),
    (lambda rows: [dict(r, valid=2) for r in rows], "booleans"),
])
def test_invalid_rows_raise_one_line(edit, message):
  rows = edit(advantage_cases.golden_rows())
  with pytest.raises(GroupingError) as err:
    build_row_batch(rows)
  assert message in str(err.value) and "\n" not in str(err.value)


def test_capacity_too_small():
  with pytest.raises(GroupingError, match="capacity 10 is smaller than the 19 rows"):
    build_row_batch(advantage_cases.golden_rows(), capacity=10)
