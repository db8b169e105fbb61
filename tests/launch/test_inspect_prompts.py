"""`python -m launch.inspect_prompts`: what left truncation keeps of a config's prompts,
measured with the model's own tokenizer and chat template."""

from __future__ import annotations

import pytest

from env_servers.alfworld import env as env_lib
from env_servers.alfworld import mini
from hgpo_jax.models import gguf_file
from hgpo_jax.models import loading
from launch import inspect_prompts

_MINI_V4 = ["--config=configs/alfworld.py:model=tiny",
            "--config.env.args.data_dir=env_servers/alfworld/data/mini_v4",
            "--config.env.args.hide_actions=look,inventory,examine", "--config.env.max_steps=12",
            "--config.env.eval_splits=('valid_unseen',)"]


@pytest.fixture(scope="module")
def smollm2_stats():
  """SmolLM2's prompts of random play on the first 8 held-out mini_v4 games, at the `llm`
  suite's 400 tokens and at the mini suite's 256."""
  tokenizer = gguf_file.GGUFFile(loading.smollm2_gguf_path()).tokenizer()
  env = env_lib.AlfworldEnv(data_dir=mini.suite_dir("mini_v4"), max_steps=12,
                            hide_actions="look,inventory,examine")
  try:
    ids = env.task_ids("valid_unseen")[:8]
    return {n: inspect_prompts.random_play_prompts(env, "alfworld", tokenizer, ids, max_steps=12,
                                                   history_length=2, max_tokens=n, keep_longest=1)
            for n in (400, 256)}
  finally:
    env.close()


def test_the_llm_suites_prompt_budget_keeps_every_prompt_whole(smollm2_stats):
  whole, cut = smollm2_stats[400], smollm2_stats[256]
  assert whole.lengths == cut.lengths and len(whole.lengths) >= 8  # the same play
  assert max(whole.lengths) <= 400 and whole.cut == whole.task_lost == whole.action_lost == 0
  # at 256 tokens the left-truncated prompt loses the task sentence, keeps the actions
  assert cut.cut > 0 and 0 < cut.task_lost <= cut.cut and cut.action_lost == 0
  (length, text), = whole.longest
  assert length == max(whole.lengths) and "Your task is to:" in text
  (_, kept), = cut.longest
  assert len(kept) < len(text) and "Your admissible actions" in kept


def test_report_counts_and_percentiles():
  stats = inspect_prompts.PromptStats(lengths=(10, 20, 30, 40), cut=2, task_lost=1,
                                      action_lost=0, longest=((40, "kept text"),))
  text = inspect_prompts.report(stats, 25)
  assert text.splitlines()[:2] == [
      "4 prompts: mean 25.0, p50 30, p95 40, max 40 tokens",
      "at max_prompt_tokens=25: 2 cut (50.0 %), 1 without the task sentence, 0 missing an "
      "admissible action"]
  assert text.endswith("--- a prompt of 40 tokens, as kept (25):\nkept text")


def test_cli_reports_and_refuses_bad_input_in_one_line(capsys):
  assert inspect_prompts.main([*_MINI_V4, "--tasks", "2"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[0] == "alfworld valid_unseen, tiny, H=2, uniform-random play, 2 tasks"
  assert out[1].endswith(" tokens") and out[2].startswith("at max_prompt_tokens=4096: 0 cut")
  assert inspect_prompts.main([*_MINI_V4, "--split", "test"]) == 2
  err = capsys.readouterr().err
  assert err == ("launch.inspect_prompts: error: --split 'test': the env has splits "
                 "['train', 'valid_seen', 'valid_unseen']\n")
  assert inspect_prompts.main(["--config=configs/alfworld.py:model=tiny",
                               "--config.rollout.nope=1"]) == 2
  assert capsys.readouterr().err.count("\n") == 1


def test_choices_count_forced_tokens_and_the_mass_on_the_allowed_ones(capsys):
  """`--choices` on the tiny model: every played action's tokens are counted once, forced
  or with a choice (`</action>` is forced), and each
  choice's probability mass lies in (0, 1]."""
  model, tokenizer, _ = loading.load_model("tiny")
  env = env_lib.AlfworldEnv(data_dir=mini.suite_dir("mini_v4"), max_steps=3,
                            hide_actions="look,inventory,examine")
  try:
    steps = list(inspect_prompts.random_play_steps(env, "alfworld", tokenizer,
                                                   env.task_ids("valid_unseen")[:2],
                                                   max_steps=3, history_length=2))
  finally:
    env.close()
  stats = inspect_prompts.constraint_choices(model, tokenizer, steps, max_tokens=256)
  tokens = sum(len(tokenizer.encode(f"<action>{a}</action>")) for *_, a in steps)
  assert stats.forced + len(stats.mass) == tokens
  assert stats.forced >= len(steps)  # at least the closing tag's tokens
  assert stats.mass and all(0.0 < m <= 1.0 + 1e-6 for m in stats.mass)
  assert inspect_prompts.main([*_MINI_V4, "--tasks", "1", "--choices"]) == 0
  last = capsys.readouterr().out.splitlines()[-1]
  assert last.startswith("constraint: ") and " forced (" in last and "p50" in last
