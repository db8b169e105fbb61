"""Rollout dumps: JSONL files with one step row per line, strings included.

A dump is how users debug credit assignment and how tests compare
implementations: `python -m hgpo_jax.advantages DUMP.jsonl --estimator hgpo`
recomputes advantages from it. The fields of a row, their JSON types and meaning are
`hgpo_jax.advantages.rows.ROW_FIELDS` (group, traj, step, anchor_obs, reward, valid;
optional done). Rows may also carry critic fields that a critic-based estimator reads
(e.g. `token_values` for `gae`) and any other field, which is preserved as is. Files
ending in `.gz` are gzip-compressed; the path "-" means stdin / stdout.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import sys
from typing import Any, Iterable, TextIO

from hgpo_jax.advantages.rows import ROW_FIELDS


class DumpError(ValueError):
  """A malformed dump; the message names the file and line and fits on one line."""


def _open(path: str, mode: str) -> TextIO:
  if path == "-":
    return sys.stdin if "r" in mode else sys.stdout
  if str(path).endswith(".gz"):
    return io.TextIOWrapper(gzip.open(path, mode + "b"), encoding="utf-8")
  return open(path, mode, encoding="utf-8")


def check_row(row: Any) -> None:
  """Raises ValueError (one line, no location) if `row` is not a valid step row."""
  if not isinstance(row, dict):
    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
  for field in ROW_FIELDS:
    if field.name not in row:
      if not field.required:
        continue
      raise ValueError(f"missing field {field.name!r}")
    value = row[field.name]
    # bool is an int in Python: only fields whose types list bool may be booleans.
    if (isinstance(value, bool) and bool not in field.types) or not isinstance(value, field.types):
      raise ValueError(f"field {field.name!r} has {type(value).__name__} {value!r}, expected "
                       + " or ".join(t.__name__ for t in field.types))
  if row["step"] < 0:
    raise ValueError(f"field 'step' is {row['step']}, expected >= 0")
  if not math.isfinite(row["reward"]):
    raise ValueError(f"field 'reward' is {row['reward']}, expected a finite number")


def read_rows(path: str) -> list[dict]:
  """Reads and validates a dump; raises DumpError naming `path:line` on the first bad row."""
  rows = []
  try:
    f = _open(path, "r")
  except OSError as e:
    raise DumpError(f"cannot open rollout dump {path!r}: {e.strerror}") from None
  with (contextlib.nullcontext(f) if f is sys.stdin else f) as lines:
    for lineno, line in enumerate(lines, start=1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
        check_row(row)
      except ValueError as e:  # json.JSONDecodeError is a ValueError
        raise DumpError(f"{path}:{lineno}: malformed row: {e}") from None
      rows.append(row)
  if not rows:
    raise DumpError(f"{path}: the dump has no rows")
  return rows


def write_rows(path: str, rows: Iterable[dict]) -> None:
  """Writes rows as JSONL (one compact JSON object per line, strings as is)."""
  f = _open(path, "w")
  try:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False, default=_jsonable) + "\n")
  finally:
    if f is sys.stdout:
      f.flush()
    else:
      f.close()


def _jsonable(value: Any) -> Any:
  """numpy scalars and arrays (from a rollout) -> plain JSON values."""
  if hasattr(value, "tolist"):
    return value.tolist()
  raise TypeError(f"cannot write {type(value).__name__} to a rollout dump")
