"""The trainer's side of the search env: verl-agent's search projection and prompt, the
memory of (retrieved information, action), the config, and (slow) two iterations of
`configs/search.py:smoke` over real env servers."""

import math

import numpy as np
import pytest

from configs import search as search_config
from hgpo_jax.rollout import projection
from hgpo_jax.rollout import prompts


@pytest.mark.parametrize("response,expected", [
    ("<think>x</think><search> Liorkexkuth Works </search>",
     ("<search>Liorkexkuth Works</search>", True)),
    ("<think>x</think><answer>Ruvin</answer>", ("<answer>Ruvin</answer>", True)),
    ("<SEARCH>Ruvin</SEARCH>", ("<search>Ruvin</search>", True)),  # case-insensitive tags
    ("<action><search>Kiostel</search></action>", ("<search>Kiostel</search>", True)),
    ("no tags at all", ("", False)),
    ("<search>unclosed", ("", False)),
    # both kinds: the search is sent, the response is invalid format
    ("<answer>Ruvin</answer><search>Ruvin</search>", ("<search>Ruvin</search>", False)),
    ("<search>a</search><search>b</search>", ("<search>a</search>", False)),
    ("<answer>a</answer> and <answer>b</answer>", ("<answer>a</answer>", False)),
    ("<search>a</search> then </answer>", ("<search>a</search>", True)),
])
def test_search_projection_follows_verl_agent(response, expected):
  assert projection.project_search_action(response) == expected


def test_search_prompt_is_verl_agents_template():
  memory = prompts.EpisodeMemory("Who founded Liorkexkuth Works?")
  first = prompts.render_prompt("search", memory, "ignored", [], history_length=4)
  assert first == (
      "\nYou are an expert agent tasked with answering the given question step-by-step.\n"
      "Your question: Who founded Liorkexkuth Works?\n\n"
      "Now it's your turn to respond for the current step.\n"
      "You should first conduct reasoning process. This process MUST be enclosed within "
      "<think> </think> tags. \n"
      "After completing your reasoning, choose only one of the following actions (do not "
      "perform both):\n"
      "(1) If you find you lack some knowledge, you can call a search engine to get more "
      "external information using format: <search> your query </search>.\n"
      "(2) If you have enough knowledge to answer the question confidently, provide your "
      "final answer within <answer> </answer> tags, without detailed illustrations. For "
      "example, <answer>Beijing</answer>.\n")
  result = type("R", (), {"observation": "<information>Doc 1(Title: A) a</information>"})()
  memory.add(prompts.memory_observation("search", "ignored", result), "<search>A</search>")
  memory.add(prompts.memory_observation("search", "ignored", type("R", (), {"observation": ""})()),
             "")
  step = prompts.render_prompt("search", memory, "ignored", [], history_length=4)
  assert ("Prior to this step, you have already taken 2 step(s). Below is the interaction "
          "history where <search> </search> wrapped your past search queries and <information> "
          "</information> wrapped the corresponding search results returned by the external "
          "search engine. History:\n"
          "Step 1:<search>A</search> <information>Doc 1(Title: A) a</information>\n\n"
          "Step 2: \n\n\nNow it's your turn") in step
  assert prompts.render_prompt("search", memory, "", [], history_length=1).count("Step ") == 1
  listed = prompts.render_prompt("search", memory, "", ["<search>A</search>", "<answer>b</answer>"],
                                 history_length=4)
  assert listed.endswith("Your admissible actions of the current situation are: "
                         "['<search>A</search>', '<answer>b</answer>'].\n")


RUN_SEARCH_SH = {  # verl-agent examples/gigpo_trainer/run_search.sh, value by value
    "rollout.num_groups": 256, "rollout.group_size": 5, "eval.num_tasks": 512,
    "rollout.max_prompt_tokens": 4096, "rollout.max_new_tokens": 512, "train.lr": 1e-6,
    "train.warmup_ratio": 0.1, "train.mini_batch_rows": 512, "train.loss_unit_rows": 16,
    "train.use_kl_loss": True, "train.kl_coef": 0.001, "train.kl_estimator": "k3",
    "train.entropy_coeff": 0.0, "rollout.invalid_penalty": 0.01, "train.kl_in_reward": False,
    "algo.gamma": 0.95, "algo.options.omega": 1.0, "algo.options.norm": "mean_std",
    "algo.options.enable_similarity": True, "algo.options.similarity_thresh": 0.9,
    "env.max_steps": 4, "rollout.history_length": 4, "eval.every": 50, "checkpoint.every": 50,
    "seed": 0, "critic.warmup_iterations": 0, "algo.name": "gigpo",
    "eval.temperature": 0.0,  # the yaml's greedy val_kwargs, which the script leaves
}


