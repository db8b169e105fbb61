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
random-init policy (2 layers, 64 wide) with constrained decoding on ALFWorld-mini
(env_servers/alfworld/mini.py), Sokoban 12x12 with 4 boxes trained on 2 levels, and
WebShop-mini at horizon 15, each evaluated on 48 held-out games.
The first committed table (results/mini_v2.md) was made with mini_v2, which covered ALFWorld-mini
and Sokoban; mini_v3 changed only the WebShop column (the calibrated shop below), whose
mini_v2 definition was never run; its runs are in results/mini_webshop_mini.md. mini_v4
evaluates on 48 held-out games instead of 12 (ALFWorld-mini: the games of ALFWorld-mini
mini_v3, whose first 12 are mini_v2's) or 24 (Sokoban), so that one game is 2.1 points;
WebShop-mini's mini_v3 shop has 24 test goals, all of them evaluated (48 from mini_v6). The ALFWorld-mini and
WebShop-mini training cells are unchanged. mini_v4's Sokoban column is 12x12 with 5 boxes
at horizon 10 instead of 6x6 with 1 box at horizon 15 (which random play solves 60-68 % of
the time, so no method could separate from it): uniform-random play solves 12.5 % of 1000
train and 13.0 % of 200 test levels within 10 steps, and random play that never undoes a
move 13.6 / 15.5 % (`python -m env_servers.sokoban.env --random-play 1000 --split train
--dim 12 --boxes 5 --horizons 10`; the grid of sizes, boxes and horizons that was tried
is in docs/environments.md). The sweep answered no: at seed 123 (trainer fd59df2) GRPO,
RLOO, GiGPO and HGPO K=2 ended at 0 % train success over the last 3 iterations and 10.4 /
8.3 / 6.2 / 16.7 % held-out, single iterations reaching 38-44 % only when an easy level
was drawn: with 2 new levels per iteration out of 1000, each level is seen once, and the
2-layer policy does not learn Sokoban in general from 28 levels.

mini_v5 changes only the Sokoban column, to the design that makes ALFWorld-mini learnable
(two training games learnt by heart, held-out games for transfer): 12x12 with **4 boxes,
trained on the train split's first 2 levels** (`levels=2`, env_servers/sokoban/env.py
`train_levels`), horizon 10, evaluated on 48 of the 200 test levels. Uniform-random play
solves 1.8 % of episodes on the 2 training levels (levels 0 and 1: 1.0 % and 7.0 %,
shortest solutions 6 and 4 moves) and 14.5 % of the 200 test levels within 10 steps (16.1
% of all 1000 train levels; 18.8 % of the first 48 test levels, one episode each: a
standard error of 5.6 points) (`python -m env_servers.sokoban.env --random-play 400
--split train --dim 12 --boxes 4 --horizons 10 --train-levels 2`, and `--random-play 200
--split test`). Calibration runs (GiGPO, seed 123, the column's other settings, `python -m
launch.experiments.sweep suite --suite mini --envs sokoban --methods gigpo --seeds 123 --root <tmp>
--override env.args.train_levels=N [env.args.num_boxes=B]`, working tree of 7f3b3c5, with
the table sweep beside them), train success per iteration:
  * 5 boxes, 4 levels (random 8.8 %; level 2 needs 12 moves, unsolvable within 10):
    0, 6, 0, 12, 44, 0, 0, 50, 0, 50, 31, 0, 50, 0 %; held-out 10.4 %;
  * 5 boxes, 2 levels (random 18.2 %: level 1 is one move): 12, 38, 44, then 50 % at every
    iteration from 4 to 10: level 1 solved, level 0 (random 2.5 %) never;
  * 4 boxes, 2 levels (this column; random 1.8 %): 0, 6, 12, 19, 31, 44, 38, 50, 50, 50,
    50, 50, 31, 44 %: the last 3 iterations 41.7 %, held-out 20.8 % (at iterations 5, 10
    and 14). Whether the best method passes 50 % over the last 3 iterations is the
    sweep's to show. The same run resumed to 30 iterations (`train.num_iterations=30`;
    the learning rate is constant, so its first 14 iterations are the sweep's run): 44,
    then exactly 50 % at every iteration from 16 to 26 (8 of 16 episodes: one level's
    group solved in every episode, the other's in none; two half-learnt levels would give
    exactly 8 with probability ~0.2 per iteration), held-out 22.9 %: a longer budget does
    not learn the second level. At 50 % the column's ceiling for a method that learns one
    level is reached; above it, a method must solve the level that random play solves 1 %
    of the time (level 0, 6 moves). Twice the group (`--override rollout.group_size=16
    train.mini_batch_rows=320 train.micro_batch_rows=80`, seed 123, trainer 3709ef7, 14
    iterations): GiGPO 3, 0, 31, 31, 44, 41, then 50 % at 7 of the last 8 iterations
    (46.9 at one), HGPO K=4 3, 0, 16, 22, 44, 41, then 41-50 %, both 50.0 % over the
    last 3 iterations, held-out 20.8 / 12.5 %: 16 tries per level a group do not find the second level
    either. Above 50 % wants exploration of level 0 itself (a curriculum of one level,
    an entropy bonus, or a longer horizon that random play solves more often).
How prompted SmolLM2 plays it is measured by the sweep.

mini_v6 changes only the WebShop-mini column, so that it too is evaluated on 48 held-out
games: the shop `env_servers/webshop/data/mini_v6` has 24 train and **48 test goals**
(740 products, the fewest the generator accepts for 24 + 48 goals, which keeps mini_v3's
ratio of near-miss to other products; generator seed 1), and `eval.num_tasks` is 48.
Uniform-random play wins 23.3 % (train) / 23.4 % (test) of episodes within 15 steps, the
scripted "listed search, first result, Buy Now" 66.7 % / 60.4 % (commands below). The
generator seeds tried, random play train / test: 0: 29.6 / 22.1 % (above the 5-25 %
untrained target on train), **1: 23.3 / 23.4 %**, 2: 26.7 / 24.5 %, 3: 27.3 / 27.7 %: seed
1 is the first inside the target on both splits. With more products per type than mini_v3
(whose seed-0 goals were 19.0 / 16.2 %), random play finds a goal-satisfying product a
little more often. mini_v3's shop stays for results/mini_webshop_mini.md; three mini_v3 runs
of this sweep (seed 123: GRPO, RLOO, GiGPO at trainer fd59df2) are not in the table.

Calibration of Sokoban 6x6 with one box (verl-agent's Sokoban size): uniform-random play
over the admissible moves (`python -m env_servers.sokoban.env --random-play 1000 --split
train`) solves 60.2 / 65.3 / 68.3 % of the levels within 10 / 15 / 20 steps (test split,
200 levels: 56.0 / 62.0 / 66.5 %): the generator's rooms are narrow and its boxes start a
few pushes from their targets, so the 5-25 % untrained target is out of reach at this
size (8x8 with 2 boxes: 31.2 / 35.8 % within 10 / 15 steps). The tiny policy's iteration-1
success is 31-75 % over seeds (2 groups of 8), and within 14 iterations no estimator
lifts it above random play (results/mini_v2.md): the column measures the estimators on a
task the 2-layer policy does not learn at this budget, across 1000 distinct levels. An
iteration costs ~14 s alone (~30-40 s while other jobs shared the cores); at 512 prompt
tokens it cost ~120 s, 100 s of it the update.

Calibration of ALFWorld-mini (target: untrained success 5-25 %, best method >= 60 %
within the budget of 14 iterations x 16 trajectories x 12 steps), measured with the
trainer (GiGPO, seed 123, `python -m launch.experiments.sweep suite --suite mini --envs alfworld_mini
--methods gigpo --seeds 123 --root <tmp>`), iteration-1 success -> success of the last
iterations:
  * 9 train games on 3-receptacle rooms with 1 distractor class, horizon 15, without
    hiding look/inventory/examine: 0.125 -> 0.0-0.06 (16 iterations; no learning);
  * 4 games, 3 receptacles, 1 distractor, horizon 12, informational commands hidden:
    0.125 -> 0.0-0.06 (16 it.); the same with 32 trajectories per iteration
    (4 groups x 8) and 2 or 4 PPO epochs: 0.22 -> 0.03-0.19 (12 and 8 it.);
  * 4 games, 2-3 receptacles, no distractor: GiGPO 0.125 -> 0.0-0.125, GRPO 0.125 -> 0.0-0.375
    (16 it.);
  * the learning test's 2 rooms (tests/test_learning.py) through this harness: 0.0 -> 0.75
    at iteration 11;
  * mini_v2 (2 train games: placing and lamp; 12 held-out games of 3 task types): see
    results/mini_v2.md (iteration 1: 0.19-0.25 over seeds).
So at this budget the 2-layer policy learns a few rooms by heart and does not read the
task sentence (left truncation to 256 tokens keeps the current observation and the
admissible actions, not the task); held-out success measures how far that transfers.
Uniform-random play over the admissible list (`python -m env_servers.alfworld.mini
--suite mini_v2 --random-play 32 --split train --hide-actions look,inventory,examine`):
train 17.2 % within 12 steps.

Calibration of WebShop-mini (mini_v3): with WebShop's `search[<your query>]` the
random-init policy writes gibberish queries and never buys the goal product (mini_v2
probe: 0 % success, every episode at the horizon). WebShop-mini is an option-free shop
(mini_v3: `env_servers/webshop/data/mini_v3`, 500 products, 24 train / 24 test goals;
mini_v6: `env_servers/webshop/data/mini_v6`, 740 products, 24 / 48; commands in
env_servers/webshop/generate.py) with one listed keyword search per goal
(`env.args.search_actions=goal`, env_servers/webshop/env.py), so the column measures
choosing a product that fits the instruction and buying it. Uniform-random play
(`python -m env_servers.webshop.env --random-play 20 --data-dir
env_servers/webshop/data/mini_v3 --search-actions goal --split train`, and `--split test`;
mini_v6 likewise, numbers above) wins 19.0 % / 16.2 % of episodes within 15 steps on
mini_v3; the scripted "listed search, first result, Buy Now" wins 58.3 % / 50.0 %. The
tiny policy on mini_v3 (`python -m launch.experiments.sweep suite
--suite mini --envs webshop_mini`, trainer 402bdc3/96a2006, results/mini_webshop_mini.md):
iteration-1 train success 6-12 % in all 9 runs (inside the 5-25 % target); after 14
iterations GRPO / GiGPO / HGPO K=2 reach 34 / 29 / 30 % train success (last 3 iterations,
mean of 3 seeds; single iterations up to 81 %) and 37.5 / 38.9 / 43.1 % held-out, so the
best method misses the >= 60 % target at this budget. ~21 s per iteration alone, ~36 s
with two runs sharing the cores. A first run at max_new_tokens 32
truncated the listed searches of 28 of the 48 goals (21-51 tiny tokens with the action
tags) into invalid actions: iteration-1 success 0.06 / 0.00 / 0.00 over the 3 seeds; the
column runs at 64 and the sampler now refuses a step none of whose actions fits.

Seeds and budget (mini_v4 on): ALFWorld-mini, the headline column, runs every method with 5
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
import importlib
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
        # state-only prompt (runs before trainer 913fa95 played blind)
        Method("hiper", "HiPER", "algo=hiper,k=2,model=tiny", grouped=False,
               overrides={**_TINY_CRITIC, "rollout.max_new_tokens": 128,
                          "rollout.format_instructions": False},
               note="critic lr 1e-2, state-only prompt"),
        Method("smollm2_prompted", "SmolLM2-135M-Instruct, prompted (no training)",
               "algo=grpo,k=2,model=smollm2-135m", kind=PROMPTED),
    ),
    seeds=(123, 456, 789, 1011, 1213),
    reference="grpo",
)
SUITES = {MINI.name: MINI}

# The main job (`make run`, `python -m launch.experiments.sweep quick`): GRPO vs GiGPO vs HGPO K=2 on
# ALFWorld-mini, the suite's first seed. These are the very runs (same commands, same
# directories) of those cells of the full `mini` table, so the full sweep reuses them.
QUICK_ENVS = ("alfworld_mini",)
QUICK_METHODS = ("grpo", "gigpo", "hgpo_k2")


def quick_suite(suite: Suite = MINI) -> Suite:
  """`suite` cut down to the main job's cells (its name stays: the run directories)."""
  return dataclasses.replace(
      suite, environments=tuple(suite.env(e) for e in QUICK_ENVS),
      methods=tuple(suite.method(m) for m in QUICK_METHODS), seeds=suite.seeds[:1],
      description=suite.description + "; quick version: one seed, three methods")


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
  """The locked config of one run, as launch.main would build it from the command line."""
  module = importlib.import_module(env.config[:-len(".py")].replace("/", "."))
  c = module.get_config(variant(env, method))
  with c.unlocked():
    c.seed = seed
  c.update_from_flattened_dict(dict(overrides(env, method)))
  return c


def pending_reason(env: Environment, method: Method) -> str | None:
  """Why the cell is not run: outside the column's methods (budget), or the config or the
  trainer's validation refuses it."""
  if env.methods and method.name not in env.methods:
    return f"outside this column's budget (it runs {', '.join(env.methods)})"
  from hgpo_jax import train
  try:
    config = build_config(env, method, 0)
    train.validate(config)
  except (train.ConfigError, ValueError, KeyError, TypeError, AttributeError) as e:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
  return None


def command(root: str, suite: Suite, env: Environment, method: Method, seed: int,
            python: str = "python") -> list[str]:
  module = "launch.evaluate" if method.kind == PROMPTED else "launch.main"
  cmd = [python, "-m", module, f"--config={env.config}:{variant(env, method)}",
         f"--workdir={run_dir(root, suite, env.name, method.name, seed)}",
         f"--config.seed={seed}"]
  cmd += [f"--config.{k}={format_value(v)}" for k, v in overrides(env, method).items()]
  return cmd


if __name__ == "__main__":
  raise SystemExit("launch.experiments.suites defines the suites that `python -m launch.experiments.sweep suite "
                   "--suite NAME` runs and `... render` tabulates; run that (--help).")
