"""The paper settings equal the published run scripts, value by value.

For every algorithm x environment with a published script, the effective config of the
paper setting (`get_config("algo=<algo>,model=qwen2.5-1.5b")`, Qwen2.5-1.5B-Instruct)
is compared with a transcription of that script, of the yaml it overrides and of the
released code it runs. Each row names the file the value is read from. The sources:

  * verl-agent as released with the HGPO recipe, repository zzj1111/alfworldauto:
    examples/{grpo,rloo,gigpo,ppo}_trainer/run_{alfworld,webshop}.sh,
    examples/gigpo_trainer/run_search.sh (Search: Qwen2.5-7B-Instruct),
    recipe/hgpo/run_qwen2.5_1.5b_{alfworld,webshop}_train.sh,
    verl/trainer/config/ppo_trainer.yaml (the defaults no script overrides; the recipe's
    recipe/hgpo/config/hgpo_trainer.yaml only sets the hgpo block),
    verl/trainer/ppo/core_algos.py (compute_value_loss), verl/workers/fsdp_workers.py
    (the actor's float32 parameters, FSDP's bf16 compute, the reference's bf16 weights),
    agent_system/environments/env_manager.py and recipe/hgpo/env_manager.py (WebShop prompt).
  * HiPER, repository JonP07/HiPER-agent: example_scripts/HiPER_trainer/run_{alfworld,
    webshop}.sh, its verl/trainer/config/ppo_trainer.yaml, verl/workers/critic/dp_critic.py
    and agent_system/environments/env_manager.py.

The LoRA variant (`get_config("algo=gigpo,model=qwen2.5-7b,lora")`, column "GiGPO LoRA") is
compared with verl-agent's examples/gigpo_trainer/run_{alfworld,webshop}_lora.sh the same way,
and so are the training variants (`algo=gigpo,dynamic`, `algo=grpo,dynamic`, `algo=grpo,gspo`)
with examples/gigpo_dynamic_trainer/run_{alfworld,webshop}.sh,
examples/dapo_trainer/run_{alfworld,webshop}.sh and examples/gspo_trainer/run_alfworld.sh
(columns "GiGPO dynamic", "DAPO", "GSPO"; no GSPO script exists for WebShop).

A value that differs from the published one fails the test unless a named entry of
`DIFFERENCES` lists it with its reason; an entry that no longer matches a difference fails
too, so the list stays exact. `render()` is the "Paper settings" section of
docs/algorithms.md (`python -m tests.test_paper_settings` prints it), and the test checks
that the document holds it verbatim.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import pathlib
from typing import Any, Callable

import pytest

from configs import alfworld as alfworld_config
from configs import common
from configs import search as search_config
from configs import webshop as webshop_config
from hgpo_jax.models import config as model_config
from hgpo_jax.training import experiment
from hgpo_jax.training import train_step

VERL_AGENT = "zzj1111/alfworldauto"
HIPER_AGENT = "JonP07/HiPER-agent"
ALGOS = ("grpo", "rloo", "gigpo", "hgpo", "ppo", "hiper", "gigpo-lora", "gigpo-dynamic", "dapo",
         "gspo")
LORA = {"gigpo-lora": "gigpo"}
"""Columns of the `lora` variant: the algo whose script it changes."""
VARIANTS = {"gigpo-dynamic": ("gigpo", "dynamic"), "dapo": ("grpo", "dynamic"),
            "gspo": ("grpo", "gspo")}
"""Columns of the training variants: (the algo whose script it changes, the variant)."""
ENVS = ("alfworld", "webshop", "search")
CONFIGS = {"alfworld": alfworld_config, "webshop": webshop_config, "search": search_config}
VARIANT_ENVS = ("alfworld", "webshop")
"""The environments with LoRA and training-variant scripts (Search has GiGPO's alone)."""
ENV_LABELS = {"alfworld": "ALFWorld", "webshop": "WebShop", "search": "Search"}

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
LORA_SCRIPTS = {
    ("alfworld", "gigpo-lora"): (VERL_AGENT, "examples/gigpo_trainer/run_alfworld_lora.sh"),
    ("webshop", "gigpo-lora"): (VERL_AGENT, "examples/gigpo_trainer/run_webshop_lora.sh"),
}
YAML = "verl/trainer/config/ppo_trainer.yaml"


VARIANT_SCRIPTS = {
    ("alfworld", "gigpo-dynamic"): (VERL_AGENT, "examples/gigpo_dynamic_trainer/run_alfworld.sh"),
    ("webshop", "gigpo-dynamic"): (VERL_AGENT, "examples/gigpo_dynamic_trainer/run_webshop.sh"),
    ("alfworld", "dapo"): (VERL_AGENT, "examples/dapo_trainer/run_alfworld.sh"),
    ("webshop", "dapo"): (VERL_AGENT, "examples/dapo_trainer/run_webshop.sh"),
    ("alfworld", "gspo"): (VERL_AGENT, "examples/gspo_trainer/run_alfworld.sh"),
}


def _script(env: str, algo: str):
  return {**SCRIPTS, **LORA_SCRIPTS, **VARIANT_SCRIPTS}[(env, algo)]
FSDP_WORKERS = "verl/workers/fsdp_workers.py"
ENV_MANAGER = "agent_system/environments/env_manager.py"


# ------------------------------------------------------------------ what is compared
@dataclasses.dataclass(frozen=True)
class Parameter:
  """One published option and where the config holds it.

  Attributes:
    name: the option as the scripts write it (yaml path or script variable).
    field: the config field(s) it sets here (documentation).
    get: (config, its Experiment) -> the value in the published option's terms.
    only: the algorithms it applies to (empty: all).
  """
  name: str
  field: str
  get: Callable[[Any, Any], Any]
  only: tuple[str, ...] = ()


_NORM = {"mean_std": "mean_std_norm", "mean": "mean_norm"}
_MODEL = {"qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct", "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct"}
_ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
CRITIC = ("ppo", "hiper")
GROUPED = ("grpo", "rloo", "gigpo", "hgpo")
# the columns whose scripts run verl-agent's ppo_trainer.yaml (HGPO's recipe has its own)
_VERL_AGENT_GROUPED = ("grpo", "rloo", "gigpo", "gigpo-lora", "gigpo-dynamic", "dapo", "gspo")


def _on_gpu(c) -> str:
  """The compute dtype a GPU (or TPU) run of config `c` resolves: the published runs' GPUs."""
  return model_config.resolve_compute_dtype(c.model.compute_dtype, c.model.dtype, "gpu")


PARAMETERS = (
    Parameter("actor_rollout_ref.model.path", "model.name", lambda c, r: _MODEL[c.model.name]),
    # precision (fsdp_workers.py: the actor built in fp32, every other role in bf16; FSDP
    # mixed precision param_dtype bf16 unless fsdp_config.mixed_precision says otherwise);
    # "auto" resolved for a GPU, as the published runs ran (on CPUs it keeps float32)
    Parameter("actor parameters (fsdp_config.model_dtype)", "model.dtype",
              lambda c, r: c.model.dtype),
    Parameter("actor compute on GPU (fsdp mixed_precision.param_dtype)", "model.compute_dtype",
              lambda c, r: _on_gpu(c)),
    Parameter("reference parameters on GPU (ref torch_dtype)", "train.reference_dtype",
              lambda c, r: train_step.resolve_reference_dtype(c.train.reference_dtype,
                                                              _on_gpu(c)) or c.model.dtype),
    Parameter("rollout.dtype (on GPU)", "model.compute_dtype (the sampler's)",
              lambda c, r: _on_gpu(c)),
    Parameter("train_data_size", "rollout.num_groups", lambda c, r: c.rollout.num_groups),
    Parameter("env.rollout.n (group_size)", "rollout.group_size",
              lambda c, r: c.rollout.group_size),
    Parameter("env.max_steps", "env.max_steps", lambda c, r: c.env.max_steps),
    Parameter("env.history_length", "rollout.history_length",
              lambda c, r: c.rollout.history_length),
    Parameter("data.max_prompt_length", "rollout.max_prompt_tokens",
              lambda c, r: c.rollout.max_prompt_tokens),
    # the project truncates every prompt on the left (rollout.encode_prompt); it has no
    # 'error' mode
    Parameter("data.truncation", "(rollout.encode_prompt)", lambda c, r: "left"),
    Parameter("data.max_response_length", "rollout.max_new_tokens",
              lambda c, r: c.rollout.max_new_tokens),
    Parameter("rollout.temperature", "rollout.temperature", lambda c, r: c.rollout.temperature),
    Parameter("rollout.top_p", "rollout.top_p", lambda c, r: c.rollout.top_p),
    Parameter("rollout.val_kwargs.temperature", "eval.temperature",
              lambda c, r: c.eval.temperature),
    Parameter("actor.optim.lr", "train.lr", lambda c, r: c.train.lr),
    Parameter("actor.optim.weight_decay", "train.weight_decay",
              lambda c, r: c.train.weight_decay),
    Parameter("actor.grad_clip", "train.grad_clip", lambda c, r: c.train.grad_clip),
    Parameter("actor.ppo_mini_batch_size", "train.mini_batch_rows",
              lambda c, r: c.train.mini_batch_rows),
    Parameter("actor.ppo_micro_batch_size_per_gpu (loss unit)", "train.loss_unit_rows",
              lambda c, r: r.train.update.loss_unit),
    Parameter("actor.ppo_epochs", "train.ppo_epochs", lambda c, r: c.train.ppo_epochs),
    Parameter("actor.shuffle", "(mini-batches in row order)", lambda c, r: False),
    Parameter("actor.clip_ratio_low", "train.clip_ratio_low", lambda c, r: c.train.clip_ratio_low),
    Parameter("actor.clip_ratio_high", "train.clip_ratio_high",
              lambda c, r: c.train.clip_ratio_high),
    Parameter("actor.clip_ratio_c", "train.clip_ratio_c", lambda c, r: c.train.clip_ratio_c),
    Parameter("actor.loss_agg_mode", "train.loss_agg", lambda c, r: c.train.loss_agg),
    Parameter("actor.entropy_coeff", "train.entropy_coeff", lambda c, r: c.train.entropy_coeff),
    Parameter("actor.use_kl_loss", "train.use_kl_loss",
              lambda c, r: r.train.update.loss.use_kl_loss),
    Parameter("actor.kl_loss_coef", "train.kl_coef", lambda c, r: c.train.kl_coef),
    Parameter("actor.invalid_action_penalty_coef", "rollout.invalid_penalty",
              lambda c, r: c.rollout.invalid_penalty),
    Parameter("trainer.total_epochs", "train.num_iterations",
              lambda c, r: c.train.num_iterations),
    Parameter("trainer.test_freq", "eval.every", lambda c, r: c.eval.every),
    Parameter("val_data_size (tasks evaluated)", "eval.num_tasks",
              lambda c, r: c.eval.num_tasks),
    Parameter("env.seed", "seed", lambda c, r: c.seed),
    Parameter("WebShop history drop (chars)", "rollout.history_drop_chars",
              lambda c, r: c.rollout.history_drop_chars),
    # LoRA (verl's model.lora_rank / lora_alpha / target_modules)
    Parameter("model.lora_rank", "model.lora.rank", lambda c, r: c.model.lora.rank,
              only=tuple(LORA)),
    Parameter("model.lora_alpha", "model.lora.alpha", lambda c, r: c.model.lora.alpha,
              only=tuple(LORA)),
    Parameter("model.target_modules", "model.lora.targets",
              lambda c, r: "all-linear" if c.model.lora.targets == _ALL_LINEAR
              else c.model.lora.targets, only=tuple(LORA)),
    # training options (docs/algorithms.md §9.1-§9.7) of the verl-agent scripts
    Parameter("actor.policy_loss.loss_mode", "train.policy_loss",
              lambda c, r: {"ppo": "vanilla"}.get(c.train.policy_loss, c.train.policy_loss),
              only=_VERL_AGENT_GROUPED),
    Parameter("algorithm.filter_groups.enable", "train.filter_groups",
              lambda c, r: c.train.filter_groups, only=_VERL_AGENT_GROUPED),
    Parameter("algorithm.filter_groups.max_num_gen_batches", "train.max_generation_batches",
              lambda c, r: c.train.max_generation_batches, only=_VERL_AGENT_GROUPED),
    # estimators
    Parameter("algorithm.norm_adv_by_std_in_grpo", "algo.options.norm",
              lambda c, r: c.algo.options.norm == "mean_std", only=("grpo", "dapo", "gspo")),
    Parameter("algorithm.gamma", "algo.gamma", lambda c, r: c.algo.gamma,
              only=("gigpo", "hgpo", "gigpo-lora", "gigpo-dynamic")),
    Parameter("algorithm.gigpo.step_advantage_w", "algo.options.omega",
              lambda c, r: c.algo.options.omega, only=("gigpo", "gigpo-lora", "gigpo-dynamic")),
    Parameter("algorithm.gigpo.mode", "algo.options.norm",
              lambda c, r: _NORM[c.algo.options.norm],
              only=("gigpo", "gigpo-lora", "gigpo-dynamic")),
    Parameter("algorithm.hgpo.mode", "algo.options.norm",
              lambda c, r: _NORM[c.algo.options.norm], only=("hgpo",)),
    Parameter("algorithm.hgpo.weight_type", "algo.options.weights",
              lambda c, r: {"recipe": "length"}.get(c.algo.options.weights,
                                                    c.algo.options.weights), only=("hgpo",)),
    Parameter("algorithm.hgpo.length_weight_alpha", "algo.options.alpha",
              lambda c, r: c.algo.options.alpha, only=("hgpo",)),
    Parameter("algorithm.hgpo.base_group", "algo.options.base_group",
              lambda c, r: c.algo.options.base_group, only=("hgpo",)),
    Parameter("algorithm.gamma (GAE / HAE turn)", "algo.options.gamma",
              lambda c, r: c.algo.options.gamma, only=CRITIC),
    Parameter("algorithm.lam", "algo.options.lam / lambda_turn",
              lambda c, r: c.algo.options.get("lam", c.algo.options.get("lambda_turn")),
              only=CRITIC),
    Parameter("algorithm.hae.lam_seg", "algo.options.lambda_seg",
              lambda c, r: c.algo.options.lambda_seg, only=("hiper",)),
    Parameter("algorithm.hae.norm_adv", "algo.options.norm_adv",
              lambda c, r: c.algo.options.norm_adv, only=("hiper",)),
    Parameter("algorithm.hae.keep_penalty", "algo.options.keep_penalty",
              lambda c, r: c.algo.options.keep_penalty, only=("hiper",)),
    Parameter("algorithm.hae.keep_penalty_mode", "algo.options.keep_penalty_mode",
              lambda c, r: {"normalised": "normalized"}.get(c.algo.options.keep_penalty_mode,
                                                            c.algo.options.keep_penalty_mode),
              only=("hiper",)),
    Parameter("algorithm.hae.keep_consistency_penalty", "algo.options.keep_consistency_penalty",
              lambda c, r: c.algo.options.keep_consistency_penalty, only=("hiper",)),
    Parameter("algorithm.hae.bootstrap_truncated", "algo.options.bootstrap_truncated",
              lambda c, r: c.algo.options.bootstrap_truncated, only=("hiper",)),
    # the critic
    Parameter("critic.optim.lr", "critic.lr", lambda c, r: c.critic.lr, only=CRITIC),
    Parameter("critic.optim.weight_decay", "critic.weight_decay",
              lambda c, r: c.critic.weight_decay, only=CRITIC),
    Parameter("critic.grad_clip", "critic.grad_clip", lambda c, r: c.critic.grad_clip,
              only=CRITIC),
    Parameter("critic.cliprange_value", "critic.cliprange_value",
              lambda c, r: c.critic.cliprange_value, only=CRITIC),
    Parameter("critic.ppo_mini_batch_size", "critic mini-batch (train.mini_batch_rows)",
              lambda c, r: r.critic_update.mini_batch_rows, only=CRITIC),
    Parameter("critic.ppo_micro_batch_size_per_gpu (loss unit)", "critic.loss_unit_rows",
              lambda c, r: r.critic_update.loss_unit, only=CRITIC),
    Parameter("compute_value_loss factor", "critic.loss_scale",
              lambda c, r: c.critic.loss_scale, only=CRITIC),
    Parameter("value heads summed (total_vf)", "(critic heads)",
              lambda c, r: 3 if c.algo.name == "hae" else 1, only=("hiper",)),
    Parameter("trainer.critic_warmup", "critic.warmup_iterations",
              lambda c, r: c.critic.warmup_iterations, only=CRITIC),
)
_BY_NAME = {p.name: p for p in PARAMETERS}


# ------------------------------------------------------------------ the transcription
def _v(value, path=None, repo=None):
  """A published value and the file it is read from (None: the row's script)."""
  return (value, (repo, path) if path else None)


def _yaml(value, repo=VERL_AGENT):
  return _v(value, YAML, repo)


def _common(repo=VERL_AGENT):
  """The values every script of `repo` shares: the yaml defaults no script overrides,
  and the script lines all of them write the same way."""
  return {
      "actor_rollout_ref.model.path": _v("Qwen/Qwen2.5-1.5B-Instruct"),
      # verl-agent's file; HiPER-agent's fork of verl is not among the transcribed sources
      "actor parameters (fsdp_config.model_dtype)": _v("float32", FSDP_WORKERS, VERL_AGENT),
      "actor compute on GPU (fsdp mixed_precision.param_dtype)": _v(
          "bfloat16", FSDP_WORKERS, VERL_AGENT),
      "reference parameters on GPU (ref torch_dtype)": _v("bfloat16", FSDP_WORKERS, VERL_AGENT),
      "rollout.dtype (on GPU)": _yaml("bfloat16", repo),
      "env.history_length": _yaml(2, repo),
      "data.max_response_length": _v(512),
      "rollout.temperature": _yaml(1.0, repo),
      "rollout.top_p": _yaml(1.0, repo),
      "rollout.val_kwargs.temperature": _v(0.4),
      "actor.optim.lr": _v(1e-6),
      "actor.optim.weight_decay": _yaml(0.01, repo),
      "actor.grad_clip": _yaml(1.0, repo),
      "actor.ppo_epochs": _yaml(1, repo),
      "actor.shuffle": _yaml(False, repo),
      "actor.clip_ratio_low": _yaml(0.2, repo),
      "actor.clip_ratio_high": _yaml(0.2, repo),
      "actor.clip_ratio_c": _yaml(3.0, repo),
      "actor.loss_agg_mode": _yaml("token-mean", repo),
      "actor.entropy_coeff": _yaml(0.001, repo),
      "actor.use_kl_loss": _v(True),
      "actor.kl_loss_coef": _v(0.01),
      "actor.invalid_action_penalty_coef": _v(0.1),
      "trainer.test_freq": _v(5),
      "env.seed": _v(0),
  }


def _critic(repo, micro):
  return {
      "env.rollout.n (group_size)": _yaml(1, repo),
      "train_data_size": _v(128),
      "algorithm.gamma (GAE / HAE turn)": _yaml(1.0, repo),
      "algorithm.lam": _yaml(1.0, repo),
      "critic.optim.lr": _v(1e-5),
      "critic.optim.weight_decay": _yaml(0.01, repo),
      "critic.grad_clip": _yaml(1.0, repo),
      "critic.cliprange_value": _yaml(0.5, repo),
      # ${actor_rollout_ref.actor.ppo_mini_batch_size} in the yaml
      "critic.ppo_mini_batch_size": None,
      "critic.ppo_micro_batch_size_per_gpu (loss unit)": _v(micro),
      # agg_loss(max(...)) with no factor
      "compute_value_loss factor": _v(1.0, "verl/trainer/ppo/core_algos.py", repo),
      # verl-agent's PPO scripts write trainer.critic_warmup=0, HiPER's keep the yaml's
      "trainer.critic_warmup": _v(0) if repo == VERL_AGENT else _yaml(0, repo),
  }


def _grouped(**kw):
  return {"train_data_size": _v(16), "env.rollout.n (group_size)": _v(8), **kw}


_DROP = _v(13000, ENV_MANAGER, VERL_AGENT)  # `if len(obs) > 13000:` (WebShop manager)
_NO_DROP = _v(0, "recipe/hgpo/env_manager.py", VERL_AGENT)  # the same lines commented out

PUBLISHED = {
    ("alfworld", "grpo"): {
        **_common(), **_grouped(), "env.max_steps": _v(50), "data.max_prompt_length": _v(2048),
        "data.truncation": _v("error"), "actor.ppo_mini_batch_size": _v(256),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(32),
        "algorithm.norm_adv_by_std_in_grpo": _yaml(True), "trainer.total_epochs": _v(150),
        "val_data_size (tasks evaluated)": _v(128)},
    ("alfworld", "rloo"): {
        **_common(), **_grouped(), "env.max_steps": _v(50), "data.max_prompt_length": _v(2048),
        "data.truncation": _v("error"), "actor.ppo_mini_batch_size": _v(256),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(32),
        "trainer.total_epochs": _v(150), "val_data_size (tasks evaluated)": _v(128)},
    ("alfworld", "gigpo"): {
        **_common(), **_grouped(), "env.max_steps": _v(50), "data.max_prompt_length": _v(2048),
        "data.truncation": _v("error"), "actor.ppo_mini_batch_size": _v(256),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(32),
        "algorithm.gamma": _v(0.95), "algorithm.gigpo.step_advantage_w": _v(1.0),
        "algorithm.gigpo.mode": _v("mean_std_norm"), "trainer.total_epochs": _v(150),
        "val_data_size (tasks evaluated)": _v(128)},
    ("alfworld", "hgpo"): {
        **_common(), **_grouped(), "env.max_steps": _v(50), "env.history_length": _v(2),
        "data.max_prompt_length": _v(4096), "data.truncation": _v("left"),
        "actor.ppo_mini_batch_size": _v(256),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(16), "algorithm.gamma": _v(0.95),
        "algorithm.hgpo.mode": _v("mean_std_norm"), "algorithm.hgpo.weight_type": _v("length"),
        "algorithm.hgpo.length_weight_alpha": _v(1.0), "algorithm.hgpo.base_group": _v(False),
        "trainer.total_epochs": _v(160), "val_data_size (tasks evaluated)": _v(128)},
    ("alfworld", "ppo"): {
        **_common(), **_critic(VERL_AGENT, 16), "env.max_steps": _v(50),
        "data.max_prompt_length": _v(2048), "data.truncation": _v("error"),
        "actor.ppo_mini_batch_size": _v(256),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(16),
        "trainer.total_epochs": _v(150), "val_data_size (tasks evaluated)": _v(128)},
    ("alfworld", "hiper"): {
        **_common(HIPER_AGENT), **_critic(HIPER_AGENT, 16), "env.max_steps": _v(50),
        "env.seed": _v(6), "data.max_prompt_length": _v(2048), "data.truncation": _v("error"),
        "actor.ppo_mini_batch_size": _v(256),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(16),
        "algorithm.hae.lam_seg": _yaml(0.95, HIPER_AGENT), "algorithm.hae.norm_adv": _v(True),
        "algorithm.hae.keep_penalty": _v(-0.3),
        "algorithm.hae.keep_penalty_mode": _yaml("normalized", HIPER_AGENT),
        "algorithm.hae.keep_consistency_penalty": _v(-0.3),
        "algorithm.hae.bootstrap_truncated": _v(True),
        # use_three_heads_critic=True; dp_critic.py adds the heads' losses (coefficients 1)
        "value heads summed (total_vf)": _v(3, "verl/workers/critic/dp_critic.py", HIPER_AGENT),
        "trainer.total_epochs": _v(150), "val_data_size (tasks evaluated)": _v(128)},
    ("webshop", "grpo"): {
        **_common(), **_grouped(), "env.max_steps": _v(15), "data.max_prompt_length": _v(4096),
        "data.truncation": _v("error"), "actor.ppo_mini_batch_size": _v(64),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(8),
        "algorithm.norm_adv_by_std_in_grpo": _yaml(True), "trainer.total_epochs": _v(150),
        "val_data_size (tasks evaluated)": _v(128), "WebShop history drop (chars)": _DROP},
    ("webshop", "rloo"): {
        **_common(), **_grouped(), "env.max_steps": _v(15), "data.max_prompt_length": _v(4096),
        "data.truncation": _v("error"), "actor.ppo_mini_batch_size": _v(64),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(8),
        "trainer.total_epochs": _v(150), "val_data_size (tasks evaluated)": _v(128),
        "WebShop history drop (chars)": _DROP},
    ("webshop", "gigpo"): {
        **_common(), **_grouped(), "env.max_steps": _v(15), "data.max_prompt_length": _v(4096),
        "data.truncation": _v("error"), "actor.ppo_mini_batch_size": _v(64),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(8),
        "algorithm.gamma": _v(0.95), "algorithm.gigpo.step_advantage_w": _v(1.0),
        "algorithm.gigpo.mode": _v("mean_norm"), "trainer.total_epochs": _v(150),
        # prepare --val_data_size $((val_data_size * 2)): 2 x 128 tasks
        "val_data_size (tasks evaluated)": _v(256), "WebShop history drop (chars)": _DROP},
    ("webshop", "hgpo"): {
        **_common(), **_grouped(), "env.max_steps": _v(30), "env.history_length": _v(2),
        "data.max_prompt_length": _v(4096), "data.truncation": _v("left"),
        "actor.ppo_mini_batch_size": _v(64),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(4), "algorithm.gamma": _v(0.95),
        "algorithm.hgpo.mode": _v("mean_norm"), "algorithm.hgpo.weight_type": _v("length"),
        "algorithm.hgpo.length_weight_alpha": _v(1.0), "algorithm.hgpo.base_group": _v(False),
        "trainer.total_epochs": _v(160), "val_data_size (tasks evaluated)": _v(256),
        "WebShop history drop (chars)": _NO_DROP},
    ("webshop", "ppo"): {
        **_common(), **_critic(VERL_AGENT, 4), "env.max_steps": _v(15),
        "data.max_prompt_length": _v(4096), "data.truncation": _v("error"),
        "actor.ppo_mini_batch_size": _v(64),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(8),
        "trainer.total_epochs": _v(150), "val_data_size (tasks evaluated)": _v(128),
        "WebShop history drop (chars)": _DROP},
    ("webshop", "hiper"): {
        **_common(HIPER_AGENT), **_critic(HIPER_AGENT, 16), "env.max_steps": _v(50),
        "env.seed": _v(6), "data.max_prompt_length": _v(2048), "data.truncation": _v("error"),
        "actor.ppo_mini_batch_size": _v(256),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(16),
        "algorithm.hae.lam_seg": _yaml(0.95, HIPER_AGENT), "algorithm.hae.norm_adv": _v(True),
        "algorithm.hae.keep_penalty": _v(-3.5), "algorithm.hae.keep_penalty_mode": _v("normalized"),
        "algorithm.hae.keep_consistency_penalty": _v(-0.3),
        "algorithm.hae.bootstrap_truncated": _v(False),
        "value heads summed (total_vf)": _v(3, "verl/workers/critic/dp_critic.py", HIPER_AGENT),
        "trainer.total_epochs": _v(150), "val_data_size (tasks evaluated)": _v(128),
        # WebshopEnvironmentManagerOptions: `if len(obs) > 13000:`
        "WebShop history drop (chars)": _v(13000, ENV_MANAGER, HIPER_AGENT)},
    # GiGPO on Search-R1's task with Qwen2.5-7B-Instruct; validation greedy (the yaml's
    # val_kwargs: temperature 0, do_sample False, which the script leaves)
    ("search", "gigpo"): {
        **_common(), "actor_rollout_ref.model.path": _v("Qwen/Qwen2.5-7B-Instruct"),
        "train_data_size": _v(256), "env.rollout.n (group_size)": _v(5),
        "env.max_steps": _v(4), "env.history_length": _v(4), "data.max_prompt_length": _v(4096),
        "data.truncation": _v("left"), "rollout.val_kwargs.temperature": _yaml(0),
        "actor.ppo_mini_batch_size": _v(512),
        "actor.ppo_micro_batch_size_per_gpu (loss unit)": _v(16), "actor.entropy_coeff": _v(0),
        "actor.kl_loss_coef": _v(0.001), "actor.invalid_action_penalty_coef": _v(0.01),
        "algorithm.gamma": _v(0.95), "algorithm.gigpo.step_advantage_w": _v(1.0),
        "algorithm.gigpo.mode": _v("mean_std_norm"), "trainer.total_epochs": _v(1),
        "trainer.test_freq": _v(50), "val_data_size (tasks evaluated)": _v(512)},
}
# verl-agent's LoRA scripts: their GiGPO script with Qwen2.5-7B, adapters and no KL loss
for _env in VARIANT_ENVS:
  PUBLISHED[(_env, "gigpo-lora")] = {
      **PUBLISHED[(_env, "gigpo")],
      "actor_rollout_ref.model.path": _v("Qwen/Qwen2.5-7B-Instruct"),
      "model.lora_rank": _v(64), "model.lora_alpha": _v(64), "model.target_modules": _yaml(
          "all-linear"),
      "actor.optim.lr": _v(3e-6), "actor.use_kl_loss": _v(False),
      "actor.kl_loss_coef": _yaml(0.001)}

# The training options the scripts leave at the yaml's values, and the variants' scripts:
# each is its algo's script with these lines changed (the rest is line for line the same).
_YAML_OPTIONS = {"actor.policy_loss.loss_mode": _yaml("vanilla"),
                 "algorithm.filter_groups.enable": _yaml(False),
                 "algorithm.filter_groups.max_num_gen_batches": _yaml(10)}
PUBLISHED[("search", "gigpo")].update(_YAML_OPTIONS)
for _env in VARIANT_ENVS:
  for _algo in ("grpo", "rloo", "gigpo", "gigpo-lora"):
    PUBLISHED[(_env, _algo)].update(_YAML_OPTIONS)
  _dynamic = {"actor.clip_ratio_low": _v(0.2), "actor.clip_ratio_high": _v(0.28),
              "algorithm.filter_groups.enable": _v(True),
              "algorithm.filter_groups.max_num_gen_batches": _v(10)}
  PUBLISHED[(_env, "gigpo-dynamic")] = {**PUBLISHED[(_env, "gigpo")], **_dynamic}
  PUBLISHED[(_env, "dapo")] = {**PUBLISHED[(_env, "grpo")], **_dynamic}
# gigpo_dynamic_trainer/run_webshop.sh prepares val_data_size tasks, not twice as many
PUBLISHED[("webshop", "gigpo-dynamic")]["val_data_size (tasks evaluated)"] = _v(128)
PUBLISHED[("alfworld", "gspo")] = {
    **PUBLISHED[("alfworld", "grpo")], "actor.policy_loss.loss_mode": _v("gspo"),
    "actor.clip_ratio_low": _v(3e-4), "actor.clip_ratio_high": _v(4e-4),
    "trainer.total_epochs": _v(200)}

# The critic's mini-batch is the actor's (yaml: ${actor_rollout_ref.actor.ppo_mini_batch_size}).
for _key, _row in PUBLISHED.items():
  if "critic.ppo_mini_batch_size" in _row:
    _row["critic.ppo_mini_batch_size"] = _v(_row["actor.ppo_mini_batch_size"][0], YAML,
                                            SCRIPTS[_key][0])


# ------------------------------------------------------------------ deliberate differences
@dataclasses.dataclass(frozen=True)
class Difference:
  """A deliberate difference from the published setting.

  Attributes:
    name: how the table and the test refer to it.
    reason: why the project differs.
    covers: (env, algo, parameter name) patterns (fnmatch) of the table cells it explains;
      empty for a difference no config value shows.
  """
  name: str
  reason: str
  covers: tuple[tuple[str, str, str], ...] = ()


DIFFERENCES = (
    Difference(
        "truncation-left",
        "The scripts other than HGPO's set `data.truncation='error'` (a prompt over the limit "
        "stops the run); the project truncates every prompt on the left "
        "(`rollout.encode_prompt`), as HGPO's recipe does, so a long WebShop page or a "
        "small `max_prompt_tokens` cannot stop a run. Prompts within the limit are the same.",
        (("*", "*", "data.truncation"),)),
    Difference(
        "seed",
        "HiPER's scripts seed their environments with 6, verl-agent's with 0; the project's "
        "`seed` (0) splits into its own model, sampler, task and env streams, so no seed "
        "reproduces a published run's draws.",
        (("*", "hiper", "env.seed"),)),
    Difference(
        "search-epochs",
        "Search's script trains one epoch (`trainer.total_epochs=1`) over its train file, "
        "len(file) // 256 iterations; the config counts iterations: 662 = 169,615 // 256 for "
        "Search-R1's NQ + HotpotQA train set (set `train.num_iterations` from your file).",
        (("search", "gigpo", "trainer.total_epochs"),)),
    Difference(
        "zero-mask-padding-rows",
        "verl's `adjust_batch` pads a batch to a multiple of the mini-batch by duplicating rows "
        "with their masks (they count twice in the loss); the project's padding rows copy a "
        "row's tokens with nothing scored, so they add nothing (`train_batch` module)."),
    Difference(
        "recipe-weights",
        "HGPO's level weights follow the recipe, `(k+2)^α` with `+1e-6` in the denominator, "
        "not the paper's `(k+1)^α` (§6); `algo.options.weights='paper'` is the paper's."),
    Difference(
        "smollm2-default-model",
        "Without `model=`, the configs load SmolLM2-135M (the CPU jobs); the paper settings "
        "are `model=qwen2.5-1.5b` (or `qwen2.5-7b`) with `--config.model.path`."),
    Difference(
        "lora-base-in-compute-dtype",
        "verl builds a LoRA actor's frozen base in float32 like its full actor "
        "(fsdp_workers.py) and FSDP computes in bf16; the project stores the frozen base in "
        "the compute dtype (bf16 on accelerators, `hgpo_jax.models.lora`): the products read "
        "the same bf16-rounded weights and the base takes half the memory. The adapters, "
        "their optimizer state and the value heads are float32 as verl's."),
    Difference(
        "gspo-aggregation",
        "The release's `compute_policy_loss_gspo` (verl/trainer/ppo/core_algos.py) aggregates "
        "the GSPO term `seq-mean-token-mean` whatever `loss_agg_mode` says; verl main's "
        "does the same; the project aggregates it with `train.loss_agg` (`token-mean` in "
        "the GSPO setting, whose loss unit of 32 rows needs it). A sequence is one step's response "
        "(§9.2)."),
    Difference(
        "generated-environments",
        "ALFWorld games are generated ALFWorld-format games on ALFRED rooms and the shop is "
        "the project's own WebShop-compatible catalog (docs/environments.md), not the "
        "released splits: success rates are not comparable to the papers'. Search runs on a "
        "synthetic question set with BM25 unless given Search-R1's files; verl-agent's runs "
        "retrieve with Search-R1's E5 dense retriever."),
)

# Alignments with the published settings that change the CPU mini suite's runs
# (launch/experiments/suites.py), so its results table must be regenerated after them; the
# others touch only values the suite sets itself (iterations, prompt tokens, mini-batches,
# horizon, evaluation tasks).
MINI_SUITE_CHANGES = (
    "GRPO on WebShop-mini normalises by the std (`norm_adv_by_std_in_grpo`), not the mean "
    "only.",
    "WebShop-mini prompts show the formatted page (`format_obs`), end every admissible "
    "action with a comma and drop the history past 13,000 characters (GRPO, GiGPO; not "
    "HGPO).",
    "PPO and HiPER on ALFWorld-mini: the value loss has no 0.5 factor and HiPER's is the sum "
    "of its three heads' token means (their critics see different gradients).",
)


# ------------------------------------------------------------------ the checks
def paper_config(env: str, algo: str):
  if algo in LORA:
    return CONFIGS[env].get_config(f"algo={LORA[algo]},model=qwen2.5-7b,lora")
  if algo in VARIANTS:
    return CONFIGS[env].get_config(f"algo={VARIANTS[algo][0]},model=qwen2.5-1.5b,"
                                   f"{VARIANTS[algo][1]}")
  # Search's only script trains Qwen2.5-7B-Instruct
  model = "qwen2.5-7b" if env == "search" else "qwen2.5-1.5b"
  return CONFIGS[env].get_config(f"algo={algo},model={model}")


def cells(env: str, algo: str):
  """(parameter, published value, source, effective value) of one paper setting."""
  c = paper_config(env, algo)
  exp = experiment.from_config(c)
  out = []
  for name, entry in PUBLISHED[(env, algo)].items():
    param = _BY_NAME[name]
    assert not param.only or algo in param.only, (env, algo, name)
    value, source = entry
    out.append((param, value, source or _script(env, algo), param.get(c, exp)))
  return out


def _equal(a, b) -> bool:
  if isinstance(a, float) or isinstance(b, float):
    return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= (
        1e-12 * max(abs(a), abs(b)))
  return a == b and type(a) is type(b) or (a == b and {type(a), type(b)} <= {int, bool})


def listed(env: str, algo: str, name: str) -> Difference | None:
  for d in DIFFERENCES:
    if any(fnmatch.fnmatchcase(env, e) and fnmatch.fnmatchcase(algo, a) and n == name
           for e, a, n in d.covers):
      return d
  return None


@pytest.mark.parametrize("env,algo", sorted(PUBLISHED))
def test_paper_setting_equals_the_published_script(env, algo):
  unlisted = [f"{p.name} ({p.field}): published {v!r} in {src[0]}:{src[1]}, config {got!r}"
              for p, v, src, got in cells(env, algo)
              if not _equal(got, v) and listed(env, algo, p.name) is None]
  assert not unlisted, "new differences (fix the config or list them in DIFFERENCES):\n" + (
      "\n".join(unlisted))


def test_every_listed_difference_is_a_difference():
  found = {(env, algo, p.name) for env, algo in PUBLISHED
           for p, v, _, got in cells(env, algo) if not _equal(got, v)}
  for d in DIFFERENCES:
    for pattern in d.covers:
      hits = {f for f in found if all(fnmatch.fnmatchcase(x, y) for x, y in zip(f, pattern))}
      assert hits, f"{d.name}: {pattern} matches no difference; remove it from DIFFERENCES"


def test_every_parameter_is_transcribed_where_it_applies():
  for (env, algo), row in PUBLISHED.items():
    wanted = {p.name for p in PARAMETERS if not p.only or algo in p.only}
    if env != "webshop":
      wanted.discard("WebShop history drop (chars)")
    assert set(row) == wanted, (env, algo, sorted(set(row) ^ wanted))


def test_the_configs_name_the_same_scripts():
  assert common.SCRIPTS == SCRIPTS
  assert {(env, "gigpo-lora"): s for env, s in common.LORA_SCRIPTS.items()} == LORA_SCRIPTS
  assert set(common.SCRIPT_SETTINGS) == set(SCRIPTS) == (set(PUBLISHED) - set(LORA_SCRIPTS)
                                                          - set(VARIANT_SCRIPTS))
  assert {(env, col): common.TRAIN_VARIANT_SCRIPTS[(env, *VARIANTS[col])]
          for env, col in VARIANT_SCRIPTS} == VARIANT_SCRIPTS
  assert set(VARIANT_SCRIPTS) <= set(PUBLISHED)


# ------------------------------------------------------------------ the document
_LABEL = {"grpo": "GRPO", "rloo": "RLOO", "gigpo": "GiGPO", "hgpo": "HGPO", "ppo": "PPO",
          "hiper": "HiPER", "gigpo-lora": "GiGPO LoRA", "gigpo-dynamic": "GiGPO dynamic",
          "dapo": "DAPO", "gspo": "GSPO"}
BEGIN = "<!-- paper settings table: generated by tests/test_paper_settings.py render() -->"
END = "<!-- end of the generated paper settings table -->"


def _fmt(value) -> str:
  if isinstance(value, float) and value and abs(value) < 1e-3:
    return f"{value:.0e}".replace("e-0", "e-")
  return f"`{value}`"


_REPO_LABEL = {VERL_AGENT: "verl-agent", HIPER_AGENT: "HiPER-agent"}


def render() -> str:
  """The generated part of docs/algorithms.md's "Paper settings" section."""
  out = [BEGIN, ""]
  for env in ENVS:
    algos = [a for a in ALGOS if (env, a) in PUBLISHED]  # WebShop has no GSPO script
    table = {algo: {p.name: (v, src, got) for p, v, src, got in cells(env, algo)}
             for algo in algos}
    out.append(f"**{ENV_LABELS[env]}** (`configs/{env}.py`)")
    out.append("")
    out.append("| parameter (published option) | config field | "
               + " | ".join(_LABEL[a] for a in algos) + " |")
    out.append("|---|---|" + "---|" * len(algos))
    out.append("| script | – | " + " | ".join(
        f"{_REPO_LABEL[_script(env, a)[0]]} "
        f"`{_script(env, a)[1]}`" for a in algos) + " |")
    for param in PARAMETERS:
      if not any(param.name in table[a] for a in algos):
        continue
      row = []
      for algo in algos:
        if param.name not in table[algo]:
          row.append("–")
          continue
        value, src, got = table[algo][param.name]
        cell = _fmt(value)
        if src != _script(env, algo):
          other = "" if src[0] == _script(env, algo)[0] else f"{_REPO_LABEL[src[0]]} "
          cell += f" ({other}yaml)" if src[1] == YAML else f" ({other}{src[1]})"
        if not _equal(got, value):
          cell += f" ≠ {_fmt(got)} [{listed(env, algo, param.name).name}]"
        row.append(cell)
      out.append(f"| {param.name} | `{param.field}` | " + " | ".join(row) + " |")
    out.append("")
  out.append("Deliberate differences (the test knows them by name):")
  out.append("")
  out += [f"* **{d.name}**: {d.reason}" for d in DIFFERENCES]
  out.append("")
  out.append("Alignments with the published settings that change the CPU mini suite's runs "
             "(`launch/experiments/suites.py`; "
             "regenerate its results table after them):")
  out.append("")
  out += [f"* {line}" for line in MINI_SUITE_CHANGES]
  out += ["", END]
  return "\n".join(out)


def test_docs_show_the_table():
  doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
  assert BEGIN in doc and END in doc, "docs/algorithms.md has no generated paper-settings table"
  got = doc[doc.index(BEGIN):doc.index(END) + len(END)]
  assert got == render(), ("docs/algorithms.md's paper-settings table is stale: replace it by "
                           "the output of `python -m tests.test_paper_settings`")


if __name__ == "__main__":
  print(render())
