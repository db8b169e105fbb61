"""The iteration's targets: `compute_targets(rows, run) -> UpdateTargets`.

One step from the rollout's rows (all processes' rows, `processes.gather_rollout`, so every
process computes the same targets) to what the updates train on, for critic-free and
critic estimators alike:

  critic-free (grpo, gigpo, hgpo, ...): rows -> host grouping (`grouping.build_row_batch`)
      -> jit estimator -> one advantage per row -> token batch (the row's advantage on
      each of its response tokens);
  critic (gae = PPO, hae = HiPER): rows -> token batch -> jit critic values -> estimator
      and value targets (`value_targets.critic_targets`) -> token batch with token
      advantages and the estimator's loss mask, and the critic's value batch.

(Not to be confused with hgpo_jax/cost/targets.py, the TPU targets `launch.plan` compiles for.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hgpo_jax import progress
from hgpo_jax.advantages import grouping
from hgpo_jax.models import critic as critic_lib
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.sampling import sampler as sampler_lib
from hgpo_jax.training import critic_step
from hgpo_jax.training import run as run_lib
from hgpo_jax.training import experiment as experiment_lib
from hgpo_jax.training import train_batch as train_batch_lib
from hgpo_jax.training import value_targets


@dataclasses.dataclass
class UpdateTargets:
  """What one iteration's updates train on (`compute_targets`)."""

  token_batch: train_batch_lib.TrainBatch
  """All rows, [rows padded to a multiple of train.mini_batch_rows, prompt bucket +
  max_new_tokens], unpacked; `advantages` per token (0 off the scored tokens), and for
  critic estimators the estimator's loss mask as `response_mask`."""
  value_batch: critic_step.ValueBatch | None
  """The critic's batch (same rows and columns): value mask, returns and old values per
  head; None for critic-free estimators."""
  metrics: dict[str, float]
  """`advantage/*` and the estimator's statistics (`groups/*` step-group sizes, or the
  critic's value metrics)."""
  dump_fields: list[dict[str, Any]] | None
  """Per row, the fields a rollout dump adds to the row's record (return, advantage, the
  critic's values); None unless `rollout.dump`."""


def compute_targets(rows, run: run_lib.Run) -> UpdateTargets:
  """The token batch, value batch, metrics and dump fields of the rollout's `rows`."""
  progress.phase("advantages")
  exp = run.experiment
  # static (no recompilation across iterations); the estimator sees all processes' rows
  capacity = exp.rollout.num_groups * exp.rollout.group_size * exp.env.max_steps
  pad_id = run.tokenizer.pad_id
  est, opts = exp.estimator, exp.algo.options
  extra = [{} for _ in rows]
  if run.critic is None:
    adv, ret, metrics = compute_advantages(
        rows, est, opts, gamma=exp.algo.gamma,
        invalid_penalty=exp.rollout.invalid_penalty, capacity=capacity)
    batch, value_batch = token_batch(rows, adv, exp, pad_id), None
  else:
    batch, value_batch, targets = critic_advantages(rows, est, opts, run.critic,
                                                    run.critic_state.params, exp, pad_id,
                                                    capacity)
    adv = targets.advantage
    ret = targets.grouped.rejoin(rows, np.asarray(targets.grouped.batch.returns))
    metrics = value_targets.metrics(targets, critic_lib.LEVELS[experiment_lib.CRITIC_HEADS[est.name]])
    if exp.rollout.dump:
      extra = [critic_dump_fields(est.name, targets.fields, i) for i in range(len(rows))]
  metrics["advantage/mean"] = float(np.mean(adv))
  metrics["advantage/std"] = float(np.std(adv))
  metrics["advantage/zero_frac"] = float(np.mean(adv == 0))
  dump_fields = None
  if exp.rollout.dump:
    dump_fields = [dict(e, **{"return": float(x), "advantage": float(a)})
                   for e, x, a in zip(extra, ret, adv)]
  return UpdateTargets(token_batch=batch, value_batch=value_batch, metrics=metrics,
                       dump_fields=dump_fields)


# ---------------------------------------------------------------------------------------
# Critic-free estimators: one advantage per row
# ---------------------------------------------------------------------------------------
def compute_advantages(rows, est, opts, *, gamma: float, invalid_penalty: float, capacity: int):
  """Row advantages (input order), row returns and grouping statistics for the rows."""
  num_levels = getattr(opts, "k", 0) + 1
  grouped = grouping.build_row_batch(rollout_lib.advantage_columns(rows), num_levels=num_levels,
                                     gamma=gamma, invalid_penalty=invalid_penalty,
                                     capacity=capacity, **grouping.grouping_options(opts))
  out = est(jax.device_put(grouped.batch), opts)
  adv = grouped.rejoin(rows, np.asarray(out.advantage))  # by (traj, step), not position
  ret = grouped.rejoin(rows, np.asarray(grouped.batch.returns))
  return adv, ret, group_statistics(grouped)


