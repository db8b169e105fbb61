"""`launch.evaluate --checkpoint`: a trained run's policy on the held-out splits, and an
export of it evaluated through `--config.model.path`.

One smoke run (text Sokoban, the tiny model, GRPO, 2 iterations, real env-server
subprocesses, evaluation dumps on) is the reference: its final evaluation used the eval
key of iteration 2 and the policy of checkpoint step 2, so evaluating that checkpoint
with the run's config must sample the very same tokens.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from configs import sokoban as sokoban_config
from hgpo_jax import train
from hgpo_jax.advantages import dump
from hgpo_jax.training import checkpoint
from hgpo_jax.training import evaluation
from hgpo_jax.training import experiment
from hgpo_jax.training import run_records
from launch import evaluate
from launch import export

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = "configs/sokoban.py:algo=grpo,model=tiny,smoke"
OVERRIDES = {"mesh.data": 1, "train.num_iterations": 2, "eval.num_tasks": 2,
             "rollout.dump": True, "train.lr": 1e-3}  # a large step: the policy moves


def _config(**more):
  c = sokoban_config.get_config(SPEC.partition(":")[2])
  with c.unlocked():
    c.update_from_flattened_dict({**OVERRIDES, **more})
  return c


def _responses(workdir: str, step: int) -> list[list[int]]:
  return [r["response"] for r in dump.read_rows(evaluation.eval_dump_path(workdir, "test", step))]


def _eval_line(workdir: str) -> dict:
  (line,) = run_records.read_metrics(workdir)
  return line


def _eval_metrics(line: dict) -> dict:
  return {k: v for k, v in line.items() if k.startswith("eval/")}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("run"))
  out = train.train_and_evaluate(experiment.from_config(_config()), workdir)
  return workdir, out["final_eval"]


@pytest.mark.slow
def test_checkpoint_evaluation_is_the_trainers_final_evaluation(trained, tmp_path, monkeypatch):
  run, final = trained
  evaluated = {}  # step -> the params of the model the evaluation sampled from
  real = evaluation.evaluate_splits

  def spy(r, iteration, **kw):
    evaluated[iteration] = jax.tree.map(np.asarray, nnx.to_pure_dict(
        nnx.state(r.sampler.model, nnx.Param)))
    return real(r, iteration, **kw)

  monkeypatch.setattr(evaluation, "evaluate_splits", spy)
  eval_dir = str(tmp_path / "eval")
  scalars = evaluate.evaluate_checkpoint(_config(), eval_dir, run)
  line = _eval_line(eval_dir)
  assert line["step"] == 2  # the step it evaluated
  assert _eval_metrics(line) == final and scalars == final
  # the same sampled tokens as the trainer's final evaluation of the same policy
  assert _responses(eval_dir, 2) == _responses(run, 2)
  # and the same per-task outcomes, which add up to the aggregate (the records the paired
  # intervals over games of launch.experiments.report read)
  trainer_tasks = run_records.read_task_results(run)[(2, "test")]
  assert run_records.read_task_results(eval_dir) == {(2, "test"): trainer_tasks}
  assert [r["index"] for r in trainer_tasks] == [0, 1]
  assert np.mean([r["won"] for r in trainer_tasks]) == final["eval/test/success"]
  assert np.mean([r["length"] for r in trainer_tasks]) == final["eval/test/episode_length"]
  assert len({r["task_id"] for r in trainer_tasks}) == 2
  # --step picks an earlier policy; each evaluation sampled from its step's params exactly
  evaluate.evaluate_checkpoint(_config(), str(tmp_path / "step1"), run, 1)
  assert _eval_line(str(tmp_path / "step1"))["step"] == 1
  for step in (1, 2):
    saved = checkpoint.read_params(run, step).params
    jax.tree.map(np.testing.assert_array_equal, evaluated[step], saved)
  moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), evaluated[1], evaluated[2])
  assert max(jax.tree.leaves(moved)) > 0  # the update changed the policy between the steps


@pytest.mark.slow
def test_cli_names_the_checkpoint_and_repeats_itself(trained, tmp_path):
  """The command line: its first line names checkpoint and step; a second evaluation of
  the same checkpoint writes the same numbers; an export of it evaluated as a model
  directory gives them too."""
  run, final = trained
  flags = [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  lines = []
  for i in range(2):
    workdir = str(tmp_path / f"cli{i}")
    proc = subprocess.run([sys.executable, "-m", "launch.evaluate", f"--config={SPEC}",
                           f"--checkpoint={run}", f"--workdir={workdir}", *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == (
        f"launch.evaluate: evaluating checkpoint step 2 of {run}/checkpoints")
    lines.append(_eval_line(workdir))
  assert lines[0] == lines[1] and lines[0]["step"] == 2
  assert _eval_metrics(lines[0]) == final
  # The export, evaluated as a Hugging Face directory (`--config.model.path`): the same
  # policy, so the same tokens (no checkpoint: the untrained entry's step 0).
  out = str(tmp_path / "hf")
  assert export.main(["--workdir", run, "--out", out]) == 0
  _assert_transformers_logits(out, checkpoint.read_params(run).params)
  hf_eval = str(tmp_path / "hf_eval")
  evaluate.evaluate_untrained(_config(**{"model.path": out}), hf_eval)
  assert _responses(hf_eval, evaluate.EVAL_STEP) == _responses(run, 2)


def _assert_transformers_logits(directory: str, params: dict) -> None:
  """transformers' logits of an export equal the project's of the checkpoint's params."""
  import torch
  import transformers
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import loading
  from hgpo_jax.models import tokenizer as tokenizer_lib
  tok = tokenizer_lib.tiny_tokenizer()
  ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "push the box"}]))
  tokens = np.asarray([ids], np.int32)
  model = loading.model_from_params(model_config.get_preset("tiny"), export.flat_params(params))
  want = np.asarray(model(tokens, np.arange(len(ids), dtype=np.int32)[None],
                          np.ones(tokens.shape, bool))[0])
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  with torch.no_grad():
    got = hf(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def _cli_error(tmp_path, *args) -> str:
  proc = subprocess.run([sys.executable, "-m", "launch.evaluate", f"--config={SPEC}",
                         f"--workdir={tmp_path}/w", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, check=False)
  lines = proc.stderr.strip().splitlines()
  assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
  assert lines[0].startswith("launch.evaluate: error: ")
  assert lines[0].endswith(" (--verbose prints the traceback)")
  return lines[0].removeprefix("launch.evaluate: error: ").removesuffix(
      " (--verbose prints the traceback)")


@pytest.mark.slow
def test_cli_bad_checkpoints_are_one_line_and_exit_2(trained, tmp_path):
  run, _ = trained
  assert _cli_error(tmp_path, f"--checkpoint={tmp_path}") == (
      f"{tmp_path} holds no checkpoint (no step folders in {tmp_path}/checkpoints or "
      f"{tmp_path}); pass the workdir of a run that saved one.")
  assert _cli_error(tmp_path, f"--checkpoint={run}", "--step=9") == (
      f"step 9 is not in {run}/checkpoints (steps on disk: [1, 2]); pass one of them.")
  assert _cli_error(tmp_path, "--step=1") == (
      "--step needs --checkpoint=WORKDIR (the run whose step to evaluate)")


@pytest.mark.slow
def test_other_architecture_and_corrupt_checkpoints_are_refused(trained, tmp_path):
  """After the model is loaded: parameters of another shape (a config whose model is not
  the checkpoint's) and a step whose files are gone, each one CheckpointError line."""
  import shutil
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import hf_export
  from hgpo_jax.models import loading
  from hgpo_jax.models import tokenizer as tokenizer_lib
  run, _ = trained
  deeper = model_config.get_preset("tiny").replace(num_layers=3)
  other = str(tmp_path / "deeper")
  os.makedirs(other)
  params = export.flat_params(nnx.to_pure_dict(nnx.state(loading.init_model(deeper), nnx.Param)))
  hf_export.write_model_dir(other, deeper, jax.tree.map(np.asarray, params),
                            tokenizer=tokenizer_lib.tiny_tokenizer())
  with pytest.raises(checkpoint.CheckpointError) as e:
    evaluate.evaluate_checkpoint(_config(**{"model.path": other}), str(tmp_path / "a"), run)
  assert str(e.value).startswith(f"checkpoint step 2 in {run}/checkpoints holds another "
                                 "architecture than the config's model: ")
  assert "evaluate it with the config (model) it was trained with." in str(e.value)
  copy = str(tmp_path / "copy")
  shutil.copytree(run, copy, ignore=shutil.ignore_patterns("tasks", "rollouts", "tensorboard"))
  for root, _, files in os.walk(os.path.join(copy, "checkpoints", "2", "state")):
    for f in files:
      open(os.path.join(root, f), "w").close()
  with pytest.raises(checkpoint.CheckpointError, match=r"checkpoint step 2 in .* is unreadable "
                     r"\(.*\); pass an older --step \(\[1\]\)\."):
    evaluate.evaluate_checkpoint(_config(), str(tmp_path / "b"), copy)


@pytest.mark.slow
def test_lora_checkpoint_goes_over_the_loaded_base(tmp_path):
  """A LoRA run saves its adapters only; the evaluation puts them over the base the config
  loads and samples the tokens of the run's final evaluation."""
  lora = {"model.lora.rank": 4, "train.lr": 1e-2}
  run = str(tmp_path / "run")
  final = train.train_and_evaluate(experiment.from_config(_config(**lora)), run)["final_eval"]
  saved = checkpoint.read_params(run).params
  assert saved["layers"] and "embed" not in saved  # adapters only
  eval_dir = str(tmp_path / "eval")
  assert evaluate.evaluate_checkpoint(_config(**lora), eval_dir, run) == final
  assert _responses(eval_dir, 2) == _responses(run, 2)


@pytest.mark.slow
def test_grouped_repeats_share_every_identical_prompt_on_a_trainers_sampler(
    trained, tmp_path, monkeypatch):
  """`eval.group_repeats` on a sampler that shares a group's first turn only (the
  trainer's `share_prefill=G`) plays through its `sharing_identical_prompts` view: every
  generate call shares all identical prompts, and the outcomes are those of the
  evaluation sampler's (`share_prefill=True`)."""
  from hgpo_jax.sampling import sampler as sampler_lib
  run, _ = trained
  grouped = dict(**{"eval.repeats": 2, "eval.group_repeats": True})
  plain = str(tmp_path / "plain")
  evaluate.evaluate_checkpoint(_config(**grouped), plain, run)
  real_settings, real_generate = sampler_lib.Sampler.from_settings, sampler_lib.Sampler.generate
  shares = []
  monkeypatch.setattr(sampler_lib.Sampler, "from_settings", classmethod(
      lambda cls, *a, **kw: real_settings(*a, **{**kw, "share_prefill": 2})))
  monkeypatch.setattr(sampler_lib.Sampler, "generate",
                      lambda self, *a, **kw: shares.append(self.share_prefill) or
                      real_generate(self, *a, **kw))
  trainer_like = str(tmp_path / "trainer_like")
  evaluate.evaluate_checkpoint(_config(**grouped), trainer_like, run)
  assert shares and set(shares) == {True}
  assert run_records.read_task_results(trainer_like) == run_records.read_task_results(plain)
  for r in range(2):
    paths = [evaluation.eval_dump_path(d, "test", 2, repeat=r) for d in (plain, trainer_like)]
    assert [x["response"] for x in dump.read_rows(paths[0])] == [
        x["response"] for x in dump.read_rows(paths[1])]
