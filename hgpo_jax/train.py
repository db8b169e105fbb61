"""The trainer: `train_and_evaluate(exp, workdir)`.

The loop reads as the iteration it runs (docs/architecture.md "The data flow of one
iteration"):

  run = build(exp, workdir)                     # hgpo_jax/training/run.py
  for each iteration:
    rollout          tasks -> episodes through the env servers and the jit sampler
    compute_targets  rows -> token batch (+ value batch), advantages (update_targets.py)
    update           old/reference log-probs -> sharded, donated PPO epochs (+ critic)
    log              metrics.jsonl, TensorBoard, the console summary
    checkpoint, evaluate (evaluation.py) on their schedules

Every jitted program comes from the registry of hgpo_jax/training/programs.py; the typed
settings and their checks are hgpo_jax/training/experiment.py's (`exp`, built once from the
user's ConfigDict by the launch tools: `experiment.from_config`).

Reproducibility: `seed` gives the model-init key, the sampler key (per
iteration `fold_in(key, iteration)`), the task-shuffle seed and the env seeds
(`tasks.group_seed(seed, iteration, group)`); the iteration number is the whole task
cursor. Same seed and config on the same machine give the same metrics, and resuming
from a checkpoint continues exactly like an uninterrupted run (tested). Wall-clock
timings (`time/*`) are the only metrics that differ between such runs.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import jax
import numpy as np
import tqdm
from jax.experimental import multihost_utils

from hgpo_jax import progress
from hgpo_jax.advantages import dump as dump_lib
from hgpo_jax.compiled import trainer_metrics
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.training import async_rollout
from hgpo_jax.training import evaluation
from hgpo_jax.training import experiment as experiment_lib
from hgpo_jax.training import losses
from hgpo_jax.training import metrics as metrics_lib
from hgpo_jax.training import run_records
from hgpo_jax.training import packing
from hgpo_jax.training import processes
from hgpo_jax.training import run as run_lib
from hgpo_jax.training import train_batch as train_batch_lib
from hgpo_jax.training import train_step
from hgpo_jax.training import update_targets

# The trainer's config error, for its callers (launch/main.py, launch/experiments/suites.py).
ConfigError = experiment_lib.ConfigError

# The metrics of the console line after each iteration.
SUMMARY_KEYS = ("rollout/success", "rollout/episode_return", "rollout/invalid_rate",
                "rollout/episode_length", "train/pg_loss", "train/kl", "groups/level0_mean_size",
                "time/generation_s", "time/env_s", "time/advantages_s", "time/update_s")


def train_and_evaluate(exp: experiment_lib.Experiment, workdir: str) -> dict[str, Any]:
  """Trains, evaluates and checkpoints; returns the last iteration's and final eval metrics."""
  run = run_lib.build(exp, workdir)
  first = jax.process_index() == 0
  # A second live line naming the phase of the iteration (rollout step t/T, log-probs,
  # update mini-batch i/n, checkpoint, evaluation): drawn on a terminal only, so CI logs
  # get nothing extra. Library code reports through `progress.phase(...)`.
  reporter = progress.PhaseReporter(enabled=None if first else False).__enter__()
  batches = None
  try:
    start, num_iterations = run.start_iteration, exp.train.num_iterations
    flops = trainer_metrics.LearnerFlops(run.learner)  # compiled FLOPs per call, per batch shape
    profile = trainer_metrics.ProfileWindow(workdir, start, exp.profile.iterations,
                                            exp.profile.skip)
    bar = tqdm.tqdm(range(start, num_iterations), initial=start, total=num_iterations,
                    desc="iterations", unit="it", disable=not first, dynamic_ncols=True)
    last: dict[str, float] = {}
    batches = rollout_source(run, start, num_iterations)
    for it in bar:
      reporter.start_iteration()
      profile.before(it)
      times = progress.PhaseTimes()
      with times.phase("iteration"):
        ro, ahead_metrics = batches.take(it)
        with times.phase("advantages"):
          reward_metrics = kl_in_reward(run, ro.rows)
          targets = update_targets.compute_targets(ro.rows, run)
          targets.token_batch = with_sampler_data(targets.token_batch, ro.rows, exp.train)
          dump_rollout(run, it, ro, targets)
        metrics, flop_metrics = update(run, targets, it, flops)
        batches.publish(it, run.state.params)  # the update donated the params: rebind
        if exp.mesh.split:  # the move of the new weights to the sampler's devices
          metrics["time/weight_transfer_s"] = run.sampler_weights.transfer_s
        if exp.eval.every and (it + 1) % exp.eval.every == 0:
          with batches.for_evaluation():
            metrics.update(evaluation.evaluate_splits(run, it + 1))
        metrics.update(rollout_metrics(ro))
        metrics.update(ahead_metrics)
        metrics.update(reward_metrics)
        metrics.update(targets.metrics)
      metrics.update(times.metrics())
      metrics.update(flop_metrics())  # after the clock stops: it may compile (LearnerFlops)
      last = log(run, it + 1, metrics, bar)
      if (it + 1) % exp.checkpoint.every == 0 or it + 1 == num_iterations:
        progress.phase("checkpoint")
        run.checkpoint(it + 1, last, sampler_versions=batches.pending_versions(it + 1))
      profile.after(it)
    profile.close()
    batches.close()

    final = {}
    if exp.eval.at_end:
      with batches.for_evaluation():
        final = evaluation.evaluate_splits(run, num_iterations)
      run.writer.write(num_iterations + 1, final)
    run.checkpointer.wait()
    reporter.__exit__(None, None, None)  # removes the phase line before the summary
    if first:
      print(summary(exp, workdir, final), flush=True)
    return {"last": last, "final_eval": final, "resume_source": run.resume_source,
            "start_iteration": start}
  finally:
    reporter.__exit__(None, None, None)  # idempotent
    if batches is not None:
      batches.close()  # a rollout thread stops after its batch
    run.close()


