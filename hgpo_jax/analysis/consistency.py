"""Context inconsistency of real rollouts, measured from a rollout dump.

For GiGPO's anchor-state groups (same episode group, identical anchor observation)
of a dump (format: hgpo_jax.advantages.dump), and for each history depth d:

  * `mixed`: the fraction of anchor groups with >= 2 members whose members do not all
    share the same depth-d history (the d anchor observations before the step; a step
    with fewer than d predecessors has a shorter, padded history, so it differs from
    every longer one);
  * `explained`: the share of the within-group variance of the step return R~_t that the
    depth-d history explains, pooled over groups: sum_g SS_between(g) / sum_g SS_total(g),
    where SS_between uses the means of the history subgroups inside each anchor group;
  * `explained_adj`: the same with the chance part removed, (SS_b - (h - 1) MS_w) / SS_t
    (h history subgroups, MS_w the pooled within-subgroup mean square; the epsilon^2 of
    a one-way ANOVA), because subgroups of one member "explain" their own noise.

High values mean that HGPO's deeper keys split anchor groups into contexts whose
returns really differ. The histories are those of the anchor observations (what
HGPO's keys see), built with the project's host grouping.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from hgpo_jax.advantages import grouping


def history_keys(grouped: grouping.GroupedRows, depth: int) -> np.ndarray:
  """int64[n] (batch order): equal iff same anchor group and same depth-d history."""
  b = grouped.batch
  n = grouped.num_rows
  ctx = np.asarray(b.context_group)[:, :n].astype(np.int64)
  step = np.asarray(b.step)[:n].astype(np.int64)
  if depth >= ctx.shape[0]:
    raise ValueError(f"depth {depth} needs a batch built with num_levels >= {depth + 1}")
  short = step < depth
  # A full history is the level-d id; a short one is (its step, level-step id).
  level_of_short = ctx[np.minimum(step, depth), np.arange(n)]
  return np.where(short, (1 + step) * (n + 1) + level_of_short, ctx[depth])


def context_consistency(rows: Sequence[dict], depths: Sequence[int] = (1, 2, 4), *,
                        gamma: float = 0.95, invalid_penalty: float = 0.1) -> dict:
  """{"groups": #anchor groups with >= 2 members, "rows": rows in them,
  "by_depth": {d: {"mixed", "explained", "explained_adj"}}} (see the module docstring)."""
  if not depths or min(depths) < 1:
    raise ValueError(f"depths must be >= 1, got {list(depths)}")
  grouped = grouping.build_row_batch(rows, num_levels=max(depths) + 1, gamma=gamma,
                                     invalid_penalty=invalid_penalty)
  n = grouped.num_rows
  anchor = np.asarray(grouped.batch.anchor_group)[:n].astype(np.int64)
  ret = np.asarray(grouped.batch.returns)[:n].astype(np.float64)
  size = np.bincount(anchor)[anchor]
  multi = size >= 2
  out = {"groups": int(np.unique(anchor[multi]).size), "rows": int(multi.sum()), "by_depth": {}}
  if not multi.any():
    for d in depths:
      out["by_depth"][d] = dict(mixed=float("nan"), explained=float("nan"),
                                explained_adj=float("nan"))
    return out
  a = np.unique(anchor[multi], return_inverse=True)[1].reshape(-1)
  r = ret[multi]
  num_groups = a.max() + 1
  mean_g = np.bincount(a, weights=r) / np.bincount(a)
  ss_total = float(np.sum((r - mean_g[a])**2))
  for d in depths:
    h = np.unique(history_keys(grouped, d)[multi], return_inverse=True)[1].reshape(-1)
    count_h = np.bincount(h)
    mean_h = np.bincount(h, weights=r) / count_h
    group_of_h = np.zeros(h.max() + 1, np.int64)
    group_of_h[h] = a
    subgroups = np.bincount(group_of_h, minlength=num_groups)
    mixed = float(np.mean(subgroups > 1))
    ss_between = float(np.sum(count_h * (mean_h - mean_g[group_of_h])**2))
    ss_within = ss_total - ss_between
    dof_within = len(r) - len(count_h)
    ms_within = ss_within / dof_within if dof_within > 0 else 0.0
    dof_between = int(np.sum(subgroups - 1))
    if ss_total > 0:
      explained = ss_between / ss_total
      adj = (ss_between - dof_between * ms_within) / ss_total
    else:
      explained = adj = float("nan")
    out["by_depth"][d] = dict(mixed=mixed, explained=explained, explained_adj=adj)
  return out
