r"""WebShop-compatible shopping (the project's own catalog and goals; see env_servers/webshop).

Variants (argument string after the colon):
  algo=grpo|rloo|gigpo|hgpo|...   estimator (any name in the advantage registry)
  algo=ppo|hiper                   PPO with a critic (estimator gae) / HiPER (estimator hae)
  k=2                              HGPO depth K (also the memory window H)
  model=tiny|smollm2-135m|qwen2.5-1.5b|qwen2.5-7b
  horizon=0                        max env steps; 0 = the algorithm's script (15; HGPO 30,
                                   HiPER 50: common.SCRIPT_SETTINGS)
  smoke                            seconds-scale run for tests
  local                            sized for a 2-core CPU
  dynamic                          dynamic sampling and clip-higher (algo=gigpo / grpo:
                                   verl-agent's gigpo_dynamic / dapo scripts)
  gspo                             GSPO's sequence ratio and clips (common.TRAIN_VARIANTS)
  lora                             LoRA rank 64 as verl-agent's run_webshop_lora.sh (common.apply_lora)

Paper setting (docs/algorithms.md "Paper settings"): 16 x 8 trajectories, lr 1e-6, mini-batch
64 rows, mean-only normalisation for GiGPO and HGPO (GRPO keeps std), WebShop horizon 15
(GiGPO) or 30 (HGPO), e.g.
  python -m launch.main --config=configs/webshop.py:algo=hgpo,k=4,model=qwen2.5-1.5b \
      --config.model.path=/models/Qwen2.5-1.5B-Instruct --workdir=/tmp/ws_hgpo_k4
Published (real WebShop, 1.5B, K=4): HGPO 90.64 score / 78.12 success. The environment
here is WebShop-*compatible* (own generated catalog): numbers are not comparable.

PPO with a critic and HiPER (algo=ppo / algo=hiper): separate critic (critic lr 1e-5,
cliprange_value 0.5), 128 ungrouped tasks per iteration, gamma = lambda = 1; PPO mini-batch
64 rows; HiPER: keep penalty -3.5 normalised, consistency -0.3, bootstrap_truncated off,
lambda_seg 0.95, mini-batch 256, 50 turns. On a pod:
  python -m launch.main --config=configs/webshop.py:algo=ppo,model=qwen2.5-1.5b \
      --config.model.path=/models/Qwen2.5-1.5B-Instruct --workdir=/tmp/ws_ppo
Published (real WebShop): PPO (with critic) score / success 73.8 +- 3.0 / 51.5 +- 2.9 (1.5B),
81.4 +- 3.1 / 68.7 +- 5.1 (7B) (GiGPO arXiv 2505.10978, Table 1); HiPER success 71.4 (1.5B)
/ 83.3 (7B) (arXiv 2602.16165; JonP07/HiPER-agent README).
"""

from __future__ import annotations

from configs import common


def get_config(arg: str | None = None):
  a = common.parse_arg(arg, algo="hgpo", k=2, model="smollm2-135m", horizon=0,
                       smoke=False, local=False, lora=False, dynamic=False, gspo=False)
  if a.model not in common.MODELS:
    raise ValueError(f"unknown model {a.model!r}; choose one of {common.MODELS}")
  if a.horizon < 0:
    raise ValueError(f"horizon must be positive (or 0: the script's), got {a.horizon}")
  c = common.base_config()
  c.model.name = a.model

  c.env.name = "webshop"
  # A generated shop (`python -m env_servers.webshop.generate`) or WebShop's own data files;
  # "" = the shipped generated shop (docs/environments.md). search_actions: "template"
  # (WebShop's `search[<your query>]`, the policy writes its query) or "goal" (one listed
  # keyword search: the CPU suite's WebShop-mini, env_servers/webshop/env.py).
  c.env.args = common.ml_collections.ConfigDict(
      {"data_dir": "", "real_data_dir": "", "search_actions": "template"})
  c.env.max_steps = 15  # per algorithm: common.SCRIPT_SETTINGS; `horizon` overrides
  c.env.train_split = "train"
  c.env.eval_splits = ("test",)
  history = common.history_reference(a.k)  # H = HGPO K: one value (docs/algorithms.md §6)
  c.rollout.history_length = history
  c.rollout.fallback_chars = 20
  c.rollout.max_prompt_tokens = 4096

  c.algo.name = a.algo  # algo=ppo / algo=hiper: replaced by common.apply_critic_algo below
  # WebShop scripts use mean-only normalisation for GiGPO and HGPO (mode=mean_norm); GRPO
  # keeps the yaml's norm_adv_by_std_in_grpo=True (docs/algorithms.md §12).
  norm = "mean" if a.algo in ("gigpo", "hgpo") else "mean_std"
  c.algo.options = common.algo_options(a.algo, k=history, norm=norm)

  c.train.mini_batch_rows = 64  # the scripts' ppo_mini_batch_size (HiPER: 256)
  c.train.micro_batch_rows = 8  # memory only; the loss unit is common.SCRIPT_SETTINGS's

  horizon = {"env.max_steps": a.horizon} if a.horizon else {}
  return common.finish(c, a, "webshop", horizon)