def rollout_source(run: run_lib.Run, start: int, end: int
                   ) -> async_rollout.Synchronous | async_rollout.Rollouter:
  """Where the loop takes each iteration's batch (hgpo_jax/training/async_rollout.py):
  played when asked with the current weights (`train.max_staleness=0`), or played ahead
  in a thread with the weights of `max_staleness` versions before."""
  exp = run.experiment
  k = exp.train.max_staleness
  if k == 0:
    return async_rollout.Synchronous(lambda it: rollout(run, it), run.update_sampler)
  if jax.process_count() > 1 and exp.train.filter_groups:
    raise experiment_lib.ConfigError(
        f"config.train.max_staleness={k} with config.train.filter_groups runs on one "
        f"process (dynamic sampling gathers every process's rows between its batches)")

  def play(iteration: int, placed) -> rollout_lib.Rollout:
    run.sampler.model = run.sampler_weights.merge(placed)
    return rollout(run, iteration, gather=False)

  def gather(ro: rollout_lib.Rollout) -> rollout_lib.Rollout:
    # in the learner's thread: a collective over every process's devices, issued in the
    # same order on every process (the thread's programs run on its own process's devices)
    return processes.gather_rollout(ro, run.groups_per_process, exp.rollout.group_size)

  versions = run.sampler_versions or {start - 1: run.state.params}
  return async_rollout.Rollouter(play, start, end, k, versions, rebind=run.update_sampler,
                                 place=run.sampler_weights.copy, finish=gather)


