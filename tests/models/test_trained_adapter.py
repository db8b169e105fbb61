"""A LoRA run's policy leaves and scores the same: the adapter `launch.export
--lora-adapter` writes, loaded onto the same base in transformers + peft, picks the same
greedy constrained action as the project's sampler on every held-out ALFWorld-mini step
prompt of random play, and `launch.evaluate --checkpoint` of the run repeats its final
held-out evaluation game by game.

The run: GRPO with LoRA rank 4 on a random Qwen2-architecture checkpoint (transformers'
own files, the tiny tokenizer with a ChatML template), 2 iterations over real env-server
subprocesses, at a learning rate large enough that the adapters change greedy actions
(checked against the base alone).

Release tier (`make test-slow`, about 10 minutes on 2 cores): it re-proves, on a trained
run and a few hundred greedy actions, what tests/models/test_lora.py's
`test_export_of_a_lora_run_as_peft_adapter_and_merged_model` (the exported adapter's peft
logits) and tests/launch/test_evaluate_checkpoint.py (a checkpoint's evaluation repeats
the run's, game by game) prove on small inputs.
"""

from __future__ import annotations

import json
import os

import jax
import pytest

import model_fixtures
from configs import alfworld as alfworld_config
from env_servers.alfworld import env as env_lib
from env_servers.alfworld import mini
from hgpo_jax import train
from hgpo_jax.sampling import SamplingParams
from hgpo_jax.sampling import constrained
from hgpo_jax.training import checkpoint
from hgpo_jax.training import experiment
from hgpo_jax.training import run_records
from hgpo_jax.training import run as run_lib
from launch import evaluate
from launch import export
from launch import inspect_prompts

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DATA = "env_servers/alfworld/data/mini_v4"
HIDE = "look,inventory,examine"
MAX_PROMPT = 512


def _hf_dir(directory: str) -> str:
  cfg = model_fixtures.hf_config("qwen2")
  cfg.max_position_embeddings = 1024
  model_fixtures.write_hf_model(directory, cfg, seed=3)
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
               "chat_template": CHATML}, f)
  return directory


def _config(hf_dir: str):
  c = alfworld_config.get_config("algo=grpo,smoke")
  with c.unlocked():
    c.update_from_flattened_dict({
        "mesh.data": 1, "model.name": hf_dir, "model.lora.rank": 4, "model.lora.alpha": 8.0,
        "train.lr": 3e-2, "train.num_iterations": 2, "env.args.data_dir": DATA,
        "env.args.hide_actions": HIDE, "env.max_steps": 6, "rollout.max_new_tokens": 32,
        "rollout.max_prompt_tokens": MAX_PROMPT, "env.eval_splits": ("valid_unseen",),
        "eval.num_tasks": 4, "eval.at_end": True})
  return c


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("adapter")
  hf_dir = _hf_dir(str(root / "hf"))
  workdir = str(root / "run")
  out = train.train_and_evaluate(experiment.from_config(_config(hf_dir)), workdir)
  return hf_dir, workdir, out


def _held_out_steps(tokenizer, games: int):
  """(prompt ids, admissible actions) of every step of random play on the first `games`
  held-out games, as the rollout renders and truncates them."""
  env = env_lib.AlfworldEnv(data_dir=mini.suite_dir("mini_v4"), max_steps=12, hide_actions=HIDE)
  try:
    return [(ids[-MAX_PROMPT:], admissible) for _, ids, admissible, _ in
            inspect_prompts.random_play_steps(env, "alfworld", tokenizer,
                                              env.task_ids("valid_unseen")[:games],
                                              max_steps=12, history_length=2)]
  finally:
    env.close()


def _torch_greedy(model, prompt, sequences, eos_ids) -> int:
  """Readable greedy constrained decoding: at each token, of the ids that continue an
  allowed sequence (and EOS where the tokens so far are one that another continues), the
  one with the largest logit (the lowest id on a tie, as argmax); returns the index of the
  sequence written."""
  import torch
  out: list[int] = []
  while True:
    live = [s for s in sequences if s[:len(out)] == out]
    ids = {s[len(out)] for s in live if len(s) > len(out)}
    if out in sequences:
      if not ids:
        return sequences.index(out)
      ids |= set(eos_ids)
    with torch.no_grad():
      logits = model(torch.tensor([list(prompt) + out])).logits[0, -1].numpy()
    token = max(sorted(ids), key=lambda v: logits[v])
    if token in eos_ids:
      return sequences.index(out)
    out.append(token)


@pytest.mark.release
def test_exported_adapter_picks_the_samplers_greedy_actions(lora_run, tmp_path):
  import peft
  import transformers
  hf_dir, workdir, _ = lora_run
  adapter_dir = str(tmp_path / "adapter")
  assert export.main(["--workdir", workdir, "--out", adapter_dir, "--lora-adapter"]) == 0
  base = transformers.Qwen2ForCausalLM.from_pretrained(hf_dir).eval()
  base.config._attn_implementation = "eager"
  adapted = peft.PeftModel.from_pretrained(base, adapter_dir).eval()

  exp = experiment.from_config(_config(hf_dir))
  run = run_lib.build(exp, str(tmp_path / "eval"), train=False)
  try:
    directory, step = checkpoint.resolve_step(os.path.join(workdir, "checkpoints"), None)
    evaluate.restore_policy(run.sampler.model, directory, step)
    tokenizer = run.tokenizer
    steps = _held_out_steps(tokenizer, games=24)
    assert len(steps) >= 200
    greedy = SamplingParams(temperature=0.0, max_new_tokens=32)
    ours = []
    for start in range(0, len(steps), 32):
      chunk = steps[start:start + 32]
      out = run.sampler.generate([p for p, _ in chunk], greedy, jax.random.key(0),
                                 allowed=[a for _, a in chunk])
      ours += out.texts
  finally:
    run.close()
  theirs, base_only = [], []
  for prompt, admissible in steps:
    sequences = constrained.constrained_token_sequences(
        admissible, constrained.ActionConstraint(), tokenizer.encode)
    theirs.append(f"<action>{admissible[_torch_greedy(adapted, prompt, sequences, tokenizer.eos_ids)]}</action>")
    with adapted.disable_adapter():
      base_only.append(_torch_greedy(adapted, prompt, sequences, tokenizer.eos_ids))
  assert ours == theirs
  # the adapters matter: without them the base picks another action on some prompts
  changed = sum(t != f"<action>{a}</action>" for t, (_, adm), b in zip(theirs, steps, base_only)
                for a in [adm[b]])
  assert changed >= len(steps) // 20, changed


@pytest.mark.release
def test_checkpoint_evaluation_repeats_the_runs_final_evaluation(lora_run, tmp_path):
  hf_dir, workdir, out = lora_run
  final = out["final_eval"]
  again = evaluate.evaluate_checkpoint(_config(hf_dir), str(tmp_path),
                                       os.path.join(workdir, "checkpoints"))
  for key in ("eval/valid_unseen/success", "eval/valid_unseen/episode_length",
              "eval/valid_unseen/num_tasks"):
    assert again[key] == final[key], key
  games = lambda d: [{k: r[k] for k in ("split", "index", "task_id", "won", "return", "length")}
                     for records in run_records.read_task_results(d).values() for r in records]
  assert len(games(workdir)) == 4 and games(str(tmp_path)) == games(workdir)