def group_statistics(grouped) -> dict[str, float]:
  """Step-group sizes per level (GiGPO §5.5): mean size and singleton fraction."""
  b, n = grouped.batch, grouped.num_rows
  out = {}
  for k in range(b.context_group.shape[0]):
    ids = np.asarray(b.context_group[k][:n])
    ids = ids[ids >= 0]
    if ids.size == 0:
      continue
    sizes = np.bincount(ids)[ids]  # group size seen by each row of this level
    out[f"groups/level{k}_mean_size"] = float(sizes.mean())
    out[f"groups/level{k}_singleton_frac"] = float(np.mean(sizes == 1))
  return out


def token_batch(rows, adv: np.ndarray, exp: experiment_lib.Experiment,
                pad_id: int) -> train_batch_lib.TrainBatch:
  """The token batch of all rows with row advantages `adv`, padded to a multiple of the
  mini-batch (identical on every process)."""
  mini = exp.train.update.mini_batch_rows
  buckets = sampler_lib.prompt_buckets(exp.rollout.max_prompt_tokens)
  prompt_len = train_batch_lib.pick_bucket(max(len(r.prompt_ids) for r in rows), buckets, "prompt")
  batch, _ = train_batch_lib.build_train_batch(
      [r.prompt_ids for r in rows], [r.response_ids for r in rows], adv.astype(np.float32),
      prompt_buckets=(prompt_len,), response_buckets=(exp.rollout.max_new_tokens,),
      row_multiple=mini, pad_id=pad_id, row_buckets=(-(-len(rows) // mini) * mini,))
  return batch


# ---------------------------------------------------------------------------------------
# Critic estimators (needs_critic: gae = PPO, hae = HiPER): token advantages and values
# ---------------------------------------------------------------------------------------
def critic_advantages(rows, est, opts, critic: critic_step.CriticLearner, critic_params,
                      exp: experiment_lib.Experiment, pad_id: int, capacity: int):
  """Critic values -> estimator -> the actor's token batch and the critic's value batch.

  Returns:
    (TrainBatch with token advantages and the estimator's loss mask as response_mask,
     ValueBatch, CriticTargets of the rows).
  """
  num_heads = experiment_lib.CRITIC_HEADS[est.name]
  batch = token_batch(rows, np.zeros(len(rows), np.float32), exp, pad_id)
  values = critic_step.compute_values(critic, critic_params,
                                      critic_step.token_layout_batch(batch, num_heads))
  num_rows = batch.num_rows
  num_tokens = exp.rollout.max_new_tokens
  p = batch.seq_len - num_tokens
  targets = value_targets.critic_targets(
      rows, rollout_lib.advantage_columns(rows), est, opts, values[:len(rows)],
      prompt_len=p, num_tokens=num_tokens, gamma=exp.algo.gamma,
      invalid_penalty=exp.rollout.invalid_penalty, capacity=capacity)
  n, seq = len(rows), batch.seq_len
  adv = np.zeros((num_rows, seq), np.float32)
  loss_mask = np.zeros((num_rows, seq), bool)
  value_mask = np.zeros((num_rows, seq, num_heads), bool)
  returns = np.zeros((num_rows, seq, num_heads), np.float32)
  adv[:n, p:] = targets.token_advantage
  loss_mask[:n, p:] = targets.loss_mask
  value_mask[:n, p:] = targets.value_mask
  returns[:n, p:] = targets.returns
  batch = batch.replace(advantages=adv, response_mask=loss_mask)
  return batch, critic_step.value_batch(batch, value_mask, returns, values), targets


def critic_dump_fields(est_name: str, fields: dict, i: int) -> dict:
  """The dump-format critic fields of row i (`python -m hgpo_jax.advantages` reads them);
  HiPER rows dump their switch, subgoal and token_tags themselves."""
  if est_name == "gae":
    return {"token_values": [float(v) for v in fields["token_values"][i][fields["response_mask"][i]]]}
  return {"values": {"low": float(fields["values"][i][0]), "high": float(fields["values"][i][1]),
                     "term": float(fields["values"][i][2])}}
