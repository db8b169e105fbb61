"""The step-row schema has one definition (`rows.ROW_FIELDS`) that grouping, the dump
validator and the rollout derive from; per-row results rejoin rows by (traj, step)."""

import dataclasses

import numpy as np
import pytest

from hgpo_jax.advantages import dump
from hgpo_jax.advantages import grouping
from hgpo_jax.advantages import rows as rows_lib
from hgpo_jax.rollout import rollout

GAMMA = 0.5


def _rows():
  """Two groups, four trajectories of lengths 3, 1, 2, 2; every reward is distinct, so a
  value attached to the wrong row shows up."""
  lengths = {"a0": ("g0", 3), "a1": ("g0", 1), "b0": ("g1", 2), "b1": ("g1", 2)}
  out, reward = [], 1.0
  for traj, (group, n) in lengths.items():
    for step in range(n):
      out.append({"group": group, "traj": traj, "step": step, "anchor_obs": f"o{step}",
                  "reward": reward, "valid": True, "done": step == n - 1})
      reward *= 2.0
  return out


def _returns(rows):
  """R_t = r_t + GAMMA * R_{t+1}, by hand per (traj, step) (float64)."""
  by_traj = {}
  for r in rows:
    by_traj.setdefault(r["traj"], {})[r["step"]] = r["reward"]
  out = {}
  for traj, rewards in by_traj.items():
    ret = 0.0
    for step in sorted(rewards, reverse=True):
      ret = rewards[step] + GAMMA * ret
      out[(traj, step)] = ret
  return out


def test_schema_is_derived_everywhere():
  names = rows_lib.FIELD_NAMES
  assert names == ("group", "traj", "step", "anchor_obs", "reward", "valid", "done")
  assert rows_lib.REQUIRED_FIELDS == names[:-1] and rows_lib.OPTIONAL_FIELDS == ("done",)
  step_fields = {f.name for f in dataclasses.fields(rollout.StepRow)}
  assert set(names) <= step_fields
  row = rollout.StepRow(group=1, traj=7, step=2, task_id="t", task_type="pick", anchor_obs="o",
                        prompt_ids=[1], response_ids=[2], response="r", action="a", valid=False,
                        reward=10.0, done=True)
  record = row.dump_record()
  dump.check_row(record)  # a rollout record is a valid dump row
  assert {k: record[k] for k in names} == {"group": 1, "traj": 7, "step": 2, "anchor_obs": "o",
                                           "reward": 10.0, "valid": False, "done": True}
  cols = rollout.advantage_columns([row, dataclasses.replace(row, step=3, done=False)])
  assert list(cols) == list(names) and cols["step"] == [2, 3] and cols["done"] == [True, False]


@pytest.mark.parametrize("name", rows_lib.REQUIRED_FIELDS)
def test_every_required_field_is_required_by_dump_and_grouping(name):
  row = {k: v for k, v in _rows()[0].items() if k != name}
  with pytest.raises(ValueError, match=f"^missing field '{name}'$"):
    dump.check_row(row)
  with pytest.raises(grouping.GroupingError, match=f"required field\\(s\\) \\['{name}'\\]"):
    grouping.build_row_batch([row])


def test_dump_types_follow_the_schema():
  for field in rows_lib.ROW_FIELDS:
    bad = "x" if str not in field.types else 1.5
    with pytest.raises(ValueError, match=f"^field '{field.name}' has "):
      dump.check_row(dict(_rows()[0], **{field.name: bad}))


def test_permuted_rows_rejoin_by_key():
  rows = _rows()
  grouped = grouping.build_row_batch(rows, gamma=GAMMA, invalid_penalty=0.0, capacity=12)
  want = _returns(rows)
  perm = np.random.default_rng(0).permutation(len(rows))
  shuffled = [rows[i] for i in perm]
  got = grouped.rejoin(shuffled, grouped.batch.returns)
  # float32 returns of at most 3 terms with power-of-two rewards and GAMMA = 0.5: exact.
  np.testing.assert_array_equal(got, [want[(r["traj"], r["step"])] for r in shuffled])
  # in input order, rejoin is the positional map back
  np.testing.assert_array_equal(grouped.rejoin(rows, grouped.batch.returns),
                                grouped.to_input_order(grouped.batch.returns))
  # ... and positions alone would attach the values to the wrong rows
  assert not np.array_equal(grouped.to_input_order(grouped.batch.returns), got)
  # rows given as objects (rollout StepRows) join the same way; extra dims are kept
  objs = [type("Row", (), {"traj": r["traj"], "step": r["step"]})() for r in shuffled]
  two = np.stack([grouped.batch.returns, -grouped.batch.returns], axis=1)
  np.testing.assert_array_equal(grouped.rejoin(objs, two)[:, 1], -got)


def test_grouping_keys_accept_numpy_columns():
  rows = _rows()
  cols = {k: [r[k] for r in rows] for k in rows_lib.FIELD_NAMES}
  ids = {"a0": 40, "a1": 7, "b0": 12, "b1": 3}
  cols["traj"] = np.array([ids[t] for t in cols["traj"]], np.int64)
  cols["step"] = np.array(cols["step"], np.int32)
  grouped = grouping.build_row_batch(cols, gamma=GAMMA, invalid_penalty=0.0)
  keyed = [{"traj": int(t), "step": int(s)} for t, s in zip(cols["traj"][::-1], cols["step"][::-1])]
  np.testing.assert_array_equal(grouped.rejoin(keyed, grouped.batch.step),
                                cols["step"][::-1])


@pytest.mark.parametrize("case, message", [
    ("missing", "row (traj, step)=('b1', 1) of the grouped batch is missing from the 7 rows to "
                "join; pass every row"),
    ("duplicate", "row (traj, step)=('a0', 0) appears twice in the rows to join; each row needs "
                  "its own key"),
    ("unknown", "row (traj, step)=('a0', 3) is not in the grouped batch; join the rows the batch "
                "was built from"),
])
def test_bad_rejoin_raises_one_line(case, message):
  rows = _rows()
  grouped = grouping.build_row_batch(rows)
  bad = {"missing": rows[:-1], "duplicate": rows[:-1] + [rows[0]],
         "unknown": rows[:-1] + [dict(rows[0], step=3)]}[case]
  with pytest.raises(grouping.GroupingError) as e:
    grouped.rejoin(bad, grouped.batch.returns)
  assert str(e.value) == message and "\n" not in message
