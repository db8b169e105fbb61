r"""Text Sokoban (env_servers/sokoban: seeded procedural rooms, solvable by construction).

A fast, cheap environment (thousands of steps/s) for curriculum, debugging and the
end-to-end tests; not one of the papers' benchmarks.

Variants: algo=..., k=2, model=tiny|smollm2-135m|..., dim=6, boxes=1, smoke
  python -m launch.main --config=configs/sokoban.py:algo=gigpo,model=tiny,smoke --workdir=/tmp/sok
"""

from configs import common


def get_config(arg: str | None = None):
  a = common.parse_arg(arg, algo="hgpo", k=2, model="smollm2-135m", dim=6, boxes=1,
                       smoke=False)
  if a.model not in common.MODELS:
    raise ValueError(f"unknown model {a.model!r}; choose one of {common.MODELS}")
  c = common.base_config()
  c.model.name = a.model
  c.env.name = "sokoban"
  c.env.args = common.ml_collections.ConfigDict({"dim": a.dim, "num_boxes": a.boxes})
  c.env.max_steps = 20
  c.env.train_split = "train"
  c.env.eval_splits = ("test",)
  history = common.history_reference(a.k)  # H = HGPO K: one value (docs/algorithms.md §6)
  c.rollout.history_length = history
  c.rollout.fallback_chars = 10
  c.rollout.max_prompt_tokens = 1024
  c.rollout.max_new_tokens = 64
  c.rollout.constrained = True
  c.algo.name = a.algo
  c.algo.options = common.family_options(a.algo, k=history, norm="mean_std")
  c.train.lr = 1e-5
  c.train.mini_batch_rows = 32
  c.train.micro_batch_rows = 8
  c.train.num_iterations = 20
  c.eval.num_tasks = 32
  if a.smoke:
    common.apply_smoke(c)
  c.lock()
  return c
