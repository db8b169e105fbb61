"""The step-row schema: the one definition of the fields an advantage estimator reads.

Everything that writes or reads step rows derives from `ROW_FIELDS`: the host grouping
(`grouping.REQUIRED_FIELDS`), the dump validator (`dump.check_row`), the rollout's
columns (`rollout.advantage_columns`) and its JSONL record (`StepRow.dump_record`).
A row is identified by `ROW_KEY` = (traj, step); advantages computed on the sorted
batch are joined back to rows by that key (`grouping.GroupedRows.rejoin`), never by
list position.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence


@dataclasses.dataclass(frozen=True)
class RowField:
  """One field of a step row."""

  name: str
  types: tuple[type, ...]
  """Python (JSON) types a dump may hold; bool counts only where listed."""
  required: bool
  doc: str


ROW_FIELDS: tuple[RowField, ...] = (
    RowField("group", (str, int), True,
             "episode group (task) id; the N rollouts of a task share it"),
    RowField("traj", (str, int), True, "trajectory id, unique across groups"),
    RowField("step", (int,), True, "0-based step index in the trajectory, gap-free"),
    RowField("anchor_obs", (str,), True, "raw environment observation the action was taken at"),
    RowField("reward", (int, float), True, "environment reward of the step (finite)"),
    RowField("valid", (bool,), True, "the response parsed into a well-formed action"),
    RowField("done", (bool,), False,
             "the step ended the episode in a terminal state (won or failed), not by a step "
             "limit; absent: the last step of every trajectory is terminal"),
)
"""The schema (docs/algorithms.md §1); other fields of a row are carried along untouched."""

FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in ROW_FIELDS)
REQUIRED_FIELDS: tuple[str, ...] = tuple(f.name for f in ROW_FIELDS if f.required)
OPTIONAL_FIELDS: tuple[str, ...] = tuple(f.name for f in ROW_FIELDS if not f.required)
ROW_KEY: tuple[str, str] = ("traj", "step")
"""What identifies a row: (trajectory id, step index) is unique in a batch."""


def record(row: Any) -> dict[str, Any]:
  """The schema fields of an object with those attributes (e.g. a rollout StepRow)."""
  return {name: getattr(row, name) for name in FIELD_NAMES}


def columns(rows: Sequence[Any]) -> dict[str, list]:
  """Column lists of the schema fields over objects with those attributes."""
  return {name: [getattr(r, name) for r in rows] for name in FIELD_NAMES}


def keys(rows: Sequence[Any]) -> list[tuple[Any, int]]:
  """The `ROW_KEY` of each row; rows are objects with attributes or dicts."""
  return [(r[ROW_KEY[0]], r[ROW_KEY[1]]) if isinstance(r, dict)
          else (getattr(r, ROW_KEY[0]), getattr(r, ROW_KEY[1])) for r in rows]