# ---------------------------------------------------------------------------------------
# The steps of one iteration
# ---------------------------------------------------------------------------------------
def rollout(run: run_lib.Run, iteration: int, *, gather: bool = True) -> rollout_lib.Rollout:
  """The iteration's groups, all processes' rows (identical on every process; with
  `gather=False` and no dynamic sampling, this process's rows, for
  `processes.gather_rollout`).

  Without `train.filter_groups`: one generation batch (`generation_batch`). With it
  (DAPO's dynamic sampling, verl-agent's `dynamic_multi_turn_loop`): generation batches
  of new tasks are played until `rollout.num_groups` groups whose trajectories differ in
  `train.filter_groups_metric` exist or `train.max_generation_batches` were played; the
  update trains on exactly `rollout.num_groups` of their groups
  (`rollout_lib.dynamic_selection`), and `filter/*` counts them.
  """
  exp = run.experiment
  if not exp.train.filter_groups:
    return generation_batch(run, iteration, 0, gather=gather)
  first = generation_batch(run, iteration, 0)
  size, target = exp.rollout.group_size, exp.rollout.num_groups
  metric = exp.train.filter_groups_metric
  batches = [first]
  varied = len(rollout_lib.varied_groups(first, size, metric))
  while varied < target and len(batches) < exp.train.max_generation_batches:
    batches.append(generation_batch(run, iteration, len(batches)))
    varied += len(rollout_lib.varied_groups(batches[-1], size, metric))
  picks, stats = rollout_lib.dynamic_selection(batches, size, target, metric)
  ro = rollout_lib.select_groups(batches, picks, size)
  ro.filter_stats = dict(stats, first_batch_success=float(np.mean(first.won)))
  return ro


EXTRA_BATCH_ITERATIONS = 1 << 20
"""First virtual iteration of dynamic sampling's extra generation batches (no run has as
many real iterations)."""


def generation_batch(run: run_lib.Run, iteration: int, index: int, *, gather: bool = True
                     ) -> rollout_lib.Rollout:
  """Generation batch `index` of `iteration`: this process's groups played at
  `rollout.temperature`, then all processes' rows (`processes.gather_rollout`; this
  process's alone with `gather=False`).

  Batch 0 is the iteration's own tasks and sampler key; batch b > 0 (dynamic sampling)
  draws the tasks, env seeds and sampler key of the virtual iteration
  `EXTRA_BATCH_ITERATIONS + iteration * (max_generation_batches - 1) + b - 1`, past every
  real iteration and independent of the run's length, so no two batches of a run share
  tasks or keys and a resumed or extended run draws the same ones.
  """
  exp = run.experiment
  drawn = iteration if index == 0 else (EXTRA_BATCH_ITERATIONS + iteration *
                                        (exp.train.max_generation_batches - 1) + index - 1)
  ro = evaluation.collect(
      run.pool, run.sampler, run.tokenizer,
      run.train_tasks.groups(drawn, run.groups_per_process), exp.rollout.group_size,
      exp, sampling=exp.sampling.train,
      rng=jax.random.fold_in(run.streams.sampler, drawn),
      on_step=lambda t, T, n: progress.phase(
          "rollout", f"{'' if index == 0 else f'batch {index + 1}, '}step {t + 1}/{T} "
          f"({n} slots active)"))
  if not gather:
    return ro
  return processes.gather_rollout(ro, run.groups_per_process, exp.rollout.group_size)


def with_sampler_data(batch, rows, train: experiment_lib.Train):
  """The token batch with what the sampler knew of its rows' responses: its log-probs (the
  rollout correction reads them; the mismatch metrics compare them with the learner's)
  and, with `train.constrained_logprobs`, the ids the constraint allowed at each token
  (`train_batch.with_choices`: the learner scores the constrained policy)."""
  if not any(r.response_logprobs is None for r in rows):
    batch = train_batch_lib.with_rollout_logprobs(batch, [r.response_logprobs for r in rows])
  if train.constrained_logprobs:
    batch = train_batch_lib.with_choices(batch, [r.response_choices for r in rows],
                                         train.max_choices)
  return batch


