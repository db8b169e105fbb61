r"""Text Sokoban (env_servers/sokoban: seeded procedural rooms, solvable by construction).

A fast, cheap environment (thousands of steps/s: `python -m launch.benchmarks.env_grpc
--env sokoban`, docs/performance.md) for curriculum, debugging and the end-to-end tests;
not one of the papers' benchmarks.

Variants: algo=..., k=2, model=tiny|smollm2-135m|..., dim=6, boxes=1, levels=0 (the train
split's first N levels; 0: all 1000), smoke
  python -m launch.main --config=configs/sokoban.py:algo=gigpo,model=tiny,smoke --workdir=/tmp/sok

algo=ppo / algo=hiper: PPO with a critic and HiPER as in configs/alfworld.py (128 ungrouped
tasks, critic lr 1e-5, cliprange_value 0.5). No script exists for Sokoban: the mini-batch
stays this file's 32 rows, and HiPER uses its ALFWorld values (hgpo_jax/advantages/hae.py
PUBLISHED_SETTINGS).
"""

from __future__ import annotations

from configs import common


def get_config(arg: str | None = None):
  a = common.parse_arg(arg, algo="hgpo", k=2, model="smollm2-135m", dim=6, boxes=1,
                       levels=0, smoke=False, dynamic=False, gspo=False)
  if a.model not in common.MODELS:
    raise ValueError(f"unknown model {a.model!r}; choose one of {common.MODELS}")
  c = common.base_config()
  c.model.name = a.model
  c.env.name = "sokoban"
  c.env.args = common.ml_collections.ConfigDict({"dim": a.dim, "num_boxes": a.boxes,
                                                 "train_levels": a.levels})
  c.env.max_steps = 20
  c.env.train_split = "train"
  c.env.eval_splits = ("test",)
  history = common.history_reference(a.k)  # H = HGPO K: one value (docs/algorithms.md §6)
  c.rollout.history_length = history
  c.rollout.fallback_chars = 10
  c.rollout.max_prompt_tokens = 1024
  c.rollout.max_new_tokens = 64
  c.rollout.constrained = True
  c.algo.name = a.algo  # algo=ppo / algo=hiper: replaced by common.apply_critic_algo
  c.algo.options = common.algo_options(a.algo, k=history, norm="mean_std")
  c.train.lr = 1e-5
  c.train.mini_batch_rows = 32
  c.train.micro_batch_rows = 8
  c.train.num_iterations = 20
  c.eval.num_tasks = 32
  return common.finish(c, a, "sokoban")
