r"""Evaluation without training: a prompted policy on the held-out splits of a config.

  python -m launch.evaluate --config=configs/alfworld.py:model=smollm2-135m \
      --workdir=/tmp/eval_smollm2 [--config.env.args.data_dir=...]

The trainer (`hgpo_jax.train.train_and_evaluate`) rejects `train.num_iterations=0`, so
the prompting baselines of the results tables (an untrained model, e.g. SmolLM2-135M-
Instruct with constrained decoding, like the papers' prompting rows) run here: the
trainer's set-up (`hgpo_jax.training.run.build(config, workdir, train=False)`: model
loading, env servers, task splits) and its final evaluation
(`hgpo_jax.training.evaluation`: one trajectory per task at `config.eval.temperature`,
the eval random stream of `config.seed`), with no update. It writes one line to
`<workdir>/metrics.jsonl` with `step` 0 and the trainer's `eval/<split>/<metric>` keys,
so `launch.sweep` reads it like a training run's final evaluation. It evaluates the named
model's initial weights (a preset's bundled or random ones, or `--config.model.path`'s);
`--config.checkpoint.*` is not read. Bad input ends it with one line,
`launch.evaluate: error: ...`, and exit code 2, as the trainer's entry point does
(`launch.main.run_guarded`). With `--config.rollout.dump=true` the evaluated steps (prompt and response tokens,
action, observation, reward) go to `<workdir>/rollouts/eval_<split>_000000.jsonl`, to see
what the model did.
"""

from __future__ import annotations

import functools
import os

from absl import app

# The trainer's entry point owns the flags (--config, --workdir, ...): one definition, so
# both entry points can be imported into one process (tests, the API reference).
from launch import main as main_lib

EVAL_STEP = 0  # the `step` of the single metrics line


def evaluate_untrained(config, workdir: str) -> dict[str, float]:
  """Evaluates the config's initial model on `config.env.eval_splits`; writes metrics."""
  from hgpo_jax.training import evaluation
  from hgpo_jax.training import metrics as metrics_lib
  from hgpo_jax.training import run as run_lib
  from hgpo_jax.training import run_config

  if not config.env.eval_splits:
    raise run_config.ConfigError("config.env.eval_splits is empty: nothing to evaluate")
  run = run_lib.build(config, workdir, train=False)
  try:
    # The same key as the trainer's final evaluation (iteration = num_iterations).
    out = evaluation.evaluate_splits(run, config.train.num_iterations, dump_step=EVAL_STEP)
    scalars = run.writer.write(EVAL_STEP, out)
  finally:
    run.close()
  for split in config.env.eval_splits:
    print(f"eval {split:>13}: success {scalars[f'eval/{split}/success']:.3f} over "
          f"{int(scalars[f'eval/{split}/num_tasks'])} tasks (T={config.eval.temperature}, "
          f"{config.model.name}, no training)", flush=True)
  print(f"metrics: {os.path.join(workdir, metrics_lib.JSONL_NAME)}", flush=True)
  return scalars


PROG = "launch.evaluate"


def _main(argv):
  config = main_lib.start(argv, PROG)
  evaluate_untrained(config, main_lib.WORKDIR.value)


def main(argv):
  main_lib.run_guarded(_main, argv, PROG)


if __name__ == "__main__":
  app.run(main, flags_parser=functools.partial(main_lib.parse_flags, prog=PROG))
