r"""Evaluation without training: a prompted model, or a trained checkpoint, on the held-out
splits of a config.

  python -m launch.evaluate --config=configs/alfworld.py:model=smollm2-135m \
      --workdir=/tmp/eval_smollm2 [--config.env.args.data_dir=...]
  python -m launch.evaluate --config=configs/alfworld.py:algo=hgpo,model=smollm2-135m \
      --checkpoint=/tmp/run [--step=N] --workdir=/tmp/eval_run

The trainer (`hgpo_jax.train.train_and_evaluate`) rejects `train.num_iterations=0`, so
the prompting baselines of the results tables (an untrained model, e.g. SmolLM2-135M-
Instruct with constrained decoding, like the papers' prompting rows) run here: the
trainer's set-up (`hgpo_jax.training.run.build(config, workdir, train=False)`: model
loading, env servers, task splits) and its final evaluation
(`hgpo_jax.training.evaluation`: one trajectory per task at `config.eval.temperature`,
the eval random stream of `config.seed`), with no update. Without `--checkpoint` it
evaluates the named model's weights (a preset's bundled or random ones, or
`--config.model.path`'s, e.g. a `launch.export` directory) and writes one line to
`<workdir>/metrics.jsonl` with `step` 0 and the trainer's `eval/<split>/<metric>` keys,
so `launch.experiments.sweep` reads it like a training run's final evaluation.

`--checkpoint=W` (a training workdir, or its checkpoints/ directory) evaluates the policy
of W's latest checkpoint step, or of `--step=N`: the first line names the checkpoint
directory and step; the parameters are restored onto the config's model (read onto its
shardings, `checkpoint.read_params`; a checkpoint of another architecture is a one-line
error), and the evaluation uses the eval key of iteration N, the key the trainer uses for
the evaluations after N iterations, so with the run's config the last checkpoint gives
the trainer's final evaluation. The metrics line has `step` N. `--config.checkpoint.*` is
not read (it is the trainer's resume and retention).

Bad input ends it with one line, `launch.evaluate: error: ...`, and exit code 2, as the
trainer's entry point does (`launch.main.run_guarded`). With `--config.rollout.dump=true`
the evaluated steps (prompt and response tokens, action, observation, reward) go to
`<workdir>/rollouts/eval_<split>_<step:06d>.jsonl`, to see what the model did.
"""

from __future__ import annotations

import functools
import os

from absl import app
from absl import flags

# The trainer's entry point owns the shared flags (--config, --workdir, ...): one
# definition, so both entry points can be imported into one process (tests, the API
# reference).
from launch import main as main_lib

EVAL_STEP = 0  # the `step` of the single metrics line of an untrained model

CHECKPOINT = flags.DEFINE_string(
    "checkpoint", None, "Evaluate the policy of this training workdir's checkpoint (or of "
    "a checkpoints/ directory) instead of the config's initial weights.")
STEP = flags.DEFINE_integer("step", None, "With --checkpoint: the step to evaluate "
                            "(default: the latest).")


def evaluate_untrained(config, workdir: str) -> dict[str, float]:
  """Evaluates the config's initial model on `config.env.eval_splits`; writes metrics.
  `config`: a ConfigDict or its `experiment.Experiment`."""
  return _evaluate(config, workdir)


def evaluate_checkpoint(config, workdir: str, checkpoint: str,
                        step: int | None = None) -> dict[str, float]:
  """Evaluates the policy of `checkpoint`'s step `step` (default: latest) on the config's
  eval splits, as the trainer evaluates after that many iterations; writes metrics with
  `step` = the checkpoint step.

  Raises:
    CheckpointError: no such checkpoint or step, an unreadable step, or parameters of
      another architecture than the config's model.
  """
  from hgpo_jax.training import checkpoint as checkpoint_lib
  directory, step = checkpoint_lib.resolve_step(checkpoint, step)
  return _evaluate(config, workdir, (directory, step))


def restore_policy(model, directory: str, step: int) -> None:
  """Puts the policy params of checkpoint `step` in `directory` on `model` (the config's
  model, as `run.build` loads it), in its own shardings and dtypes; other shapes are
  another architecture (CheckpointError, one line). A LoRA run saved its adapters only:
  they go over the loaded (frozen) base."""
  import jax
  from flax import nnx

  from hgpo_jax.models import lora as lora_lib
  from hgpo_jax.training import checkpoint as checkpoint_lib

  params = nnx.state(model, nnx.Param)
  pure = nnx.to_pure_dict(params)
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        lora_lib.trainable_params(pure))
  restored = checkpoint_lib.read_params(directory, step, target=target)
  nnx.replace_by_pure_dict(params, lora_lib.with_frozen(restored.params, pure))
  nnx.update(model, params)


def _evaluate(config, workdir: str, checkpoint: tuple[str, int] | None = None) -> dict[str, float]:
  """The evaluation of both entries: the config's model, or its params from `checkpoint`
  (directory, step), on every eval split."""
  from hgpo_jax.training import evaluation
  from hgpo_jax.training import experiment
  from hgpo_jax.training import metrics as metrics_lib
  from hgpo_jax.training import run as run_lib

  exp = experiment.from_config(config)
  if not exp.env.eval_splits:
    raise experiment.ConfigError("config.env.eval_splits is empty: nothing to evaluate")
  run = run_lib.build(exp, workdir, train=False)
  try:
    if checkpoint is None:
      # The same key as the trainer's final evaluation (iteration = num_iterations).
      iteration, step, what = exp.train.num_iterations, EVAL_STEP, "no training"
    else:
      directory, step = checkpoint
      iteration, what = step, f"checkpoint step {step}"
      restore_policy(run.sampler.model, directory, step)
    out = evaluation.evaluate_splits(run, iteration, dump_step=step)
    scalars = run.writer.write(step, out)
  finally:
    run.close()
  for split in exp.env.eval_splits:
    repeats = f" x {exp.eval.repeats} evaluations" if exp.eval.repeats > 1 else ""
    print(f"eval {split:>13}: success {scalars[f'eval/{split}/success']:.3f} over "
          f"{int(scalars[f'eval/{split}/num_tasks'])} tasks{repeats} "
          f"(T={exp.eval.temperature}, {exp.model.name}, {what})", flush=True)
  print(f"metrics: {os.path.join(workdir, metrics_lib.JSONL_NAME)}", flush=True)
  return scalars


PROG = "launch.evaluate"


def _main(argv):
  checkpoint = None
  if CHECKPOINT.value:
    from hgpo_jax.training import checkpoint as checkpoint_lib
    # Named before anything else starts (no JAX backend is needed to find it).
    checkpoint = checkpoint_lib.resolve_step(CHECKPOINT.value, STEP.value)
    print(f"{PROG}: evaluating checkpoint step {checkpoint[1]} of {checkpoint[0]}", flush=True)
  elif STEP.value is not None:
    raise main_lib.BadInput("--step needs --checkpoint=WORKDIR (the run whose step to evaluate)")
  exp = main_lib.start(argv, PROG)
  if checkpoint is None:
    evaluate_untrained(exp, main_lib.WORKDIR.value)
  else:
    evaluate_checkpoint(exp, main_lib.WORKDIR.value, *checkpoint)


def main(argv):
  main_lib.run_guarded(_main, argv, PROG)


if __name__ == "__main__":
  app.run(main, flags_parser=functools.partial(main_lib.parse_flags, prog=PROG))
