"""Critic values -> estimator inputs -> token advantages and value targets (host side).

The trainer's critic path for estimators with `needs_critic` (`gae`, `hae`):
  1. the critic's values f32[n, L, H] of the rollout rows on the token layout of the
     training batch (`critic_step.compute_values`);
  2. `estimator_fields`: the RowBatch fields the estimator reads, per row in rollout
     order (PPO: `token_values` = head 0 on every response token; HiPER: `values`
     f32[n, 3] read at `hae.value_readout`, `segment_start`, `subgoal_changed` (the
     token ids of the subgoal spans, as released), `token_tags`);
  3. `critic_targets`: the estimator's token advantages, loss mask and value targets
     mapped back to rollout order, with the (column, head) entries the critic regresses.
Columns here are response-relative: token j of a row's response is column P + j of the
training batch (P = prompt bucket).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np

from hgpo_jax.advantages import grouping
from hgpo_jax.advantages import hae
from hgpo_jax.training import critic_step


@dataclasses.dataclass(frozen=True)
class CriticTargets:
  """Per-row results in rollout order; `T` = response bucket, `H` = value heads."""

  advantage: np.ndarray
  """f32[n]: the estimator's per-row advantage (metrics, dumps)."""
  token_advantage: np.ndarray
  """f32[n, T]: advantage of each response token."""
  loss_mask: np.ndarray
  """bool[n, T]: tokens that receive policy gradient."""
  value_mask: np.ndarray
  """bool[n, T, H]: (token, head) entries the critic regresses."""
  returns: np.ndarray
  """f32[n, T, H]: value targets at those entries."""
  old_values: np.ndarray
  """f32[n, T, H]: the critic's values at those entries (before the update)."""
  fields: dict
  """The RowBatch fields the estimator read, rollout order (for dumps)."""
  grouped: Any
  """grouping.GroupedRows of the batch (group statistics)."""


def response_values(values_nlh: np.ndarray, prompt_len: int, num_tokens: int) -> np.ndarray:
  """f32[n, T, H]: the value columns of the response tokens."""
  return np.asarray(values_nlh[:, prompt_len:prompt_len + num_tokens], np.float32)


def _response_mask(rows: Sequence[Any], num_tokens: int) -> np.ndarray:
  mask = np.zeros((len(rows), num_tokens), bool)
  for i, r in enumerate(rows):
    mask[i, :len(r.response_ids)] = True
  return mask


def _token_tags(rows: Sequence[Any], num_tokens: int) -> np.ndarray:
  tags = np.zeros((len(rows), num_tokens), np.int8)
  for i, r in enumerate(rows):
    t = getattr(r, "token_tags", None)
    if t is None:
      raise ValueError(f"rollout row {i} has no token_tags; estimator 'hae' needs the HiPER "
                       "response format (config.rollout.response_format='hiper')")
    if len(t) != len(r.response_ids):
      raise ValueError(f"rollout row {i} has {len(t)} token_tags for {len(r.response_ids)} "
                       "response tokens; the rollout must tag every response token")
    tags[i, :len(t)] = t
  return tags


def estimator_fields(estimator: str, rows: Sequence[Any], resp_values_nth: np.ndarray) -> dict:
  """RowBatch critic fields in rollout order.

  Args:
    estimator: "gae" or "hae".
    rows: rollout StepRows (HiPER: with `switch`, `subgoal`, `token_tags`; the consistency
      penalty compares the token ids of the subgoal spans, `response_ids` + `token_tags`).
    resp_values_nth: f32[n, T, H] response-column values (`response_values`).
  """
  n, num_tokens, num_heads = resp_values_nth.shape
  response_mask = _response_mask(rows, num_tokens)
  if estimator == "gae":
    return {"token_values": np.where(response_mask, resp_values_nth[..., 0], 0.0).astype(np.float32),
            "response_mask": response_mask}
  if estimator != "hae":
    raise ValueError(f"no critic read-out for estimator {estimator!r}; known: gae, hae")
  if num_heads != len(hae.HEADS):
    raise ValueError(f"estimator 'hae' needs a {len(hae.HEADS)}-head critic, got {num_heads} heads")
  tags = _token_tags(rows, num_tokens)
  values = np.zeros((n, len(hae.HEADS)), np.float32)
  for i in range(n):
    low, high, term = hae.value_readout(tags[i, :len(rows[i].response_ids)])
    values[i] = (resp_values_nth[i, low, hae.HEAD_LOW], resp_values_nth[i, high, hae.HEAD_HIGH],
                 resp_values_nth[i, term, hae.HEAD_TERM])
  # Subgoals compare as the token ids of their spans, tags included (released core_hae.py
  # 226-243): a KEEP copy with other ids (re-tokenised, other spacing) counts as changed.
  dump_rows = [{"traj": r.traj, "step": r.step, "switch": getattr(r, "switch", None),
                "subgoal": getattr(r, "subgoal", None),
                "response_ids": list(r.response_ids), "token_tags": tags[i, :len(r.response_ids)],
                "values": dict(zip(hae.HEADS, (float(x) for x in values[i])))}
               for i, r in enumerate(rows)]
  fields = hae.hae_fields_from_dump(dump_rows, num_tokens=num_tokens, subgoal_compare="token_ids")
  fields.update(token_tags=tags, response_mask=response_mask)
  return fields


