"""Worker of the multi-process test: one PPO update of the tiny model on a global 8-device mesh.

Run as `python two_process_worker.py OUT NUM_PROCESSES PROCESS_ID PORT LOCAL_DEVICES`.
With NUM_PROCESSES == 1 it is the single-process reference (no jax.distributed).
Process 0 writes the final parameters (gathered to the host) to OUT as .npz.
"""

import os
import sys


def main(out, num_processes, process_id, port, local_devices):
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
  import jax  # after the env vars on purpose
  if num_processes > 1:
    # CPU collectives across processes need gloo (the default implementation is none).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
  import numpy as np
  from flax import nnx
  from jax.experimental import multihost_utils

  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import decoder, sharding
  from hgpo_jax.training import packing, train_batch, train_step

  assert jax.device_count() == 8, jax.devices()
  cfg = model_config.get_preset("tiny").replace(num_layers=1, vocab_size=64, mlp_dim=64)
  model = decoder.Decoder(cfg, rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh(data=4, fsdp=2, tensor=1)
  learner = train_step.Learner(model, mesh, train_step.UpdateConfig(lr=1e-3, mini_batch_rows=16, micro_batch_rows=8))
  state = learner.init_state(nnx.state(model, nnx.Param))
  ref = learner.reference_params(state)
  rng = np.random.default_rng(0)
  prompts = [rng.integers(1, 64, rng.integers(1, 7)).tolist() for _ in range(16)]
  responses = [rng.integers(1, 64, rng.integers(1, 9)).tolist() for _ in range(16)]
  host, _ = train_batch.build_train_batch(prompts, responses, rng.normal(size=16).astype(np.float32),
                                          prompt_buckets=[8], response_buckets=[8], row_multiple=16)
  # as the trainer does: laid out and filled on the mesh, read there by the update
  batches = train_step.fill_logprobs(learner, state.params, ref,
                                     packing.plain_batch(host, mini_batch_rows=16))
  state, metrics = train_step.train_iteration(learner, state, batches)
  params = multihost_utils.process_allgather(state.params, tiled=True)
  if jax.process_index() == 0:
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    flat["loss"] = np.asarray(metrics["loss"])
    np.savez(out, **flat)
  if num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  a = sys.argv[1:]
  main(a[0], int(a[1]), int(a[2]), int(a[3]), int(a[4]))
