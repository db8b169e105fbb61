"""The PPO actor update and its bookkeeping.

Modules: `losses` (PPO-clip / dual clip, k3 KL, entropy, aggregation modes),
`train_batch` (the token-level batch and its host builder), `train_step` (TrainState,
Learner: sharded init, old/reference log-probs, donated micro-batched update),
`checkpoint` (Orbax checkpoints, retention, resume precedence), `metrics`
(the metric writers: JSONL, TensorBoard, Weights & Biases; console line), `run_records` (the one reader of run
directories: metrics, per-task outcomes, finished runs, the suite and grid layouts) and `plan` (per-device memory and FLOPs of
the compiled programs on a mesh, for `launch.plan`).
"""