def kl_in_reward(run: run_lib.Run, rows) -> dict[str, float]:
  """With `train.kl_in_reward` (verl `algorithm.use_kl_in_reward`, `apply_kl_penalty`):
  each row's reward loses beta * sum_t KL_t over its response tokens, KL_t the
  `train.kl_reward_estimator` of log pi_old - log pi_ref (one log-prob pass of each on the
  rows, before the advantages), and the controller (`run.kl_controller`) updates beta with
  the batch's mean over rows of their token-mean KL. Changes `rows` in place; returns the
  `train/reward_kl*` metrics ({} when off)."""
  ctrl = run.kl_controller
  if ctrl is None:
    return {}
  progress.phase("log-probs", "KL in reward")
  exp = run.experiment
  batch = with_sampler_data(update_targets.token_batch(
      rows, np.zeros(len(rows), np.float32), exp, run.tokenizer.pad_id), rows, exp.train)
  filled = train_step.fill_logprobs(
      run.learner, run.state.params, run.ref_params,
      packing.plain_batch(batch, mini_batch_rows=exp.train.update.mini_batch_rows))
  old, ref, mask = (np.concatenate([host_array(getattr(parts[0], name)) for parts in filled])
                    for name in ("old_logprobs", "ref_logprobs", "score_mask"))
  n = len(rows)  # the real rows (the batch is padded to a multiple of the mini-batch)
  penalty, current = losses.kl_reward_penalty(old[:n], ref[:n], mask[:n],
                                              exp.train.kl_reward_estimator)
  beta = ctrl.value
  for row, kl in zip(rows, penalty):
    row.reward -= beta * float(kl)
  ctrl.update(current, n)
  return {"train/reward_kl": current, "train/reward_kl_coef": beta}


def host_array(x) -> np.ndarray:
  """A (global) device array on the host, whole on every process."""
  if getattr(x, "is_fully_addressable", True):
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def dump_rollout(run: run_lib.Run, iteration: int, ro: rollout_lib.Rollout,
                 targets: update_targets.UpdateTargets) -> None:
  """With `rollout.dump`: the iteration's rows with their returns and advantages, as
  `workdir/rollouts/iter_NNNNNN.jsonl` (`python -m hgpo_jax.advantages` reads it); with
  `train.max_staleness` > 0 each row also names the policy version that sampled it
  (`policy_version`: the weights after that iteration, -1 the initial ones)."""
  if targets.dump_fields is None or jax.process_index() != 0:
    return
  k = run.experiment.train.max_staleness
  version = {"policy_version": async_rollout.sampled_version(iteration, k)} if k else {}
  os.makedirs(os.path.join(run.workdir, "rollouts"), exist_ok=True)
  dump_lib.write_rows(os.path.join(run.workdir, "rollouts", f"iter_{iteration:06d}.jsonl"),
                      [dict(r.dump_record(), **f, **version)
                       for r, f in zip(ro.rows, targets.dump_fields)])


