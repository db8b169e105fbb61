"""The trainer: `train_and_evaluate(config, workdir)`.

The loop reads as the iteration it runs (docs/architecture.md "The data flow of one
iteration"):

  run = build(config, workdir)                  # hgpo_jax/training/run.py
  for each iteration:
    rollout          tasks -> episodes through the env servers and the jit sampler
    compute_targets  rows -> token batch (+ value batch), advantages (update_targets.py)
    update           old/reference log-probs -> sharded, donated PPO epochs (+ critic)
    log              metrics.jsonl, TensorBoard, the console summary
    checkpoint, evaluate (evaluation.py) on their schedules

Every jitted program comes from the registry of hgpo_jax/training/programs.py; the typed
settings and their checks are hgpo_jax/training/run_config.py's.

Reproducibility: `config.seed` gives the model-init key, the sampler key (per
iteration `fold_in(key, iteration)`), the task-shuffle seed and the env seeds
(`tasks.group_seed(seed, iteration, group)`); the iteration number is the whole task
cursor. Same seed and config on the same machine give the same metrics, and resuming
from a checkpoint continues exactly like an uninterrupted run (tested). Wall-clock
timings (`time/*`) are the only metrics that differ between such runs.
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np
import tqdm

from hgpo_jax.advantages import dump as dump_lib
from hgpo_jax.cost import trainer_metrics
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.training import evaluation
from hgpo_jax.training import metrics as metrics_lib
from hgpo_jax.training import packing
from hgpo_jax.training import processes
from hgpo_jax.training import progress
from hgpo_jax.training import run as run_lib
from hgpo_jax.training import run_config
from hgpo_jax.training import train_step
from hgpo_jax.training import update_targets

# The trainer's config check, for its callers (launch/main.py, launch/suites.py).
ConfigError = run_config.ConfigError
validate = run_config.validate

# The metrics of the console line after each iteration.
SUMMARY_KEYS = ("rollout/success", "rollout/episode_return", "rollout/invalid_rate",
                "rollout/episode_length", "train/pg_loss", "train/kl", "groups/level0_mean_size",
                "time/generation_s", "time/env_s", "time/advantages_s", "time/update_s")


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Trains, evaluates and checkpoints; returns the last iteration's and final eval metrics."""
  run = run_lib.build(config, workdir)
  first = jax.process_index() == 0
  # A second live line naming the phase of the iteration (rollout step t/T, log-probs,
  # update mini-batch i/n, checkpoint, evaluation): drawn on a terminal only, so CI logs
  # get nothing extra. Library code reports through `progress.phase(...)`.
  reporter = progress.PhaseReporter(enabled=None if first else False).__enter__()
  try:
    start, num_iterations = run.start_iteration, config.train.num_iterations
    flops = trainer_metrics.LearnerFlops(run.learner)  # compiled FLOPs per call, per batch shape
    profile = trainer_metrics.ProfileWindow(workdir, start, config.profile.iterations,
                                            config.profile.skip)
    bar = tqdm.tqdm(range(start, num_iterations), initial=start, total=num_iterations,
                    desc="iterations", unit="it", disable=not first, dynamic_ncols=True)
    last: dict[str, float] = {}
    for it in bar:
      reporter.start_iteration()
      profile.before(it)
      t0 = time.perf_counter()
      ro = rollout(run, it)
      t1 = time.perf_counter()
      targets = update_targets.compute_targets(ro.rows, run)
      dump_rollout(run, it, ro, targets)
      t2 = time.perf_counter()
      metrics, flop_metrics = update(run, targets, it, flops)
      if config.eval.every and (it + 1) % config.eval.every == 0:
        metrics.update(evaluation.evaluate_splits(run, it + 1))
      metrics.update(rollout_metrics(ro))
      metrics.update(targets.metrics)
      metrics["time/advantages_s"] = t2 - t1
      metrics["time/iteration_s"] = time.perf_counter() - t0
      metrics.update(flop_metrics())  # after the clock stops: it may compile (LearnerFlops)
      last = log(run, it + 1, metrics, bar)
      if (it + 1) % config.checkpoint.every == 0 or it + 1 == num_iterations:
        progress.phase("checkpoint")
        run.checkpoint(it + 1, last)
      profile.after(it)
    profile.close()

    final = {}
    if config.eval.at_end:
      final = evaluation.evaluate_splits(run, num_iterations)
      run.writer.write(num_iterations + 1, final)
    run.checkpointer.wait()
    reporter.__exit__(None, None, None)  # removes the phase line before the summary
    if first:
      print(summary(config, workdir, final), flush=True)
    return {"last": last, "final_eval": final, "resume_source": run.resume_source,
            "start_iteration": start}
  finally:
    reporter.__exit__(None, None, None)  # idempotent
    run.close()


