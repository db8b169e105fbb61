"""Shared pieces of the experiment configs: argument parsing and the base ConfigDict.

A config file `configs/<family>.py` defines `get_config(arg)` and returns a locked
ConfigDict, so that a mistyped `--config.a.b=value` override fails before any work
starts. Variants are selected by the argument string, e.g.
`configs/alfworld.py:algo=hgpo,k=2,model=smollm2-135m,smoke`.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
from typing import Sequence

import ml_collections  # re-exported for the config files

from hgpo_jax.advantages import registry

from hgpo_jax.models.config import PRESET_NAMES as MODELS  # noqa: F401  (re-exported)


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'a=1,b=x,flag' into a ConfigDict typed like `defaults` (big_vision style).

  A bare name sets a bool default to True; unknown keys and ill-typed values raise a
  one-line ValueError naming the key.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, eq, value = item.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"unknown config argument {key!r}; known: {sorted(defaults)}")
    kind = type(defaults[key])
    if not eq:
      if kind is not bool:
        raise ValueError(f"config argument {key!r} needs a value ({key}=...)")
      out[key] = True
    elif kind is bool:
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config argument {key}={value!r} is not a bool")
      out[key] = value.lower() in ("true", "1")
    else:
      try:
        out[key] = kind(value)
      except ValueError:
        raise ValueError(f"config argument {key}={value!r} is not a {kind.__name__}") from None
  return out


CRITIC_ALGOS = {"ppo": "gae", "hiper": "hae"}
"""Algorithm names of the configs that are not estimator names: PPO with a critic
(estimator `gae`) and HiPER (estimator `hae`)."""


def apply_critic_algo(c: ml_collections.ConfigDict, algo: str, env: str) -> None:
  """`algo=ppo` / `algo=hiper`: the published settings of the PPO and HiPER scripts.

  No env grouping (group_size 1; the paper setting plays 128 distinct tasks per
  iteration), critic lr 1e-5, cliprange_value 0.5. PPO: gamma = lambda = 1 (verl
  defaults), per-row GAE. HiPER: the switch/subgoal/action format, lambda_seg 0.95,
  gamma = lambda_turn = 1, keep and consistency penalties and bootstrap_truncated per
  environment. Mini-batches, loss units, turn limits: `SCRIPT_SETTINGS`.
  """
  from hgpo_jax.advantages import hae
  c.algo.name = CRITIC_ALGOS[algo]
  c.rollout.num_groups = 128
  c.rollout.group_size = 1
  eta = c.rollout.invalid_penalty
  if algo == "ppo":
    c.algo.options = estimator_options("gae", invalid_penalty=eta)
  else:
    c.rollout.response_format = "hiper"
    c.algo.options = estimator_options("hae", invalid_penalty=eta, **hae.PUBLISHED_SETTINGS[env])


def finish_critic_algo(c: ml_collections.ConfigDict, algo: str) -> None:
  """After the smoke/local variants of `algo=ppo|hiper`: no env grouping (the same
  number of trajectories, one per task) and, for HiPER's three blocks, room for
  `<switch>..</switch><subgoal>..</subgoal><action>..</action>` (about 90 tokens of the
  tiny byte-level tokenizer with a 12-token subgoal; 16 tokens cut every response
  inside the switch block)."""
  c.rollout.num_groups *= c.rollout.group_size
  c.rollout.group_size = 1
  if algo == "hiper":
    c.rollout.max_new_tokens = max(c.rollout.max_new_tokens, 128)


VERL_AGENT = "zzj1111/alfworldauto"
"""verl-agent as released with the HGPO recipe: examples/*_trainer/run_*.sh, the
recipe's recipe/hgpo/run_qwen2.5_1.5b_*_train.sh and verl/trainer/config/ppo_trainer.yaml."""
HIPER_AGENT = "JonP07/HiPER-agent"
"""HiPER's release: example_scripts/HiPER_trainer/run_*.sh and its verl fork."""

SCRIPTS = {
    ("alfworld", "grpo"): (VERL_AGENT, "examples/grpo_trainer/run_alfworld.sh"),
    ("alfworld", "rloo"): (VERL_AGENT, "examples/rloo_trainer/run_alfworld.sh"),
    ("alfworld", "gigpo"): (VERL_AGENT, "examples/gigpo_trainer/run_alfworld.sh"),
    ("alfworld", "hgpo"): (VERL_AGENT, "recipe/hgpo/run_qwen2.5_1.5b_alfworld_train.sh"),
    ("alfworld", "ppo"): (VERL_AGENT, "examples/ppo_trainer/run_alfworld.sh"),
    ("alfworld", "hiper"): (HIPER_AGENT, "example_scripts/HiPER_trainer/run_alfworld.sh"),
    ("webshop", "grpo"): (VERL_AGENT, "examples/grpo_trainer/run_webshop.sh"),
    ("webshop", "rloo"): (VERL_AGENT, "examples/rloo_trainer/run_webshop.sh"),
    ("webshop", "gigpo"): (VERL_AGENT, "examples/gigpo_trainer/run_webshop.sh"),
    ("webshop", "hgpo"): (VERL_AGENT, "recipe/hgpo/run_qwen2.5_1.5b_webshop_train.sh"),
    ("webshop", "ppo"): (VERL_AGENT, "examples/ppo_trainer/run_webshop.sh"),
    ("webshop", "hiper"): (HIPER_AGENT, "example_scripts/HiPER_trainer/run_webshop.sh"),
    ("search", "gigpo"): (VERL_AGENT, "examples/gigpo_trainer/run_search.sh"),
}
"""The published run script of each paper setting (environment, algo), as (repository, path).
HiPER-agent's own ppo_trainer/run_alfworld.sh agrees with verl-agent's on every value below
(4 GPUs x 16 rows per micro-batch); its run_webshop.sh is a 4-task debug run."""


def _settings(steps, prompt, mini, unit, iterations, eval_tasks, critic_unit=0, drop=0):
  return {"env.max_steps": steps, "rollout.max_prompt_tokens": prompt,
          "train.mini_batch_rows": mini, "train.loss_unit_rows": unit,
          "critic.loss_unit_rows": critic_unit or unit, "train.num_iterations": iterations,
          "eval.num_tasks": eval_tasks, "rollout.history_drop_chars": drop}


# The values that differ between the published scripts, per (environment, algo): turn
# limit, prompt tokens, mini-batch rows, loss unit rows (= the script's per-GPU micro-batch:
# verl token-averages each per-GPU micro-batch, then averages those means over gradient
# accumulation and GPUs), critic loss unit, iterations (total_epochs, one step each),
# evaluation tasks (val_data_size; GiGPO's and HGPO's WebShop scripts prepare 2x) and the
# WebShop history drop of the GiGPO-family and HiPER env managers (13,000 characters; the
# HGPO recipe's is commented out). Each value is checked against its script by
# tests/test_paper_settings.py.
SCRIPT_SETTINGS = {
    ("alfworld", "grpo"): _settings(50, 2048, 256, 32, 150, 128),
    ("alfworld", "rloo"): _settings(50, 2048, 256, 32, 150, 128),
    ("alfworld", "gigpo"): _settings(50, 2048, 256, 32, 150, 128),
    ("alfworld", "hgpo"): _settings(50, 4096, 256, 16, 160, 128),
    ("alfworld", "ppo"): _settings(50, 2048, 256, 16, 150, 128, critic_unit=16),
    ("alfworld", "hiper"): _settings(50, 2048, 256, 16, 150, 128, critic_unit=16),
    ("webshop", "grpo"): _settings(15, 4096, 64, 8, 150, 128, drop=13000),
    ("webshop", "rloo"): _settings(15, 4096, 64, 8, 150, 128, drop=13000),
    ("webshop", "gigpo"): _settings(15, 4096, 64, 8, 150, 256, drop=13000),
    ("webshop", "hgpo"): _settings(30, 4096, 64, 4, 160, 256),
    ("webshop", "ppo"): _settings(15, 4096, 64, 8, 150, 128, critic_unit=4, drop=13000),
    ("webshop", "hiper"): _settings(50, 2048, 256, 16, 150, 128, critic_unit=16, drop=13000),
    # one epoch of Search-R1's train set: configs/search.py
    ("search", "gigpo"): _settings(4, 4096, 512, 16, 662, 512),
}


def apply_script_settings(c: ml_collections.ConfigDict, algo: str, env: str) -> None:
  """`SCRIPT_SETTINGS` of (env, algo), if a published script exists for it (Sokoban and
  estimators without a script keep the family's values)."""
  c.update_from_flattened_dict(SCRIPT_SETTINGS.get((env, algo), {}))


def algo_options(algo: str, *, k, norm: str) -> ml_collections.ConfigDict:
  """`family_options` of the config's `algo` (for `algo=ppo|hiper`, of its estimator;
  `apply_critic_algo` then sets the published options)."""
  return family_options(CRITIC_ALGOS.get(algo, algo), k=k, norm=norm)


def finish(c: ml_collections.ConfigDict, a: ml_collections.ConfigDict, env: str,
           overrides: dict | None = None) -> ml_collections.ConfigDict:
  """The variants every environment family shares, in their one order, then `lock`:
  the published script's settings (`SCRIPT_SETTINGS`), the family's own variant
  `overrides` (flattened keys, e.g. WebShop's `horizon`), `algo=ppo|hiper` (published
  settings), `local`, `smoke`, and last the critic algorithms' no-grouping rule over
  what the size variants set."""
  apply_script_settings(c, a.algo, env)
  c.update_from_flattened_dict(overrides or {})
  if a.algo in CRITIC_ALGOS:
    apply_critic_algo(c, a.algo, env)
  if a.get("lora", False):
    apply_lora(c)
  apply_train_variants(c, a, env)
  if a.get("local", False):
    apply_local(c)
  if a.smoke:
    apply_smoke(c)
  if a.algo in CRITIC_ALGOS:
    finish_critic_algo(c, a.algo)
  c.lock()
  return c


def estimator_options(name: str, **overrides) -> ml_collections.ConfigDict:
  """The estimator's options with their published defaults, read from the registry.

  The option names come from the estimator's options dataclass, so the config never
  keeps a second list of names; `overrides` must name real options (else a one-line
  ValueError naming the valid ones). A value may be a `FieldReference` shared with
  another field (HGPO's `k` with `rollout.history_length`).
  """
  est = registry.get(name)
  opts = {f.name: getattr(est.options_cls(), f.name) for f in dataclasses.fields(est.options_cls)}
  unknown = sorted(set(overrides) - set(opts))
  if unknown:
    raise ValueError(f"estimator {name!r} has no option {', '.join(unknown)}; its options: "
                     f"{', '.join(sorted(opts))}")
  opts.update(overrides)
  return ml_collections.ConfigDict(opts)


def family_options(name: str, *, k, norm: str) -> ml_collections.ConfigDict:
  """`estimator_options` with an environment family's two settings, each passed only to
  the estimators that have it: HGPO's depth `k` (the caller passes the FieldReference of
  `rollout.history_length`, so the two cannot split) and the advantage normalisation
  `norm` of GRPO, GiGPO and HGPO (docs/algorithms.md §12)."""
  fields = {f.name for f in dataclasses.fields(registry.get(name).options_cls)}
  return estimator_options(name, **{key: value for key, value in (("k", k), ("norm", norm))
                                    if key in fields})


def history_reference(k: int) -> ml_collections.FieldReference:
  """The memory window H as a FieldReference shared by `rollout.history_length` and HGPO's
  `algo.options.k`: the paper and the released HGPO scripts set K = H (docs/algorithms.md
  §6), so an override of either field sets both."""
  return ml_collections.FieldReference(k, field_type=int)


def base_config() -> ml_collections.ConfigDict:
  """Fields shared by every environment family, one comment each (what, unit, where the
  default comes from; "paper" = GiGPO arXiv:2505.10978 App. E.1 and the HGPO paper's
  settings, "verl" = verl/verl-agent defaults; docs/algorithms.md §9, §10, §12)."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # split into model / sampler / task / env streams (docs/reproducibility.md)
  # run on CPUs what cannot be meant for them (a 1.5B/7B preset with weights, a mesh larger
  # than the devices, --distributed); else launch.main refuses (experiment.cpu_refusal)
  c.allow_cpu = False

  c.model = ml_collections.ConfigDict()
  c.model.name = "smollm2-135m"  # one of MODELS (hgpo_jax/models/config.py presets)
  c.model.path = ""  # local HF directory or .gguf for the presets that need one; "" = bundled
  c.model.dtype = "float32"  # parameters (and optimizer state): float32 | bfloat16
  c.model.compute_dtype = "auto"  # activations and matmul inputs: auto (bfloat16 on TPU/GPU,
  #   the papers' mixed precision: verl's FSDP param_dtype and rollout dtype; model.dtype on
  #   CPU) | "" (= model.dtype) | float32 | bfloat16 (over float32 parameters: products in
  #   bf16 summed in f32, f32 weights, gradients and optimizer)
  c.model.remat = True  # recompute activations in the backward pass (memory / ~30% compute)
  c.model.attn_query_chunk = 0  # >0: causal block skipping in chunks of this many queries
  c.model.attention_impl = "auto"  # auto (by the mesh's platform: TPU splash, GPU cudnn, CPU
  #   xla below 4096 tokens, chunked from there) | xla | chunked | splash | cudnn
  #   (hgpo_jax/models/attention.py)
  c.model.decode_attention_impl = "auto"  # sampler decode steps over the KV cache: auto (xla
  #   on every platform until the kernels are measured on a chip) | xla | pallas_gpu |
  #   pallas_tpu (read only each row's valid slots; hgpo_jax/models/decode_kernels.py)
  c.model.enable_thinking = False  # chat templates' thinking switch (Qwen3): False closes an
  #   empty <think></think> block after the assistant tag, so the agent answers directly
  # LoRA (hgpo_jax/models/lora.py): adapters over the frozen base, which is then stored in
  # the compute dtype; the optimizer and checkpoints hold the adapters only, and the KL
  # reference is the base with the adapters off (no copy)
  c.model.lora = ml_collections.ConfigDict()
  c.model.lora.rank = 0  # r; 0: full fine-tuning
  c.model.lora.alpha = 16.0  # the scale's numerator: alpha / r (verl's lora_alpha default)
  c.model.lora.rslora = False  # scale alpha / sqrt(r) instead (PEFT use_rslora)
  c.model.lora.top_layers = 0  # adapters on the last N layers only, the rest frozen whole
  #   (PEFT layers_to_transform; the update's backward stops at them); 0: every layer
  c.model.lora.targets = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # PEFT
  #   module names
  c.model.lora.path = ""  # start from this PEFT adapter directory (its adapter_config.json
  #   sets rank, alpha, targets; model.lora.rank 0 or equal to its r)
  c.model.adapted_layers = "scan"  # the update's loop over the adapted layers: scan |
  #   unrolled (a Python loop: no stacked residuals in the backward; ~1.2x faster SmolLM2
  #   top-8 update on an AMX CPU, one compiled block per adapted layer; needs lora.rank > 0)

  c.env = ml_collections.ConfigDict()
  c.env.name = ""  # env server name (env_servers/registry.py)
  c.env.args = ml_collections.ConfigDict()  # constructor args of the env on the server
  c.env.endpoints = ()  # host:port of running servers; empty = start local servers
  c.env.token_file = ""  # file with the endpoints' shared secret (serve --token-file)
  c.env.tls_root_cert = ""  # PEM root certificate of endpoints serving TLS; "" = plaintext
  c.env.num_servers = 2  # local server processes when no endpoints are given
  c.env.deadline_s = 120.0  # per-call deadline of Reset/Step, seconds
  c.env.train_split = "train"  # task split of the training rollouts
  c.env.eval_splits = ("valid_seen", "valid_unseen")  # splits of the periodic/final evaluation
  c.env.max_steps = 50  # episode horizon T_max, env steps (paper: ALFWorld 50)
  c.env.step_latency_ms = 0.0  # delay of every Step call of the servers started here (a
  #   remote env's latency; launch.benchmarks.async_rollout); 0 = none

  c.rollout = ml_collections.ConfigDict()
  c.rollout.num_groups = 16  # G tasks per iteration, global over processes (paper: 16)
  c.rollout.group_size = 8  # N trajectories per task, same env seed (paper: 8)
  c.rollout.history_length = 2  # memory window H, (obs, action) pairs (HGPO: equal to K)
  c.rollout.temperature = 1.0  # sampling temperature of training rollouts (paper: 1.0)
  c.rollout.top_p = 1.0  # nucleus sampling; 1.0 = off (verl default)
  c.rollout.top_k = 0  # top-k sampling; 0 = off (verl default)
  c.rollout.kv_cache_dtype = "auto"  # sampler KV cache: auto (bfloat16 on TPU/GPU, the compute
  #   dtype on CPU) | "" (the compute dtype) | float32 | bfloat16
  c.rollout.prefill_chunk_rows = 0  # sampler prefill loop: rows per step (a multiple of the
  #   sampler mesh's batch-parallel size); 0 = all rows at once
  c.rollout.decode_slots = 0  # continuous batching: KV-cache rows a larger sampler call decodes
  #   in (finished rows free their slot for the next row); 0 = all rows in lockstep
  c.rollout.share_prefill = True  # the first turn's prompts prefilled once per group (the
  #   generate_shared program); false: every row prefilled (same tokens, less memory)
  c.rollout.decode_chunk_steps = 0  # lockstep decode steps per device-loop iteration (the
  #   all-finished test once per chunk; same tokens); 0 = by platform (16 on GPU, 1 elsewhere)
  c.rollout.decode_layers = "auto"  # how a decode step reads the layers: auto (per-layer
  #   weight arrays on GPU/TPU, a scan over stacked layers on CPU) | per_layer (per-layer
  #   arrays everywhere, on CPU also the cache; decode weights made once per weight version)
  c.rollout.jump_forward = 0  # constrained decoding: up to K tokens the trie forces fed in
  #   one decode step (lockstep only; samples equal up to round-off); 0 = one per step
  c.rollout.max_trie_nodes = 0  # constrained decoding: trie nodes per row, fixed (program
  #   shapes from the config); 0 = sized per call
  c.rollout.precompile = False  # compile every sampler program (all buckets) before iteration 1
  c.rollout.max_candidates = 256  # top-k/top-p candidates per row (lax.top_k); wider sorts
  c.rollout.max_new_tokens = 512  # most tokens per response (paper: 512)
  c.rollout.max_prompt_tokens = 2048  # tokens; longer prompts are truncated on the left
  c.rollout.constrained = False  # restrict actions to the admissible set (small models)
  c.rollout.invalid_penalty = 0.1  # eta, reward units (docs/algorithms.md §1; scripts: 0.1)
  c.rollout.fallback_chars = 30  # projection fallback, characters (ALFWorld 30, WebShop 20)
  c.rollout.dump = False  # write every rollout and evaluation as JSONL (advantage-tool format)
  c.rollout.response_format = "react"  # "react" (<think>/<action>) | "hiper" (switch/subgoal/action)
  c.rollout.free_query_tokens = 8  # constrained: cap of a free WebShop search query, tokens
  c.rollout.subgoal_tokens = 12  # constrained "hiper": cap of a free subgoal, tokens
  c.rollout.format_instructions = True  # False drops the format instructions (constrained or "hiper")
  c.rollout.history_drop_chars = 0  # >0: WebShop prompts over this many chars lose their history

  c.algo = ml_collections.ConfigDict()
  c.algo.name = "hgpo"  # a registered estimator: hgpo_jax.advantages.registry.names()
  c.algo.gamma = 0.95  # discount of step returns R_t (GiGPO Eq. 5: 0.95)
  c.algo.options = ml_collections.ConfigDict()  # filled from the registry per variant

  c.train = ml_collections.ConfigDict()
  c.train.num_iterations = 150  # policy iterations (scripts' total_epochs: 150; HGPO 160)
  c.train.lr = 1e-6  # actor AdamW learning rate, peak of lr_schedule (paper: 1e-6, constant)
  # learning rate per iteration (verl optim.warmup_style): constant | cosine (down to
  # min_lr_ratio * lr at the last iteration); warmup over warmup_steps iterations, or
  # warmup_ratio of them when warmup_steps < 0 (verl lr_warmup_steps / _ratio; docs §9.6)
  c.train.lr_schedule = "constant"
  c.train.warmup_steps = -1
  c.train.warmup_ratio = 0.0
  c.train.min_lr_ratio = 0.0
  c.train.weight_decay = 0.01  # decoupled AdamW weight decay (verl actor optim default)
  c.train.grad_clip = 1.0  # global-norm gradient clip (verl default)
  c.train.mini_batch_rows = 256  # rows (steps) per optimiser step (ALFWorld scripts: 256)
  c.train.micro_batch_rows = 16  # rows per forward/backward (gradient accumulation)
  # rows per token-mean loss unit: the loss is the mean over units of each unit's token
  # mean (verl: a per-GPU micro-batch); 0 = micro_batch_rows (docs/algorithms.md §9)
  c.train.loss_unit_rows = 0
  c.train.ppo_epochs = 1  # passes over the iteration's rows (verl default)
  # one optimizer step per iteration: log pi_old from the update's own forward pass (exact
  # in real arithmetic, one log-prob pass fewer); False = verl's separate pass always
  c.train.reuse_on_policy_logprobs = True
  # pack each mini-batch's steps end to end into fewer rows of the same length
  # (segment-masked attention, the same token-mean loss: hgpo_jax/training/packing.py);
  # critic-free, token-mean only. Off: it saves nothing when most steps fill over half
  # a row, as in the local SmolLM2 job (docs/performance.md, "Tried and rejected")
  c.train.pack_rows = False
  # length-grouped micro-batches: each mini-batch's steps sorted by length, each micro-batch
  # padded only to its longest step (rounded up to length_multiple tokens), one compiled
  # gradient program per row length; the same token-mean loss (hgpo_jax/training/packing.py);
  # critic-free, token-mean only; not with pack_rows
  c.train.group_by_length = False
  c.train.length_multiple = 128
  # leave out of the update the steps whose scored tokens all have advantage 0 (exact
  # zeros in the gradient when the loss has no KL or entropy term; with pack_rows or
  # group_by_length; hgpo_jax/training/packing.py): the same optimizer step, less time
  # when whole groups score alike; train/entropy then averages over the updated tokens
  c.train.skip_zero_advantage = False
  c.train.clip_ratio_low = 0.2  # PPO ratio clip 1 - eps_low (verl default)
  c.train.clip_ratio_high = 0.2  # PPO ratio clip 1 + eps_high (verl default)
  c.train.clip_ratio_c = 3.0  # dual-clip constant c > 1 (verl default)
  c.train.kl_coef = 0.01  # low_var_kl (k3) to the frozen reference (scripts: 0.01); 0: off
  c.train.use_kl_loss = True  # the KL loss (verl actor.use_kl_loss); off (or at kl_coef 0)
  #   with no KL in the reward either: no reference policy and no reference pass (the LoRA
  #   scripts)
  # the frozen reference's parameters: auto (bfloat16 when the compute is, as verl loads its
  # reference; else as the policy's) | "" (as the policy's) | float32 | bfloat16
  c.train.reference_dtype = "auto"
  # where the reference lives between its log-prob passes: device | host (pinned host
  # memory, copied onto the devices per pass; verl's ref.fsdp_config.param_offload=True)
  c.train.reference_memory = "device"
  c.train.entropy_coeff = 0.001  # entropy bonus weight (verl-agent yaml)
  c.train.loss_agg = "token-mean"  # token-loss reduction, losses.LOSS_AGG_MODES (scripts)
  c.train.policy_loss = "ppo"  # ppo (dual clip) | gspo (one ratio per step's response; §9.2)
  c.train.kl_estimator = "k3"  # KL loss estimator: k1 | abs | k2 | k3 (aliases kl, mse,
  #   low_var_kl; verl kl_loss_type, §9.3)
  # KL to the reference in the reward (verl algorithm.use_kl_in_reward, §9.4): each step's
  # reward loses kl_reward_coef * its response's summed kl_reward_estimator KL, the
  # coefficient fixed or adaptive (kl_target, kl_horizon; verl algorithm.kl_ctrl)
  c.train.kl_in_reward = False
  c.train.kl_reward_estimator = "k1"  # verl algorithm.kl_penalty default "kl"
  c.train.kl_reward_coef = 0.001  # verl algorithm.kl_ctrl.kl_coef
  c.train.kl_ctrl = "fixed"  # fixed | adaptive
  c.train.kl_target = 0.1
  c.train.kl_horizon = 10000
  # sampler/learner mismatch (verl rollout_correction, §9.5): importance weights
  # pi_old / pi_rollout per token or per step's response, truncated at the threshold;
  # rejection of tokens/responses outside [1/t, t]; the rollout_corr/* metrics are logged
  # whatever these are (a log-prob pass of their own when the update reuses its own)
  c.train.rollout_is = "none"  # none | token | sequence
  c.train.rollout_is_threshold = 2.0
  c.train.rollout_rs = "none"  # none | token | sequence
  c.train.rollout_rs_threshold = 2.0
  c.train.rollout_mismatch_metrics = True
  # constrained decoding: the learner scores the policy that acted, a log-softmax over the
  # tokens the constraint allowed at each response token (forced tokens leave the loss);
  # False: the model's full softmax, as verl (docs/algorithms.md §9.8)
  c.train.constrained_logprobs = False
  c.train.max_choices = 64  # most allowed tokens at one response token (static shape)
  # dynamic sampling (DAPO filter_groups, §9.7): drop groups whose trajectories all have
  # the same metric (score: return | success), play new groups until rollout.num_groups
  # varied ones exist or max_generation_batches were played; critic-free estimators only
  c.train.filter_groups = False
  c.train.filter_groups_metric = "score"
  c.train.max_generation_batches = 10  # verl-agent filter_groups.max_num_gen_batches
  # rollout ahead of the update (hgpo_jax/training/async_rollout.py, docs/algorithms.md
  # §9.9): 0 = rollout and update take turns; k > 0 = a thread plays iteration t's batch
  # with the weights after iteration t - 1 - k while the learner updates (1: verl's
  # one-step-off-policy); critic-free estimators; train.rollout_is=token is the lag's
  # importance correction (results/async_mini.md measures both on the tiny ALFWorld-mini
  # job); mesh.rollout_devices puts the sampler on devices of its own
  c.train.max_staleness = 0

  # Value model of critic-based estimators (algo=ppo -> gae, algo=hiper -> hae): a
  # separate copy of the policy's backbone with 1 (PPO) or 3 (HiPER) value heads; it
  # uses the actor's mini/micro-batch sizes (published scripts). Unused otherwise.
  c.critic = ml_collections.ConfigDict()
  c.critic.lr = 1e-5  # critic AdamW learning rate (PPO and HiPER scripts)
  c.critic.weight_decay = 0.01  # verl critic optim default
  c.critic.grad_clip = 1.0  # global-norm gradient clip (verl default)
  c.critic.cliprange_value = 0.5  # clipped value loss (PPO and HiPER scripts)
  c.critic.loss_scale = 1.0  # multiplier of the value loss (released compute_value_loss: 1)
  c.critic.loss_unit_rows = 0  # the critic's loss unit (its per-GPU micro-batch); 0 = micro
  c.critic.warmup_iterations = 0  # first iterations update only the critic (verl trainer.critic_warmup)
  c.critic.lr_schedule = "constant"  # the critic's own schedule, as train.lr_schedule's keys
  c.critic.warmup_steps = -1
  c.critic.warmup_ratio = 0.0
  c.critic.min_lr_ratio = 0.0

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1  # data-parallel devices; -1: all remaining devices
  c.mesh.fsdp = 1  # devices the parameters are sharded over (FSDP)
  c.mesh.tensor = 1  # tensor-parallel devices (attention heads, MLP)
  # Split placement: the sampler on the last rollout_devices devices of each process, a
  # mesh of its own (rollout_fsdp x rollout_tensor, data the rest); the training mesh is
  # the other devices and the weights move to the sampler after each update. 0: the
  # sampler shares the training devices (docs/scaling.md "Rollout ahead of the update").
  c.mesh.rollout_devices = 0
  c.mesh.rollout_fsdp = 1
  c.mesh.rollout_tensor = 1

  c.eval = ml_collections.ConfigDict()
  c.eval.every = 5  # iterations; 0 disables periodic evaluation
  c.eval.num_tasks = 128  # per split (the whole split if smaller)
  c.eval.temperature = 0.4  # sampling temperature of evaluation (paper: 0.4)
  # evaluations of every held-out task, each with its own evaluation key; the metrics
  # are their means and eval_tasks.jsonl keeps every outcome (`repeat`): at T=0.4 one
  # evaluation per game is mostly the sampling draw (results/llm_search.md), several
  # narrow a paired comparison game by game (python -m launch.experiments.paired_games)
  c.eval.repeats = 1
  # True: a task's repeats play as one group of trajectories in the same rollout calls
  # (their identical prompts prefilled once: about half of them at T=0.4 over 8 repeats);
  # other draws than separate passes; eval.repeats must divide the rollout's env slots
  c.eval.group_repeats = False
  c.eval.at_end = True  # evaluate once more after the last iteration

  c.checkpoint = ml_collections.ConfigDict()
  c.checkpoint.every = 1  # iterations between Orbax checkpoints (the last one always)
  c.checkpoint.keep = 3  # most recent checkpoints kept
  c.checkpoint.keep_period = 50  # steps kept forever (0: none)
  c.checkpoint.resume_from = ""  # explicit checkpoint directory (after the workdir's own)

  # Where each iteration's scalars go (hgpo_jax/training/metrics.py WRITERS); metrics.jsonl,
  # the run record, is always written. launch.evaluate writes metrics.jsonl only.
  c.metrics = ml_collections.ConfigDict()
  c.metrics.writers = ("tensorboard",)  # besides jsonl: tensorboard (<workdir>/tensorboard) |
  #   wandb (Weights & Biases, verl's trainer.logger; pip install wandb), e.g.
  #   --config.metrics.writers="('tensorboard','wandb')"
  c.metrics.wandb_project = ""  # W&B project; "" = wandb's default (WANDB_PROJECT)
  c.metrics.wandb_mode = "offline"  # online | offline (<workdir>/wandb; `wandb sync` uploads)
  #   | disabled

  c.profile = ml_collections.ConfigDict()
  c.profile.iterations = 0  # > 0: jax.profiler trace of this many iterations -> <workdir>/profile
  c.profile.skip = 1  # iterations of this run before the trace starts (the first compiles)
  return c


# The two size variants, as `--config.a.b` overrides (flattened keys).
_LOCAL = {
    "env.num_servers": 1, "env.max_steps": 2,
    "rollout.num_groups": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 32,
    "rollout.max_prompt_tokens": 640, "rollout.constrained": True,
    "train.num_iterations": 2, "train.lr": 1e-5, "train.mini_batch_rows": 16,
    "train.micro_batch_rows": 4, "eval.every": 0, "eval.num_tasks": 8,
    # the loss averages micro-batches of 4 (this job's numbers before loss units existed)
    "train.loss_unit_rows": 0, "critic.loss_unit_rows": 0,
    # causal block skipping; f32 compute (bf16 is opt-in: apply_local docstring)
    "model.attn_query_chunk": 256,
    # micro-batches of 4 steps padded to their own longest step, rounded up to 64 tokens
    # (docs/performance.md: 64 instead of 128 fills 0.91-0.93 of the slots, not 0.85-0.87)
    "train.group_by_length": True, "train.length_multiple": 64,
}
_SMOKE = {
    "env.num_servers": 1, "env.max_steps": 3,
    "rollout.num_groups": 2, "rollout.group_size": 2, "rollout.max_new_tokens": 16,
    "rollout.max_prompt_tokens": 512, "rollout.constrained": True,
    "train.num_iterations": 2, "train.lr": 1e-4, "train.mini_batch_rows": 8,
    "train.micro_batch_rows": 4, "eval.every": 0, "eval.num_tasks": 2,
    "train.loss_unit_rows": 0, "critic.loss_unit_rows": 0,
}


LORA_SCRIPTS = {
    "alfworld": (VERL_AGENT, "examples/gigpo_trainer/run_alfworld_lora.sh"),
    "webshop": (VERL_AGENT, "examples/gigpo_trainer/run_webshop_lora.sh"),
}
"""verl-agent's LoRA runs (GiGPO, Qwen2.5-7B-Instruct), the source of `apply_lora`."""

LORA_SETTINGS = {
    "model.lora.rank": 64, "model.lora.alpha": 64.0, "train.lr": 3e-6,
    # no KL loss: no reference pass at all (its coefficient is the yaml's, unused)
    "train.use_kl_loss": False, "train.kl_coef": 0.001,
}


def apply_lora(c: ml_collections.ConfigDict) -> None:
  """The `lora` variant: the settings verl-agent's LoRA scripts (`LORA_SCRIPTS`) change
  from their full fine-tuning ones: adapters of rank 64 and alpha 64 on every projection
  (verl's `target_modules: all-linear`), lr 3e-6, no KL loss. The scripts train
  Qwen2.5-7B-Instruct (`model=qwen2.5-7b`); the rest is the `algo=` script's (GiGPO's
  batch sizes equal the LoRA scripts'). Checked value by value by
  tests/test_paper_settings.py."""
  c.update_from_flattened_dict(LORA_SETTINGS)


TRAIN_VARIANT_SCRIPTS = {
    ("alfworld", "gigpo", "dynamic"): (VERL_AGENT, "examples/gigpo_dynamic_trainer/run_alfworld.sh"),
    ("webshop", "gigpo", "dynamic"): (VERL_AGENT, "examples/gigpo_dynamic_trainer/run_webshop.sh"),
    ("sokoban", "gigpo", "dynamic"): (VERL_AGENT, "examples/gigpo_dynamic_trainer/run_sokoban.sh"),
    ("alfworld", "grpo", "dynamic"): (VERL_AGENT, "examples/dapo_trainer/run_alfworld.sh"),
    ("webshop", "grpo", "dynamic"): (VERL_AGENT, "examples/dapo_trainer/run_webshop.sh"),
    ("alfworld", "grpo", "gspo"): (VERL_AGENT, "examples/gspo_trainer/run_alfworld.sh"),
}
"""The published scripts of the training variants, (env, algo, variant) -> (repository,
path); each is its algo's script with the variant's values (`TRAIN_VARIANTS`)."""

TRAIN_VARIANTS = {
    # clip-higher and DAPO's dynamic sampling (algorithm.filter_groups)
    "dynamic": {"train.clip_ratio_low": 0.2, "train.clip_ratio_high": 0.28,
                "train.filter_groups": True, "train.max_generation_batches": 10},
    # actor.policy_loss.loss_mode=gspo with its clip ratios
    "gspo": {"train.policy_loss": "gspo", "train.clip_ratio_low": 3e-4,
             "train.clip_ratio_high": 4e-4},
}
"""The values a training variant (argument `dynamic` or `gspo`) sets: those its scripts
(`TRAIN_VARIANT_SCRIPTS`) change from their algo's script."""

TRAIN_VARIANT_SETTINGS = {
    ("webshop", "gigpo", "dynamic"): {"eval.num_tasks": 128},  # val_data_size, not 2x
    ("alfworld", "grpo", "gspo"): {"train.num_iterations": 200},  # total_epochs=200
}
"""Further values a variant's script changes for one (env, algo)."""


def apply_train_variants(c: ml_collections.ConfigDict, a: ml_collections.ConfigDict,
                         env: str) -> None:
  """The `dynamic` and `gspo` variants (`TRAIN_VARIANTS`, then `TRAIN_VARIANT_SETTINGS`);
  checked value by value against their scripts by tests/test_paper_settings.py."""
  for name, values in TRAIN_VARIANTS.items():
    if a.get(name, False):
      c.update_from_flattened_dict(values)
      c.update_from_flattened_dict(TRAIN_VARIANT_SETTINGS.get((env, a.algo, name), {}))


def apply_local(c: ml_collections.ConfigDict) -> None:
  """The `local` variant: the SmolLM2 system check of the benchmarks
  (`launch.benchmarks.smollm2_iteration`, `launch.benchmarks.lora`), sized for a 2-core CPU.

  2 groups x 4 trajectories, 2 steps, 2 iterations, evaluation on 8 held-out-room games.
  Decoding is constrained to `<action>{admissible action}</action>` because SmolLM2-135M
  does not follow the `<think>`/`<action>` format unconstrained (a 3-step version of
  this job with free 48-token responses: invalid-action rate 1.000 over 24 steps).
  Compute is float32 with causal block skipping in 256-query chunks and length-grouped
  micro-batches rounded to 64 tokens (both exact). bf16
  products (`--config.model.compute_dtype=bfloat16`) are opt-in: on a CPU with AVX512-BF16
  they halved the iteration, on the AVX2 reference machine they are slower than float32,
  and they change the training numbers (docs/performance.md). On the 2-core AVX2 machine
  an iteration takes ~110-130 s with the machine's load, 74-83 s of it the update of 16 rows
  of up to 672 tokens (`python -m launch.benchmarks.smollm2_iteration --baseline-rev 3c5ff63 --sides baseline,current,coarse`), which is what
  bounds the scale; with so
  short a horizon no episode succeeds, so the advantages are all zero and the job
  measures the system, not learning. The pretrained-model learning job is `make run-llm`
  (the `llm_long` suite of launch/experiments/suites.py).
  """
  c.env.eval_splits = tuple(c.env.eval_splits[-1:])  # the held-out split: unseen rooms
  c.update_from_flattened_dict(_LOCAL)


def apply_smoke(c: ml_collections.ConfigDict) -> None:
  """The `smoke` variant: seconds-scale runs for tests (tiny model unless one was named)."""
  if c.model.name == "smollm2-135m":
    c.model.name = "tiny"
  c.env.eval_splits = tuple(c.env.eval_splits[:1])
  c.update_from_flattened_dict(_SMOKE)


# ---------------------------------------------------------------------------------------
# Loading a config from the command line (every entry point: launch.main, launch.evaluate,
# launch.plan, launch.experiments)
# ---------------------------------------------------------------------------------------
class ConfigLoadError(ValueError):
  """A config spec or override a user wrote that cannot be loaded: one line naming the fix."""


def _fields(config, prefix: str = "") -> list[str]:
  out = []
  for key, value in config.items():
    out.append(prefix + key)
    if isinstance(value, ml_collections.ConfigDict):
      out += _fields(value, f"{prefix}{key}.")
  return out


def _parse_value(current, text: str, flag: str):
  """`text` read as the type of the field's `current` value, as absl's config flags read an
  override: a string field takes the text as it is; bool true/false/1/0; int and float by
  their constructors; any other field (tuples, None) a Python literal, else the text."""
  why = "; give the override a value of the field's type"
  if isinstance(current, bool):
    if text.lower() in ("true", "1", "false", "0"):
      return text.lower() in ("true", "1")
    raise ConfigLoadError(f"flag {flag}: expected true or false{why}")
  if isinstance(current, (int, float)):
    try:
      return type(current)(text)
    except ValueError as e:
      raise ConfigLoadError(f"flag {flag}: {e}{why}") from None
  if isinstance(current, str):
    return text
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def load(spec: str, overrides: Sequence[str] = ()) -> ml_collections.ConfigDict:
  """The locked config of `spec` (`configs/<env>.py[:args]`: the file's `get_config(args)`)
  with `overrides` (`--config.a.b=VALUE`, each read as its field's type) applied in order.
  A missing file, an unknown argument or field and an ill-typed value raise
  `ConfigLoadError` in one line naming the fix (an unknown field with the nearest names)."""
  path, _, arg = spec.partition(":")
  if not os.path.isfile(path):
    raise ConfigLoadError(
        f"config file could not be loaded (No such file or directory: {path!r}); pass "
        "--config=configs/<env>.py[:args] (run from the repository root)")
  module_spec = importlib.util.spec_from_file_location(
      "config_" + os.path.splitext(os.path.basename(path))[0], path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  try:
    config = module.get_config(arg or None)
  except ValueError as e:
    if str(e).startswith("unknown config argument"):
      raise ConfigLoadError(f"{e}; fix the --config=FILE:ARGS string") from None
    raise
  config.lock()
  fields = None
  for item in overrides:
    if not item.startswith("--config."):
      raise ConfigLoadError(f"{item!r} is not an override; write --config.a.b=VALUE")
    key, eq, text = item[len("--config."):].partition("=")
    if not eq:
      raise ConfigLoadError(f"override {item!r} needs a value: --config.{key}=VALUE")
    fields = fields or _fields(config)
    if key not in fields:
      near = difflib.get_close_matches(key, fields, n=3)
      hint = (f"did you mean {' or '.join('--config.' + n for n in near)}?" if near
              else "the fields are in the config file and configs/common.py")
      raise ConfigLoadError(f"unknown config field --config.{key}; {hint}")
    parent, _, leaf = key.rpartition(".")
    section = config
    for part in filter(None, parent.split(".")):
      section = section[part]
    value = _parse_value(section[leaf], text, item)
    try:
      config.update_from_flattened_dict({key: value})
    except (TypeError, ValueError) as e:
      raise ConfigLoadError(f"flag {item}: {' '.join(str(e).split())}; give the override a "
                            "value of the field's type") from None
  return config