def update(run: run_lib.Run, targets: update_targets.UpdateTargets, iteration: int,
           flops: trainer_metrics.LearnerFlops
           ) -> tuple[dict[str, float], Callable[[], dict[str, float]]]:
  """The actor's PPO epochs on the token batch (after its old and reference log-probs) and
  the critic's on the value batch; rebinds `run.state`, `run.critic_state` and the
  sampler's params. Returns the `train/*` and `critic/*` metrics with their timings, and
  the function that gives the update's `perf/*` FLOP metrics."""
  exp = run.experiment
  times = progress.PhaseTimes()
  metrics: dict[str, float] = {}
  extra_pass = False
  with times.phase("logprobs"):
    batch = targets.token_batch
    # verl's trainer.critic_warmup: the first iterations train only the critic
    actor_updated = run.critic is None or iteration >= exp.critic.warmup_iterations
    # One optimizer step from the rollout's params: the update takes log pi_old from
    # its own forward pass (UpdateConfig.reuse_on_policy_logprobs)
    on_policy = exp.train.update.on_policy(batch.num_rows)
    # the update's mini-batches (unpacked, packed or length-grouped) and their real token share
    batches = update_layout(batch, exp, run.tokenizer.pad_id)
    token_fill, update_rows = packing.token_fill(batches), packing.num_rows(batches)
    if actor_updated:
      progress.phase("log-probs")
      run.state = run.learner.with_learning_rate(run.state, iteration)
      # laid out on the mesh with their log-probs, where the update reads them
      batches = train_step.fill_logprobs(run.learner, run.state.params, run.ref_params, batches,
                                         old=not on_policy)
      # the log-probs stay on the mesh (dispatched asynchronously): wait for them, so that
      # time/logprobs_s (and the log-prob MFU) times the passes, not their dispatch
      batches = jax.block_until_ready(batches)
      mismatch, extra_pass = rollout_mismatch(run, batch, batches, on_policy)
      metrics.update(mismatch)
  with times.phase("update"):
    if actor_updated:
      run.state, actor = train_step.train_iteration(run.learner, run.state, batches,
                                                    on_policy=on_policy)
      metrics.update({f"train/{k}": v for k, v in actor.items()})
      metrics["train/on_policy_logprobs"] = float(on_policy)
  if run.critic is not None:  # independent of the actor's update (same targets)
    with times.phase("critic_update"):
      run.critic_state = run.critic.with_learning_rate(run.critic_state, iteration)
      run.critic_state, critic = train_step.train_iteration(run.critic, run.critic_state,
                                                            targets.value_batch)
    metrics.update({f"critic/{k}": v for k, v in critic.items()})
    metrics["train/actor_updated"] = float(actor_updated)
  metrics.update({"train/token_fill": token_fill,
                  "train/update_rows": float(update_rows),  # rows per epoch (fewer when packed)
                  **times.metrics()})
  if not actor_updated:
    return metrics, dict
  passes = int(not on_policy) + int(run.ref_params is not None) + int(extra_pass)
  # perf counts a one-part mini-batch as the one compiled `Learner.update` it runs as
  counted = [parts[0] if len(parts) == 1 else parts for parts in batches]
  return metrics, functools.partial(trainer_metrics.iteration_metrics, flops, counted,
                                    logprob_passes=passes, logprobs_s=times.seconds["logprobs"],
                                    update_s=times.seconds["update"], dtype=run.compute_dtype)


def rollout_mismatch(run: run_lib.Run, batch, batches, on_policy: bool
                     ) -> tuple[dict[str, float], bool]:
  """`rollout_corr/*`: the learner's log-probs of the scored tokens against the sampler's
  (`losses.mismatch_metrics`), before the update; and whether it took a log-prob pass of
  its own. The old log-probs are reused when the update's rows are plain and were filled
  (not `on_policy`); otherwise the current policy's are computed on the plain rows."""
  train = run.experiment.train
  if (not train.rollout_mismatch_metrics or batch.rollout_logprobs is None
      or train.constrained_logprobs):  # the sampler's are the unconstrained ones
    return {}, False
  learner = run.learner
  reuse = not on_policy and not (train.update.pack_rows or train.update.group_by_length)
  if reuse:
    logp = [parts[0].old_logprobs for parts in batches]
  else:
    progress.phase("log-probs", "sampler mismatch")
    logp = [learner.compute_logprobs(run.state.params, learner.lay_out(learner.put_batch(chunk)))
            for (chunk,) in packing.plain_batch(batch, mini_batch_rows=train.update.mini_batch_rows)]
  learner_logp = np.concatenate([host_array(x) for x in logp])
  tail = lambda x: np.asarray(x)[:, -learner_logp.shape[1]:]
  found = losses.mismatch_metrics(learner_logp, tail(batch.rollout_logprobs),
                                  tail(batch.response_mask), train.update.loss.rollout_is_threshold)
  return {f"rollout_corr/{k}": v for k, v in found.items()}, not reuse


def update_layout(batch, exp: experiment_lib.Experiment, pad_id: int) -> list[tuple]:
  """`batch`'s mini-batches as the update takes them (hgpo_jax/training/packing.py): as they
  are, packed into rows (`train.pack_rows`) or as length-grouped micro-batches
  (`train.group_by_length`)."""
  u = exp.train.update
  mini = u.mini_batch_rows
  if not (u.pack_rows or u.group_by_length):
    return packing.plain_batch(batch, mini_batch_rows=mini)
  common = dict(mini_batch_rows=mini, micro_batch_rows=u.micro_batch_rows,
                score_multiple=exp.rollout.max_new_tokens, pad_id=pad_id,
                loss_unit_rows=u.loss_unit_rows, skip_zero_advantage=u.skip_zero_advantage)
  if u.pack_rows:
    return packing.pack_batch(batch, **common)
  return packing.group_batch(batch, length_multiple=u.length_multiple, **common)