def critic_targets(rows: Sequence[Any], columns: dict, est, opts, values_nlh: np.ndarray, *,
                   prompt_len: int, num_tokens: int, gamma: float, invalid_penalty: float,
                   capacity: int) -> CriticTargets:
  """Runs the registry estimator on critic values; everything in rollout order.

  Args:
    rows: rollout StepRows.
    columns: `rollout.advantage_columns(rows)`.
    est, opts: a registered critic estimator (`gae` or `hae`) and its options.
    values_nlh: f32[n, L, H] critic values of the rows on the training batch layout.
    prompt_len: P, the prompt bucket of that layout.
    num_tokens: T, the response bucket.
    gamma, invalid_penalty, capacity: as `grouping.build_row_batch`.
  """
  resp = response_values(values_nlh, prompt_len, num_tokens)
  fields = estimator_fields(est.name, rows, resp)
  grouped = grouping.build_row_batch(columns, num_levels=1, gamma=gamma,
                                     invalid_penalty=invalid_penalty, capacity=capacity,
                                     extra_fields=fields)
  out = est(jax.device_put(grouped.batch), opts)
  back = lambda x: grouped.rejoin(rows, np.asarray(x))  # by (traj, step), not position
  response_mask = fields["response_mask"]
  token_adv = back(out.token_advantage)
  loss_mask = back(out.loss_mask) & response_mask
  n, num_heads = resp.shape[0], resp.shape[2]
  value_mask = np.zeros((n, num_tokens, num_heads), bool)
  returns = np.zeros((n, num_tokens, num_heads), np.float32)
  if est.name == "gae":
    value_mask[..., 0] = response_mask
    returns[..., 0] = back(out.value_targets["token"])
  else:
    targets = {h: back(out.value_targets[h]) for h in hae.HEADS}
    high_mask = back(out.value_targets["high_mask"])
    for i, r in enumerate(rows):
      readout = hae.value_readout(fields["token_tags"][i, :len(r.response_ids)])
      for head, pos in enumerate(readout):
        if head == hae.HEAD_HIGH and not high_mask[i]:
          continue
        value_mask[i, pos, head] = True
        returns[i, pos, head] = targets[hae.HEADS[head]][i]
  return CriticTargets(
      advantage=back(out.advantage), token_advantage=np.where(loss_mask, token_adv, 0.0).astype(np.float32),
      loss_mask=loss_mask, value_mask=value_mask, returns=returns,
      old_values=np.where(value_mask, resp, 0.0).astype(np.float32), fields=fields, grouped=grouped)


def metrics(targets: CriticTargets, levels: Sequence[str]) -> dict[str, float]:
  """critic/explained_variance over all regressed entries and, per head,
  critic/explained_variance_<level>, critic/mean_value_<level> and
  critic/mean_return_<level> (pre-update values)."""
  out = {"critic/explained_variance": critic_step.explained_variance(
      targets.old_values, targets.returns, targets.value_mask)}
  for h, level in enumerate(levels):
    m = targets.value_mask[..., h]
    if len(levels) > 1:
      out[f"critic/explained_variance_{level}"] = critic_step.explained_variance(
          targets.old_values[..., h], targets.returns[..., h], m)
    out[f"critic/mean_value_{level}"] = float(targets.old_values[..., h][m].mean()) if m.any() else 0.0
    out[f"critic/mean_return_{level}"] = float(targets.returns[..., h][m].mean()) if m.any() else 0.0
  return out