# ---------------------------------------------------------------------------------------
# The steps of one iteration
# ---------------------------------------------------------------------------------------
def rollout(run: run_lib.Run, iteration: int) -> rollout_lib.Rollout:
  """This process's groups of the iteration played at `rollout.temperature`, then all
  processes' rows (`processes.gather_rollout`: identical on every process)."""
  config = run.config
  ro = evaluation.collect(
      run.pool, run.sampler, run.tokenizer,
      run.train_tasks.groups(iteration, run.groups_per_process), config.rollout.group_size,
      config, run.settings, sampling=run.settings.sampling,
      rng=jax.random.fold_in(run.streams.sampler, iteration),
      on_step=lambda t, T, n: progress.phase("rollout", f"step {t + 1}/{T} ({n} slots active)"))
  return processes.gather_rollout(ro, run.groups_per_process, config.rollout.group_size)


def dump_rollout(run: run_lib.Run, iteration: int, ro: rollout_lib.Rollout,
                 targets: update_targets.UpdateTargets) -> None:
  """With `rollout.dump`: the iteration's rows with their returns and advantages, as
  `workdir/rollouts/iter_NNNNNN.jsonl` (`python -m hgpo_jax.advantages` reads it)."""
  if targets.dump_fields is None or jax.process_index() != 0:
    return
  os.makedirs(os.path.join(run.workdir, "rollouts"), exist_ok=True)
  dump_lib.write_rows(os.path.join(run.workdir, "rollouts", f"iter_{iteration:06d}.jsonl"),
                      [dict(r.dump_record(), **f) for r, f in zip(ro.rows, targets.dump_fields)])


