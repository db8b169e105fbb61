"""Worker of the multi-process trainer test: the real trainer on the Sokoban smoke config.

Run as `python multiprocess_trainer_worker.py WORKDIR NUM_PROCESSES PROCESS_ID PORT LOCAL_DEVICES
[ROLLOUT_DEVICES [MAX_STALENESS]]` (split placement: each process's last ROLLOUT_DEVICES
devices for its sampler; train.max_staleness).
With NUM_PROCESSES == 1 it is the single-process reference (no jax.distributed). Every
process of a run gets the same WORKDIR (Orbax writes one checkpoint from all processes;
process 0 writes metrics.jsonl and the rollout dumps) and starts its own Sokoban env server.
"""

import os
import sys
import traceback

if __name__ == "__main__":  # before JAX initialises: this process's own device count
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             f" --xla_force_host_platform_device_count={sys.argv[5]}").strip()
  from hgpo_jax import runtime  # noqa: E402

  runtime.pin_cpu_isa()  # as tests/conftest.py
  runtime.enable_compilation_cache()

import jax  # noqa: E402

from configs import sokoban  # noqa: E402
from hgpo_jax import train  # noqa: E402
from hgpo_jax.training import experiment  # noqa: E402


def config(rollout_devices: int = 0, max_staleness: int = 0):
  """Two iterations of HGPO on text Sokoban, tiny model, greedy rollouts, 2x2x2 mesh."""
  c = sokoban.get_config("algo=hgpo,k=2,smoke")
  with c.unlocked():
    c.rollout.temperature = 0.0
    c.eval.at_end = False
    c.rollout.dump = True  # process 0 writes all processes' rows
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 2, 2, 2
    c.mesh.rollout_devices = rollout_devices
    c.train.max_staleness = max_staleness
  return c


def main(workdir, num_processes, process_id, port, rollout_devices=0, max_staleness=0):
  if num_processes > 1:
    # CPU collectives across processes need gloo (the default implementation is none).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=num_processes,
                               process_id=process_id, initialization_timeout=120)
  assert jax.device_count() == 8 + num_processes * rollout_devices, jax.devices()
  train.train_and_evaluate(experiment.from_config(config(rollout_devices, max_staleness)),
                           workdir)
  if num_processes > 1:
    jax.distributed.shutdown()


if __name__ == "__main__":
  a = sys.argv[1:]
  try:
    main(a[0], int(a[1]), int(a[2]), int(a[3]), *[int(x) for x in a[5:]])
  except BaseException:  # noqa: BLE001  (exit now: a normal exit would wait for the other process)
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)
