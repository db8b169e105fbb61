r"""Evaluation without training: a prompted policy on the held-out splits of a config.

  python -m launch.evaluate --config=configs/alfworld.py:model=smollm2-135m \
      --workdir=/tmp/eval_smollm2 [--config.env.args.data_dir=...]

The trainer (`hgpo_jax.train.train_and_evaluate`) rejects `train.num_iterations=0`, so
the prompting baselines of the results tables (an untrained model, e.g. SmolLM2-135M-
Instruct with constrained decoding, like the papers' prompting rows) run here: the same
model loading, env servers, task splits and `train.evaluate` (one trajectory per task at
`config.eval.temperature`, the eval random stream of `config.seed`) as the trainer's
final evaluation, with no update. It writes one line to `<workdir>/metrics.jsonl` with
`step` 0 and the trainer's `eval/<split>/<metric>` keys, so `launch.sweep` reads it like
a training run's final evaluation. `config.model.path` / `--config.checkpoint.*` are not
read: this evaluates the initial weights of the named model. With
`--config.rollout.dump=true` the evaluated steps (prompt and response tokens, action,
observation, reward) go to `<workdir>/rollouts/eval_<split>_000000.jsonl`, to see what the
model did.
"""

from __future__ import annotations

import os

from absl import app

# The trainer's entry point owns the flags (--config, --workdir, ...): one definition, so
# both entry points can be imported into one process (tests, the API reference).
from launch import main as main_lib

_CONFIG = main_lib._CONFIG
_WORKDIR = main_lib._WORKDIR

EVAL_STEP = 0  # the `step` of the single metrics line


def evaluate_untrained(config, workdir: str) -> dict[str, float]:
  """Evaluates the config's initial model on `config.env.eval_splits`; writes metrics."""
  import jax
  from hgpo_jax import train
  from hgpo_jax.models import loading
  from hgpo_jax.rollout import tasks as tasks_lib
  from hgpo_jax.sampling import sampler as sampler_lib
  from hgpo_jax.training import metrics as metrics_lib
  from hgpo_jax.training import programs

  if not config.env.eval_splits:
    raise train.ConfigError("config.env.eval_splits is empty: nothing to evaluate")
  run = train.validate(config)
  os.makedirs(workdir, exist_ok=True)
  streams = train._streams(config.seed)
  mesh = train._make_mesh(config)
  model, tokenizer, _ = loading.load_model(
      config.model.name if config.model.name in train.MODELS_WITH_PATH or not config.model.path
      else config.model.path, path=config.model.path or None, dtype=config.model.dtype,
      mesh=mesh, seed=streams.model_seed)
  model.cfg = train.model_settings(config, model.cfg, mesh)
  slots = config.rollout.num_groups * config.rollout.group_size
  pool = train._make_pool(config, slots)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=False)
  try:
    splits = tuple(config.env.eval_splits)
    dataset_dir = tasks_lib.build_task_datasets(
        config.env.name, {s: pool.list_tasks(s) for s in splits}, os.path.join(workdir, "tasks"))
    buckets = programs.prompt_buckets(config.rollout.max_prompt_tokens)
    sampler = sampler_lib.Sampler(model, tokenizer, prompt_buckets=buckets, mesh=mesh)
    out = {}
    for split in splits:
      ts = tasks_lib.TaskSampler(tasks_lib.load_split(dataset_dir, split), split,
                                 streams.task_seed, jax.process_index(), jax.process_count())
      # The same key as the trainer's final evaluation (iteration = num_iterations).
      m = train.evaluate(pool, sampler, tokenizer, ts, config, run,
                         jax.random.fold_in(streams.eval, config.train.num_iterations),
                         dump_path=(train.eval_dump_path(workdir, split, EVAL_STEP)
                                    if config.rollout.dump else None))
      out.update({f"eval/{split}/{k}": v for k, v in m.items()})
    scalars = writer.write(EVAL_STEP, out)
  finally:
    pool.close()
    writer.close()
  for split in splits:
    print(f"eval {split:>13}: success {scalars[f'eval/{split}/success']:.3f} over "
          f"{int(scalars[f'eval/{split}/num_tasks'])} tasks (T={config.eval.temperature}, "
          f"{config.model.name}, no training)", flush=True)
  print(f"metrics: {os.path.join(workdir, metrics_lib.JSONL_NAME)}", flush=True)
  return scalars


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from hgpo_jax import runtime
  runtime.pin_cpu_isa()
  runtime.enable_compilation_cache()
  evaluate_untrained(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