def update(run: run_lib.Run, targets: update_targets.UpdateTargets, iteration: int,
           flops: trainer_metrics.LearnerFlops
           ) -> tuple[dict[str, float], Callable[[], dict[str, float]]]:
  """The actor's PPO epochs on the token batch (after its old and reference log-probs) and
  the critic's on the value batch; rebinds `run.state`, `run.critic_state` and the
  sampler's params. Returns the `train/*` and `critic/*` metrics with their timings, and
  the function that gives the update's `perf/*` FLOP metrics."""
  config, settings = run.config, run.settings
  t0 = time.perf_counter()
  batch = targets.token_batch
  # verl's trainer.critic_warmup: the first iterations train only the critic
  actor_updated = run.critic is None or iteration >= config.critic.warmup_iterations
  # One optimizer step from the rollout's params: the update takes log pi_old from
  # its own forward pass (UpdateConfig.reuse_on_policy_logprobs)
  on_policy = settings.update.on_policy(batch.num_rows)
  # the update's mini-batches (unpacked, packed or length-grouped) and their real token share
  batches = update_layout(batch, config, run.tokenizer.pad_id)
  token_fill, update_rows = packing.token_fill(batches), packing.num_rows(batches)
  if actor_updated:
    progress.phase("log-probs")
    # laid out on the mesh with their log-probs, where the update reads them
    batches = train_step.fill_logprobs(run.learner, run.state.params, run.ref_params, batches,
                                       old=not on_policy)
    # the log-probs stay on the mesh (dispatched asynchronously): wait for them, so that
    # time/logprobs_s (and the log-prob MFU) times the passes, not their dispatch
    batches = jax.block_until_ready(batches)
  t1 = time.perf_counter()
  metrics: dict[str, float] = {}
  if actor_updated:
    run.state, actor = train_step.train_iteration(run.learner, run.state, batches,
                                                  on_policy=on_policy)
    metrics.update({f"train/{k}": v for k, v in actor.items()})
    metrics["train/on_policy_logprobs"] = float(on_policy)
    run.update_sampler()  # the update donated the params: rebind
  t2 = time.perf_counter()
  if run.critic is not None:  # independent of the actor's update (same targets)
    run.critic_state, critic = train_step.train_iteration(run.critic, run.critic_state,
                                                          targets.value_batch)
    metrics.update({f"critic/{k}": v for k, v in critic.items()})
    metrics["time/critic_update_s"] = time.perf_counter() - t2
    metrics["train/actor_updated"] = float(actor_updated)
  metrics.update({"train/token_fill": token_fill,
                  "train/update_rows": float(update_rows),  # rows per epoch (fewer when packed)
                  "time/logprobs_s": t1 - t0, "time/update_s": t2 - t1})
  if not actor_updated:
    return metrics, dict
  passes = int(not on_policy) + int(run.ref_params is not None)
  # perf counts a one-part mini-batch as the one compiled `Learner.update` it runs as
  counted = [parts[0] if len(parts) == 1 else parts for parts in batches]
  return metrics, functools.partial(trainer_metrics.iteration_metrics, flops, counted,
                                    logprob_passes=passes, logprobs_s=t1 - t0, update_s=t2 - t1,
                                    dtype=run.compute_dtype)


def update_layout(batch, config: ml_collections.ConfigDict, pad_id: int) -> list[tuple]:
  """`batch`'s mini-batches as the update takes them (hgpo_jax/training/packing.py): as they
  are, packed into rows (`train.pack_rows`) or as length-grouped micro-batches
  (`train.group_by_length`)."""
  mini = config.train.mini_batch_rows
  if not (config.train.pack_rows or config.train.group_by_length):
    return packing.plain_batch(batch, mini_batch_rows=mini)
  common = dict(mini_batch_rows=mini, micro_batch_rows=config.train.micro_batch_rows,
                score_multiple=config.rollout.max_new_tokens, pad_id=pad_id,
                loss_unit_rows=config.train.loss_unit_rows)
  if config.train.pack_rows:
    return packing.pack_batch(batch, **common)
  return packing.group_batch(batch, length_multiple=config.train.length_multiple, **common)


def rollout_metrics(ro: rollout_lib.Rollout) -> dict[str, float]:
  """`rollout/*` and the rollout's timings."""
  out = {f"rollout/{k}": v for k, v in ro.metrics().items()}
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
  return scalars


def summary(config: ml_collections.ConfigDict, workdir: str, final: dict[str, float]) -> str:
  """The closing report: training curve endpoints, final evaluation, where things are."""
  lines = metrics_lib.read_jsonl(os.path.join(workdir, metrics_lib.JSONL_NAME))
  train_lines = [l for l in lines if "rollout/success" in l]
  out = [f"== {config.env.name} / {config.algo.name} / {config.model.name}: "
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
  for key in sorted(k for k in final if k.endswith("/success") and k.count("/") == 2):
    split = key.split("/")[1]
    out.append(f"eval {split:>13}: success {final[key]:.3f} over {int(final[f'eval/{split}/num_tasks'])}"
               f" tasks (T={config.eval.temperature}), invalid-action rate "
               f"{final[f'eval/{split}/invalid_rate']:.3f}")
  out.append(f"metrics: {os.path.join(workdir, metrics_lib.JSONL_NAME)}   checkpoints: "
             f"{os.path.join(workdir, 'checkpoints')}")
  return "\n".join(out)