def test_config_variants():
  paper = search_config.get_config("model=qwen2.5-7b")
  flat = {}
  for key in RUN_SEARCH_SH:
    got = paper
    for part in key.split("."):
      got = got[part]
    flat[key] = got
  assert flat == RUN_SEARCH_SH
  assert (paper.env.args.topk, paper.env.args.actions, paper.rollout.constrained) == (
      3, "free", False)
  with pytest.raises(ValueError, match="algo=hiper has no search setting"):
    search_config.get_config("algo=hiper")
  smoke = search_config.get_config("smoke")
  assert (smoke.model.name, smoke.env.args.actions, smoke.rollout.constrained) == (
      "tiny", "listed", True)
  with pytest.raises(ValueError, match="unknown config argument"):
    search_config.get_config("horizon=3")


@pytest.mark.slow
def test_search_smoke_trains_over_env_servers(tmp_path):
  from hgpo_jax import train
  from hgpo_jax.training import experiment
  from hgpo_jax.training import run_records
  c = search_config.get_config("smoke")
  with c.unlocked():
    c.mesh.data = 1
  out = train.train_and_evaluate(experiment.from_config(c), str(tmp_path))
  lines = run_records.read_metrics(str(tmp_path))
  assert [l["step"] for l in lines][:2] == [1, 2]
  assert all(math.isfinite(l["train/loss"]) for l in lines[:2])
  # constrained to listed actions: every response is a well-formed search or answer
  assert all(l["rollout/invalid_rate"] == 0.0 for l in lines[:2])
  assert "eval/test/success" in out["final_eval"]


def test_gigpo_and_hgpo_groups_over_search_anchors():
  """Three trajectories of one question: two retrieve the same passages by differently
  worded queries and share every anchor group; the third retrieves others and leaves
  them after the first step (HGPO's context levels follow the same histories)."""
  from env_servers.search import env as search_env
  from hgpo_jax.advantages import grouping
  env = search_env.SearchEnv()
  plays = {"a": ["<search>Liorkexkuth Works</search>", "<search>Zethbaex Quimtirsiox</search>",
                 "<answer>Ruvin</answer>"],
           "b": ["<search>liorkexkuth works?</search>", "<search>Zethbaex  Quimtirsiox</search>",
                 "<answer>Kiostel</answer>"],
           "c": ["<search>Kiostel</search>", "<search>Zethbaex Quimtirsiox</search>",
                 "<answer>Ruvin</answer>"]}
  rows = []
  for traj, actions in plays.items():
    _, info = env.reset(options={"task_id": "test-0001"})
    for step, action in enumerate(actions):
      anchor = info["anchor_obs"]
      _, r, terminated, _, info = env.step(action)
      rows.append({"group": "test-0001", "traj": traj, "step": step, "anchor_obs": anchor,
                   "reward": r, "valid": True, "done": terminated})
  grouped = grouping.build_row_batch(rows, num_levels=2)
  anchor = grouped.rejoin(rows, grouped.batch.anchor_group)
  by = {(r["traj"], r["step"]): int(a) for r, a in zip(rows, anchor)}
  assert by["a", 0] == by["b", 0] == by["c", 0]  # the question alone
  assert by["a", 1] == by["b", 1] != by["c", 1]
  assert by["a", 2] == by["b", 2] != by["c", 2]
  assert len({by["a", 1], by["a", 2], by["c", 1], by["c", 2]}) == 4
  level1 = grouped.rejoin(rows, np.asarray(grouped.batch.context_group)[1])
  k1 = {(r["traj"], r["step"]): int(a) for r, a in zip(rows, level1)}
  assert k1["a", 2] == k1["b", 2] != k1["c", 2]