def rollout_metrics(ro: rollout_lib.Rollout) -> dict[str, float]:
  """`rollout/*` (over the groups trained on), `filter/*` (dynamic sampling) and the
  rollout's timings."""
  out = {f"rollout/{k}": v for k, v in ro.metrics().items()}
  out.update({f"filter/{k}": v for k, v in ro.filter_stats.items()})
  out.update({"time/generation_s": ro.timings["generation_s"], "time/env_s": ro.timings["env_s"]})
  return out


def log(run: run_lib.Run, step: int, metrics: dict[str, float], bar: tqdm.tqdm) -> dict[str, float]:
  """Adds the env pool's counts (summed over processes), writes `metrics` at `step` and
  prints the console line; returns the written scalars."""
  env_keys = ("failed_calls", "replayed_episodes", "restarts")
  counts = np.array([[run.pool.metrics()[k] for k in env_keys]])
  env_counts = processes.allgather(counts).sum(axis=0)
  metrics.update({f"env/{k}": float(v) for k, v in zip(env_keys, env_counts)})
  scalars = run.writer.write(step, metrics)
  if jax.process_index() == 0:
    bar.write(metrics_lib.format_summary(step, scalars, keys=SUMMARY_KEYS))
    for learner in ("train", "critic"):
      if scalars.get(f"{learner}/skipped_steps", 0.0) > 0:
        bar.write(skipped_steps_warning(step, learner, scalars))
  return scalars


def skipped_steps_warning(step: int, learner: str, scalars: dict[str, float]) -> str:
  """The console line of an iteration in which the non-finite-norm rule skipped steps."""
  return (f"warning: iteration {step}: {int(scalars[f'{learner}/skipped_steps'])} of "
          f"{int(scalars[f'{learner}/num_updates'])} {learner} optimizer steps skipped (gradient "
          f"norm not finite; the params and optimizer state kept their values)")


def summary(exp: experiment_lib.Experiment, workdir: str, final: dict[str, float]) -> str:
  """The closing report: training curve endpoints, final evaluation, where things are."""
  lines = run_records.read_metrics(workdir)
  train_lines = [l for l in lines if "rollout/success" in l]
  out = [f"== {exp.env.name} / {exp.algo.name} / {exp.model.name}: "
         f"{len(train_lines)} iterations =="]
  if train_lines:
    first, last = train_lines[0], train_lines[-1]
    out.append(f"train success  first {first['rollout/success']:.3f} -> last "
               f"{last['rollout/success']:.3f}   invalid-action rate {first['rollout/invalid_rate']:.3f}"
               f" -> {last['rollout/invalid_rate']:.3f}")
    total = sum(l.get("time/iteration_s", 0.0) for l in train_lines)
    out.append(f"time per iteration {total / len(train_lines):.1f} s (generation "
               f"{np.mean([l['time/generation_s'] for l in train_lines]):.1f} s, update "
               f"{np.mean([l['time/update_s'] for l in train_lines]):.1f} s)")
    skipped = sum(l.get("train/skipped_steps", 0.0) + l.get("critic/skipped_steps", 0.0)
                  for l in train_lines)
    if skipped:
      out.append(f"skipped optimizer steps (non-finite gradient norm): {int(skipped)}")
  for key in sorted(k for k in final if k.endswith("/success") and k.count("/") == 2):
    split = key.split("/")[1]
    out.append(f"eval {split:>13}: success {final[key]:.3f} over {int(final[f'eval/{split}/num_tasks'])}"
               f" tasks (T={exp.eval.temperature}), invalid-action rate "
               f"{final[f'eval/{split}/invalid_rate']:.3f}")
  out.append(f"metrics: {os.path.join(workdir, metrics_lib.JSONL_NAME)}   checkpoints: "
             f"{os.path.join(workdir, 'checkpoints')}")
  return "\n".join(out)
