r"""Search: question answering with a search tool (Search-R1's task as verl-agent's Search
environment; env_servers/search).

Variants (argument string after the colon):
  algo=grpo|rloo|gigpo|hgpo|...   estimator (default gigpo: the published search script's)
  k=4                              memory window H (the script's env.history_length; HGPO's K)
  model=tiny|smollm2-135m|qwen2.5-1.5b|qwen2.5-7b|...
  listed                           the CPU-scale variant: the env lists candidate searches
                                   and answers, decoding is constrained to them
  smoke                            seconds-scale run for tests (implies listed)
  local                            sized for a 2-core CPU (implies listed)

Paper setting: verl-agent's examples/gigpo_trainer/run_search.sh (repository
zzj1111/alfworldauto, as the other configs; GiGPO with Qwen2.5-7B-Instruct), each value
below with its source. On a pod, with Search-R1's files (docs/environments.md, Search):
  python -m launch.main --config=configs/search.py:model=qwen2.5-7b \
      --config.model.path=/models/Qwen2.5-7B-Instruct \
      --config.env.args.data_dir=/data/searchr1 --config.env.args.corpus=/data/wiki-18.jsonl \
      --workdir=/tmp/search_gigpo
Published (verl-agent README, Search-QA average exact match over seven QA sets, with an E5
dense retriever over wiki-18): GiGPO 42.1 (Qwen2.5-3B-Instruct), 47.2 (Qwen2.5-7B-Instruct).
Retrieval is BM25 unless `env.args.retriever_model` names an encoder directory (Search-R1's
E5 for its setting: dense retrieval, docs/environments.md), and without Search-R1's files
the questions are the synthetic set: numbers are then not comparable.

CPU smoke run (tiny random policy, listed actions, 2 iterations):
  python -m launch.main --config=configs/search.py:smoke --workdir=/tmp/search_smoke
"""

from __future__ import annotations

from configs import common


def get_config(arg: str | None = None):
  a = common.parse_arg(arg, algo="gigpo", k=4, model="smollm2-135m", listed=False,
                       smoke=False, local=False, dynamic=False, gspo=False)
  if a.model not in common.MODELS:
    raise ValueError(f"unknown model {a.model!r}; choose one of {common.MODELS}")
  if a.algo == "hiper":
    raise ValueError("algo=hiper has no search setting (HiPER's <switch>/<subgoal>/<action> "
                     "format has no <search>/<answer> form); choose another algo")
  c = common.base_config()
  c.model.name = a.model

  c.env.name = "search"
  listed = a.listed or a.smoke or a.local
  c.env.args = common.ml_collections.ConfigDict({
      "data_dir": "",  # "" = the shipped synthetic set; else Search-R1's question files
      "corpus": "",  # "" = data_dir/corpus.jsonl; Search-R1's wiki-18.jsonl
      # "" = BM25 inside each env server; "local" = one env_servers.retriever process the
      # trainer starts beside its env servers (restarted if it dies); host:port = a running one
      "retriever": "",
      # an encoder directory (E5: intfloat/e5-base-v2, Search-R1's retriever): dense
      # retrieval with faiss instead of BM25, in process or in the "local" retriever
      "retriever_model": "",
      "topk": 3,  # passages per search (verl-agent SearchToolGroup topk=3; Search-R1 topk 3)
      "actions": "listed" if listed else "free",  # free text is the published setting
      "max_candidates": 12,  # listed actions: at most this many searches and answers each
  })
  c.env.max_steps = 4  # run_search.sh env.max_steps=4 (also the env's own turn limit)
  c.env.train_split = "train"
  c.env.eval_splits = ("test",)
  history = common.history_reference(a.k)  # run_search.sh env.history_length=4
  c.rollout.history_length = history
  c.rollout.num_groups = 256  # run_search.sh train_data_size=256
  c.rollout.group_size = 5  # run_search.sh group_size=5 (env.rollout.n)
  c.rollout.max_prompt_tokens = 4096  # run_search.sh data.max_prompt_length=4096
  c.rollout.max_new_tokens = 512  # run_search.sh data.max_response_length=512
  c.rollout.invalid_penalty = 0.01  # run_search.sh invalid_action_penalty_coef=0.01
  c.rollout.constrained = listed

  c.algo.name = a.algo
  c.algo.gamma = 0.95  # run_search.sh algorithm.gamma=0.95
  # run_search.sh mode=mean_std_norm (GRPO keeps the yaml's std normalisation too)
  c.algo.options = common.algo_options(a.algo, k=history, norm="mean_std")
  if a.algo == "gigpo":
    c.algo.options.omega = 1.0  # run_search.sh algorithm.gigpo.step_advantage_w=1.0
    c.algo.options.enable_similarity = True  # run_search.sh enable_similarity=True
    c.algo.options.similarity_thresh = 0.9  # run_search.sh similarity_thresh=0.9

  c.train.lr = 1e-6  # run_search.sh actor.optim.lr=1e-6
  c.train.warmup_ratio = 0.1  # run_search.sh lr_warmup_steps_ratio=0.1 (constant after it)
  c.train.mini_batch_rows = 512  # run_search.sh ppo_mini_batch_size=512
  c.train.loss_unit_rows = 16  # run_search.sh ppo_micro_batch_size_per_gpu=16
  c.train.micro_batch_rows = 16  # memory only
  c.train.use_kl_loss = True  # run_search.sh use_kl_loss=True
  c.train.kl_coef = 0.001  # run_search.sh kl_loss_coef=0.001
  c.train.kl_estimator = "k3"  # run_search.sh kl_loss_type=low_var_kl
  c.train.entropy_coeff = 0.0  # run_search.sh entropy_coeff=0
  # run_search.sh trainer.total_epochs=1: one pass over the train file in batches of 256
  # (verl drops the last partial batch). 662 = 169,615 // 256, the NQ + HotpotQA train
  # questions of Search-R1's train.parquet as Search-R1 describes them; set it from your
  # file's row count.
  c.train.num_iterations = 662
  c.eval.every = 50  # run_search.sh trainer.test_freq=50
  c.eval.temperature = 0.0  # greedy: the yaml's val_kwargs (temperature 0, do_sample False)
  c.eval.num_tasks = 512  # run_search.sh val_data_size=512
  c.checkpoint.every = 50  # run_search.sh trainer.save_freq=50
  c = common.finish(c, a, "search")
  if a.smoke or a.local:
    # Room for `<action><search>Two Names</search></action>` (~30 tokens of the tiny
    # tokenizer; the sizes' 16/32 fit none); longer listed actions (the question) drop out.
    c.rollout.max_new_tokens = 64
  return c
