"""Step-level advantage estimators: host grouping, jit kernels, registry, rollout dumps.

Typical use (host rows -> per-row advantages, joined to the rows by (traj, step)):

  grouped = build_row_batch(rows, num_levels=3, capacity=8192)
  out = get("hgpo")(grouped.batch, get("hgpo").options(k=2))
  advantage = grouped.rejoin(rows, out.advantage)

The row schema is `hgpo_jax.advantages.rows.ROW_FIELDS`.

Command line: `python -m hgpo_jax.advantages DUMP.jsonl --estimator hgpo`.
"""

from hgpo_jax.advantages.batch import RowBatch
from hgpo_jax.advantages.dump import DumpError
from hgpo_jax.advantages.dump import read_rows
from hgpo_jax.advantages.dump import write_rows
from hgpo_jax.advantages.grouping import build_row_batch
from hgpo_jax.advantages.grouping import GroupedRows
from hgpo_jax.advantages.grouping import GroupingError
from hgpo_jax.advantages.registry import EstimatorOutput
from hgpo_jax.advantages.registry import get
from hgpo_jax.advantages.registry import names

__all__ = [
    "DumpError", "EstimatorOutput", "GroupedRows", "GroupingError", "RowBatch",
    "build_row_batch", "get", "names", "read_rows", "write_rows",
]
