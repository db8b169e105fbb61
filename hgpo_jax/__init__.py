"""hgpo_jax: JAX-native reinforcement learning for long-horizon LLM agents.

Subpackages:
  advantages  step-level advantage estimators (grpo, rloo, gigpo, hgpo, hae, gae)
  models      Flax NNX decoders (Llama / Qwen2 / Qwen3 families), weights, tokenizers
  sampling    jit KV-cache sampler
  envs        gRPC client pool and local launcher for the env servers in env_servers/
  rollout     step-wise rollouts: tasks, memory/prompts, action projection
  training    PPO-clip/KL/entropy loss, sharded train step, checkpoints, metrics
  cost        FLOPs, memory traffic, launches, device peaks, compiled plans for a mesh
"""

from hgpo_jax import runtime as _runtime

__version__ = "0.1.0"

# Before JAX starts its backends: on a host without TPU chips the libtpu wheel (installed for
# the topology compiles) would otherwise start up at the first device query or compile and
# print its errors; a host with TPUs, or an explicit JAX_PLATFORMS, is left as it is.
_runtime.select_platforms()
