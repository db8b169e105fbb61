"""Episodes with a run's settings: `collect` (the training rollout and evaluation both play
through it) and held-out evaluation (`evaluate`, `evaluate_splits`)."""

from __future__ import annotations

import os

import jax
import numpy as np

from hgpo_jax import progress
from hgpo_jax.advantages import dump as dump_lib
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.sampling import types as sampling_types
from hgpo_jax.training import metrics as metrics_lib
from hgpo_jax.training import processes
from hgpo_jax.training import run as run_lib
from hgpo_jax.training import experiment as experiment_lib


def collect(pool, sampler, tokenizer, tasks, group_size: int, exp: experiment_lib.Experiment,
            *, sampling: sampling_types.SamplingParams, rng: jax.Array,
            on_step=None) -> rollout_lib.Rollout:
  """One batched rollout with the experiment's env and rollout settings: the training
  rollout (`sampling.train`) and evaluation (`sampling.eval`) both play through here."""
  return rollout_lib.collect(
      pool, sampler, tokenizer, tasks, group_size, env_name=exp.env.name,
      max_steps=exp.env.max_steps, params=exp.rollout, sampling=sampling, rng=rng,
      on_step=on_step)


REPEAT_STREAMS = 1 << 20
"""Evaluation repeat r > 0 folds `REPEAT_STREAMS + r` into the evaluation stream before
the iteration (`repeat_key`): no iteration of a run reaches it."""


def repeat_key(eval_stream: jax.Array, iteration: int, repeat: int) -> jax.Array:
  """The evaluation key of `iteration`'s evaluation `repeat` (`eval.repeats`): repeat 0's
  is `fold_in(eval_stream, iteration)`, the key of a run without repeats."""
  if repeat:
    eval_stream = jax.random.fold_in(eval_stream, REPEAT_STREAMS + repeat)
  return jax.random.fold_in(eval_stream, iteration)


def evaluate_splits(run: run_lib.EvalRun, iteration: int, *,
                    dump_step: int | None = None) -> dict[str, float]:
  """`eval/<split>/<metric>` on every held-out split of the run, with the evaluation key of
  `iteration` (`fold_in(streams.eval, iteration)`); with `rollout.dump` the steps go to
  `eval_dump_path(..., dump_step)` (default: `iteration`). With `eval.repeats = R > 1`
  every split is evaluated R times, the metrics are the means over the repeats (plus
  `eval/<split>/repeats`), each repeat's per-task outcomes are written with its `repeat`
  index and repeat r > 0 dumps to `eval_dump_path(..., repeat=r)`. The R evaluations are R
  passes over the tasks, each with its own key (`repeat_key`), or with `eval.group_repeats`
  one pass in which each task's R evaluations are a group of R trajectories
  (`evaluate_grouped`)."""
  exp = run.experiment
  out = {}
  step = iteration if dump_step is None else dump_step
  repeats = exp.eval.repeats
  for split, tasks in run.eval_tasks.items():
    dump_paths = ([eval_dump_path(run.workdir, split, step, repeat=r) for r in range(repeats)]
                  if exp.rollout.dump else None)
    per_task = [[] for _ in range(repeats)]
    if exp.eval.group_repeats and repeats > 1:
      per_repeat = evaluate_grouped(run.pool, run.sampler, run.tokenizer, tasks, exp,
                                    repeat_key(run.streams.eval, iteration, 0), repeats,
                                    dump_paths=dump_paths, per_task=per_task)
    else:
      per_repeat = [evaluate(run.pool, run.sampler, run.tokenizer, tasks, exp,
                             repeat_key(run.streams.eval, iteration, r),
                             dump_path=dump_paths[r] if dump_paths else None,
                             per_task=per_task[r])
                    for r in range(repeats)]
    if jax.process_index() == 0:
      for r, results in enumerate(per_task):
        if repeats > 1:
          results = [dict(t, repeat=r) for t in results]
        metrics_lib.write_task_results(run.workdir, step, split, results)
    m = {k: float(np.mean([x[k] for x in per_repeat])) for k in per_repeat[0]}
    if repeats > 1:
      m["repeats"] = float(repeats)
    out.update({f"eval/{split}/{k}": v for k, v in m.items()})
  return out


def evaluate(pool, sampler, tokenizer, task_sampler, exp: experiment_lib.Experiment, rng, dump_path: str | None = None,
             per_task: list[dict] | None = None) -> dict[str, float]:
  """Success on a fixed task set at `eval.temperature`, one trajectory per task.

  dump_path: if set, this process's evaluated steps are written there as a rollout dump
  (`hgpo_jax.advantages.dump`; `group` and `traj` = the task's index in the eval set), to
  read what a policy did on held-out tasks.
  per_task: if given, one dict per task is appended, in eval-set order (all processes'):
  `index`, `task_id`, `won`, `return`, `length`.
  """
  return evaluate_grouped(pool, sampler, tokenizer, task_sampler, exp, rng, 1,
                          dump_paths=None if dump_path is None else [dump_path],
                          per_task=None if per_task is None else [per_task])[0]


