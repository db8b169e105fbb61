"""The trainer's set-up, its PPO actor update and its bookkeeping.

Modules: `experiment` (the run's typed, checked settings: one frozen tree converted once
from the user's ConfigDict), `run` (the live objects of a run), `programs` (every jitted
program of an experiment), `losses` (PPO-clip / dual clip, KL estimators, entropy,
aggregation modes), `train_batch` (the token-level batch and its host builder),
`train_step` (TrainState, Learner: sharded init, old/reference log-probs, donated
micro-batched update), `critic_step` (the value model's learner), `packing` (packed
and length-grouped update layouts), `processes` (host data across processes), `update_targets` and `value_targets` (advantages and critic
targets of a rollout), `async_rollout` (rollouts played ahead of the update),
`evaluation`, `checkpoint` (Orbax checkpoints, retention, resume precedence), `metrics`
(the metric writers: JSONL, TensorBoard, Weights & Biases; console line) and
`run_records` (the one reader of run directories: metrics, per-task outcomes, finished
runs, the suite and grid layouts).
"""
