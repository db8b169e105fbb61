r"""ALFWorld (generated ALFWorld-format games on the real alfworld/textworld engine).

Variants (argument string after the colon):
  algo=grpo|rloo|gigpo|hgpo|...   estimator (any name in the advantage registry)
  algo=ppo|hiper                   PPO with a critic (estimator gae) / HiPER (estimator hae)
  k=2                              HGPO depth K (also the memory window H, as the paper)
  model=tiny|smollm2-135m|qwen2.5-1.5b|qwen2.5-7b
  smoke                            seconds-scale run for tests (tiny model, 2 groups, 3 steps)
  local                            the SmolLM2 system check (benchmarks), sized for a 2-core CPU
  dynamic                          dynamic sampling and clip-higher: algo=gigpo verl-agent's
                                   gigpo_dynamic_trainer, algo=grpo its dapo_trainer
                                   (common.TRAIN_VARIANTS)
  gspo                             GSPO's sequence ratio and clips: algo=grpo verl-agent's
                                   gspo_trainer/run_alfworld.sh
  lora                             LoRA rank 64 as verl-agent's run_alfworld_lora.sh (common.apply_lora)

Paper setting (HGPO arXiv 2602.22817, Table 1; settings in docs/algorithms.md §12), e.g. Qwen2.5-1.5B-Instruct, K=2, on a pod:
  python -m launch.main --config=configs/alfworld.py:algo=hgpo,k=2,model=qwen2.5-1.5b \
      --config.model.path=/models/Qwen2.5-1.5B-Instruct --workdir=gs://bucket/hgpo_k2
  16 groups x 8 trajectories, 50 steps, lr 1e-6, mini-batch 256 rows, 160 iterations
  (HGPO's recipe; the other scripts 150), eval at temperature 0.4 every 5 iterations; each
  algorithm's values are its published script's (docs/algorithms.md "Paper settings").
  Expected (published, on the released ALFWorld games, 1.5B, K=2): 92.77 in-distribution /
  90.16 out-of-distribution
  success. Our games are *generated* ALFWorld-format games on ALFRED rooms, not the
  released split: numbers from this config are not comparable to the paper's.

PPO with a critic and HiPER (algo=ppo / algo=hiper): a separate critic initialised from
the policy (1 value head / 3: low, high, term), critic lr 1e-5, cliprange_value 0.5, no
env grouping (128 tasks x 1 trajectory per iteration), gamma = lambda = 1; HiPER adds the
switch/subgoal/action format, lambda_seg 0.95, keep penalty -0.3 (normalised by the
trajectory length), consistency penalty -0.3, bootstrap_truncated, mini-batch 256
(PPO too). On a pod:
  python -m launch.main --config=configs/alfworld.py:algo=hiper,model=qwen2.5-1.5b \
      --config.model.path=/models/Qwen2.5-1.5B-Instruct --workdir=gs://bucket/hiper
  Published ALFWorld success (all tasks, released games): PPO (with critic) 54.4 +- 3.1
  (1.5B) / 80.4 +- 2.7 (7B) (GiGPO arXiv 2505.10978, Table 1); HiPER 95.3 (1.5B) / 97.4
  (7B) (arXiv 2602.16165; JonP07/HiPER-agent README). Not comparable to our games.
  Smoke: python -m launch.main --config=configs/alfworld.py:algo=hiper,model=tiny,smoke --workdir=/tmp/x

The pretrained-LLM job (`make run-llm`), 2-core CPU: the quick version of the `llm_long`
suite (launch/experiments/suites.py: SmolLM2-135M-Instruct with LoRA rank 16 on the top 8
layers, ALFWorld-mini's 64-game train split, prompted vs GiGPO after 20 iterations, each
evaluated 8 times on the same 48 held-out games):
  make run-llm   # = python -m launch.experiments.sweep quick --suite llm_long
Its table and measured time: results/llm_long.md; the shorter `llm` suite's (7 iterations,
which do not beat the prompted base): results/llm.md. The `local` variant is the SmolLM2 system
check of the benchmarks (launch.benchmarks.smollm2_iteration, launch.benchmarks.lora):
2 steps per episode, so no episode succeeds and it measures the system, not learning.
"""

from __future__ import annotations

from configs import common


def get_config(arg: str | None = None):
  a = common.parse_arg(arg, algo="hgpo", k=2, model="smollm2-135m", smoke=False, local=False,
                       lora=False, dynamic=False, gspo=False)
  if a.model not in common.MODELS:
    raise ValueError(f"unknown model {a.model!r}; choose one of {common.MODELS}")
  c = common.base_config()
  c.model.name = a.model

  c.env.name = "alfworld"
  # data_dir: games in ALFWorld's folder layout (e.g. the official json_2.1.1) or a frozen
  # set (env_servers/alfworld/data/mini_v2); "" = the shipped generated set.
  # hide_actions: command prefixes left out of the admissible list (the CPU suite hides
  # "look,inventory,examine"; env_servers/alfworld/env.py); "" = ALFWorld's full list.
  c.env.args = common.ml_collections.ConfigDict({"data_dir": "", "hide_actions": ""})
  c.env.max_steps = 50
  c.env.train_split = "train"
  c.env.eval_splits = ("valid_seen", "valid_unseen")
  history = common.history_reference(a.k)  # H = HGPO K: one value (docs/algorithms.md §6)
  c.rollout.history_length = history
  c.rollout.fallback_chars = 30
  c.rollout.max_prompt_tokens = 4096  # per algorithm: common.SCRIPT_SETTINGS (HGPO 4096)

  c.algo.name = a.algo  # algo=ppo / algo=hiper: replaced by common.apply_critic_algo below
  # ALFWorld scripts use std normalisation for GiGPO and HGPO (docs/algorithms.md §12).
  c.algo.options = common.algo_options(a.algo, k=history, norm="mean_std")

  c.train.mini_batch_rows = 256  # the scripts' ppo_mini_batch_size
  c.train.micro_batch_rows = 16  # memory only; the loss unit is common.SCRIPT_SETTINGS's

  return common.finish(c, a, "alfworld")