def evaluate_grouped(pool, sampler, tokenizer, task_sampler, exp: experiment_lib.Experiment,
                     rng, repeats: int, *, dump_paths: list[str] | None = None,
                     per_task: list[list[dict]] | None = None) -> list[dict[str, float]]:
  """`repeats` evaluations of a fixed task set at `eval.temperature` in one pass: each
  rollout call plays `pool.num_slots // repeats` tasks as groups of `repeats` trajectories
  (same task, same env seed), trajectory r of a group being the task's evaluation r. The
  sampler prefills the identical prompts of a group's trajectories once (while their
  histories agree: at T=0.4 about half of a game's prompts over 8 evaluations; a
  trainer's sampler, which shares a group's first turn only, plays through its
  `sharing_identical_prompts` view), so R evaluations cost less than R passes; the draws
  differ from R passes' (`repeat_key`). With `repeats` = 1 this is `evaluate`, call for
  call.

  Returns one metrics dict per evaluation; `dump_paths` and `per_task`, when given, hold
  one path and one list per evaluation (as `evaluate`'s `dump_path` and `per_task`).
  Raises ConfigError when `repeats` does not divide the pool's slots.
  """
  slots = pool.num_slots
  if slots % repeats:
    raise experiment_lib.ConfigError(
        f"config.eval.group_repeats: eval.repeats={repeats} must divide the rollout's "
        f"{slots} env slots (rollout.num_groups x group_size per process)")
  per_call = slots // repeats
  if repeats > 1:
    sampler = sampler.sharing_identical_prompts()
  eval_tasks = task_sampler.evaluation_tasks(exp.eval.num_tasks)
  # (global task index, won, return, length, type, invalid flags of its rows, task id) per
  # task and evaluation
  results = [[] for _ in range(repeats)]
  dumped = [[] for _ in range(repeats)]
  for start in range(0, len(eval_tasks), per_call):
    chunk = eval_tasks[start:start + per_call]
    padded = chunk + [chunk[-1]] * (per_call - len(chunk))  # extra slots play, are not counted
    ro = collect(
        pool, sampler, tokenizer, padded, repeats, exp, sampling=exp.sampling.eval,
        rng=jax.random.fold_in(rng, start), on_step=lambda t, T, n: progress.phase(
            "evaluation", f"{task_sampler.split} tasks {start + 1}-{start + len(chunk)}: step {t + 1}/{T}"))
    for g, task in enumerate(chunk):
      for r in range(repeats):
        j = g * repeats + r
        results[r].append((task.group_index, ro.won[j], ro.returns[j], ro.lengths[j],
                           ro.task_types[j], [not x.valid for x in ro.rows if x.traj == j],
                           task.task_id))
    if dump_paths is not None:
      for x in ro.rows:
        if x.traj < len(chunk) * repeats:
          index = chunk[x.traj // repeats].group_index
          dumped[x.traj % repeats].append(dict(x.dump_record(), group=index, traj=index,
                                               split=task_sampler.split))
  if dump_paths is not None:
    for path, rows in zip(dump_paths, dumped):
      os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
      dump_lib.write_rows(path, rows)
  out = []
  for r in range(repeats):
    out.append(_metrics(results[r], None if per_task is None else per_task[r]))
  return out


def _metrics(results: list[tuple], per_task: list[dict] | None) -> dict[str, float]:
  """The metrics of one evaluation from this process's per-task `results`
  (`evaluate_grouped`), gathered over the processes; its per-task outcomes appended to
  `per_task`."""
  # All processes' tasks (dealt round-robin) back in task order: the metrics of one process.
  results = sorted((r for part in processes.allgather_objects(results) for r in part), key=lambda r: r[0])
  index, won, returns, lengths, types, invalid, task_ids = (
      (list(c) for c in zip(*results)) if results else ([],) * 7)
  if per_task is not None:
    per_task += [{"index": int(i), "task_id": t, "won": bool(w), "return": float(r),
                  "length": int(n)} for i, t, w, r, n in zip(index, task_ids, won, returns, lengths)]
  invalid = [flag for flags in invalid for flag in flags]
  m = rollout_lib.episode_metrics([], np.array(won), np.array(returns), np.array(lengths), types)
  m["invalid_rate"] = float(np.mean(invalid)) if invalid else 0.0
  m["num_tasks"] = float(len(won))
  del m["num_rows"]
  return m


def eval_dump_path(workdir: str, split: str, iteration: int, *, repeat: int = 0) -> str:
  """Where `rollout.dump` writes an evaluation's steps: one file per split, iteration
  (the trainer's count of finished iterations; 0 for `launch.evaluate`), repeat
  (`eval.repeats`; none for the first) and process."""
  suffix = f"_r{repeat}" if repeat else ""
  suffix += f"_p{jax.process_index()}" if jax.process_count() > 1 else ""
  return os.path.join(workdir, "rollouts", f"eval_{split}_{iteration:06d}{suffix}.jsonl")
