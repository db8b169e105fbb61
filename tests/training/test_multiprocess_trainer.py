"""The real trainer in two JAX processes x 4 CPU devices == one process x 8 devices; with
the rollout one batch ahead (`train.max_staleness=1`) two processes x 4 devices, and two
processes x 6 devices with each process's sampler on 2 of them (split placement), == one
process x 8 devices; two processes SIGKILLed during their second iteration resume to
the uninterrupted run.

Each process starts its own Sokoban env server and plays one of the two groups
(docs/scaling.md "Several processes"); all runs use the same 2x2x2 mesh and greedy
rollouts. Sampling at temperature > 0 cannot be compared: the sampler keys a row by
its position in the step's batch, and a process's batch holds only its own slots.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import checkpoint_arrays
from hgpo_jax.training import run_records

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_trainer_worker.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 1200  # per run: 1.5-2 min each on a lightly loaded 2-core machine, 10+ when busy


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env():
  env = dict(os.environ)
  env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
  # The worker sets its own device count; other flags (e.g. eigen threading) carry over.
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if "xla_force_host_platform_device_count" not in f)
  return env


def _run(workdir: str, num_processes: int, local_devices: int, logdir, kill_when=None,
         name: str = "", rollout_devices: int = 0, max_staleness: int = 0) -> None:
  """Runs the worker in `num_processes` processes; kills every process group it started
  (workers and their env servers) on failure or timeout, or, with `kill_when`, as soon as
  `kill_when()` is true (the workers must still be running then)."""
  port = _free_port() if num_processes > 1 else 0
  procs, logs = [], []
  killed = False
  try:
    for i in range(num_processes):
      log = open(logdir / f"worker_{num_processes}_{i}{name}.log", "w+", encoding="utf-8")
      logs.append(log)
      procs.append(subprocess.Popen(
          [sys.executable, WORKER, workdir, str(num_processes), str(i), str(port), str(local_devices),
           str(rollout_devices), str(max_staleness)],
          env=_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + TIMEOUT_S
    while any(p.poll() is None for p in procs):
      if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
        break
      if kill_when is not None and kill_when():
        for p in procs:  # SIGKILL: no atexit, no checkpoint wait, no server shutdown
          os.killpg(p.pid, signal.SIGKILL)
        killed = True
        break
      time.sleep(1 if kill_when is None else 0.05)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
  for i, (p, log) in enumerate(zip(procs, logs)):
    log.seek(0)
    tail = log.read()[-3000:]
    log.close()
    if killed:
      assert p.returncode == -signal.SIGKILL, f"process {i} ended before the kill:\n{tail}"
      continue
    assert p.returncode == 0, f"process {i}/{num_processes} (rc {p.returncode}):\n{tail}"


def _final_state(workdir: str) -> dict[str, np.ndarray]:
  """The last checkpoint's (step 2) state as numpy, keyed by tree path."""
  return checkpoint_arrays.state_arrays(workdir, 2)


# The two runs reduce gradients in another order (gloo across processes), so their states
# are equal only up to round-off, which Adam can amplify on coordinates whose gradient is
# near zero (it divides by sqrt(v)): the situation of tests/training/test_train_step.py::
# test_sharded_update_equals_single_device, bounded the same way. A per-coordinate bound
# of ~lr cannot tell a wrong gradient from round-off (one AdamW step moves every
# coordinate by about lr whatever the gradient's size), so each parameter leaf's distance
# between the runs is compared with how far that leaf travelled in iteration 2 (plus one
# float32 ulp per coordinate of the leaf's values: a norm weight of ~1 stored after an
# update of ~1e-5 rounds to the ulp of 1), and each Adam moment (mu, nu) leaf with its
# own size. Measured on the 2-core AMD EPYC (the ratios printed from this test's
# checkpoints): distance / travelled at most 4.1e-5 (the attention norm's 3.3e-4 is that
# ulp), moment distance / size at most 1.4e-5, against an old per-coordinate tolerance of
# 2 x lr x updates = 4e-4 that exceeded the largest coordinate difference (1.2e-7) 3000x.
# A gradient of one leaf scaled by 1.5 or one Adam moment scaled by 1.01 in the
# two-process run is a relative error of O(1e-2) or more and fails these bounds.
PARAMS_REL = 1e-3
MOMENTS_REL = 1e-3


def _assert_same_state(sa, sb, sa_before):
  """Final states `sa` (one process) and `sb` (two) agree leaf by leaf: parameters within
  PARAMS_REL of the distance each leaf travelled since `sa_before` (step 1 of `sa`'s run)
  plus one float32 ulp per coordinate, Adam moments within MOMENTS_REL of their norm,
  integers (step, counts) exactly."""
  assert sorted(sa) == sorted(sb) == sorted(sa_before)
  norm = lambda x: float(np.sqrt(np.sum(np.square(np.asarray(x, np.float64)))))
  kinds = {"params": [], "moments": [], "exact": []}
  for k in sa:
    if k.startswith(("['params']", "['sampler_versions']")):  # (the weights of a batch ahead)
      kinds["params"].append(k)
    elif k.startswith("['opt_state']") and np.issubdtype(sa[k].dtype, np.floating):
      kinds["moments"].append(k)
    else:
      kinds["exact"].append(k)
  assert kinds["params"] and kinds["exact"], kinds
  assert {"mu", "nu"} <= {part for k in kinds["moments"] for part in ("mu", "nu")
                          if f"['{part}']" in k}, kinds["moments"]
  for k in kinds["exact"]:
    np.testing.assert_array_equal(sb[k], sa[k], err_msg=k)
  for k in kinds["moments"]:
    size = norm(sa[k])
    assert size > 0, k
    distance = norm(sb[k] - sa[k])
    assert distance <= MOMENTS_REL * size, (k, distance, size)
  for k in kinds["params"]:
    travelled = norm(sa[k] - sa_before[k])
    assert travelled > 0, k  # every leaf moved (AdamW's weight decay at least): not vacuous
    ulp = norm(np.spacing(np.abs(sa[k]).astype(np.float32)))
    distance = norm(sb[k] - sa[k])
    assert distance <= PARAMS_REL * travelled + ulp, (k, distance, travelled, ulp)


@pytest.mark.slow
def test_two_process_trainer_equals_one_process(tmp_path):
  two, one = str(tmp_path / "two"), str(tmp_path / "one")
  _run(two, 2, 4, tmp_path)
  _run(one, 1, 8, tmp_path)

  _assert_same_run(one, two)

  # The rollout one batch ahead of the update (each process's thread plays its own groups,
  # the learner gathers them), on shared devices and with split placement (each process's
  # sampler on 2 devices of its own, the 2x2x2 training mesh over the other 4 of each
  # process; weights gathered on a process's training devices, then moved to its
  # sampler's): both the one-process run's.
  one_ahead = str(tmp_path / "one_ahead")
  _run(one_ahead, 1, 8, tmp_path, name="_ahead", max_staleness=1)
  for name, devices, rollout_devices in (("two_ahead", 4, 0), ("split_ahead", 6, 2)):
    _run(str(tmp_path / name), 2, devices, tmp_path, name=f"_{name}",
         rollout_devices=rollout_devices, max_staleness=1)
    _assert_same_run(one_ahead, str(tmp_path / name))
  assert [x["async/staleness"] for x in run_records.read_metrics(one_ahead)] == [0.0, 1.0]

  # The same two-process run, SIGKILLed (both workers and their env servers) as soon as
  # step 1's checkpoint is committed (Orbax renames its temporary directory to "1" on
  # commit), i.e. during iteration 2, then started again on the same workdir: it resumes
  # from step 1 and ends where the uninterrupted run ended (same program, same processes:
  # equal, not close).
  killed = str(tmp_path / "killed")
  _run(killed, 2, 4, tmp_path, name="_killed",
       kill_when=lambda: os.path.isdir(os.path.join(killed, "checkpoints", "1")))
  assert not os.path.isdir(os.path.join(killed, "checkpoints", "2"))
  _run(killed, 2, 4, tmp_path, name="_resumed")
  b, c = run_records.read_metrics(two), run_records.read_metrics(killed)
  assert [l["step"] for l in c] == [1, 2]  # none lost, none duplicated
  for x, y in zip(b, c):
    assert sorted(x) == sorted(y)
    for key in x:
      if key.startswith(("time/", "perf/")) and key.endswith(("_s", "_flop_per_s", "_mfu")):
        continue
      assert y[key] == x[key], key
  sb, sc = _final_state(two), _final_state(killed)
  assert sorted(sc) == sorted(sb)
  for k in sb:
    np.testing.assert_array_equal(sc[k], sb[k], err_msg=k)


def _assert_same_run(one: str, two: str) -> None:
  """The run in `two` (two processes) is the one-process run in `one`: metrics (reductions
  across processes within round-off), rollouts, final state (`_assert_same_state`)."""
  a = run_records.read_metrics(one)
  b = run_records.read_metrics(two)
  assert [l["step"] for l in a] == [l["step"] for l in b] == [1, 2]  # process 0 wrote once
  for x, y in zip(a, b):
    assert sorted(x) == sorted(k for k in y if k != "time/weight_transfer_s")
    assert x["rollout/num_rows"] >= 4 and "groups/level0_mean_size" in x  # 4 trajectories
    for key in x:
      if key.startswith(("time/", "perf/", "async/")) and key.endswith(
          ("_s", "_flop_per_s", "_mfu")):
        continue  # wall-clock times and rates
      if key.startswith(("train/", "rollout_corr/")):
        # Cross-process gloo all-reduces sum in another order than one process: rounding
        # of ~1e-7 relative per gradient/log-prob, amplified only in near-cancelling
        # differences (kl ~1e-4 = a difference of log-probs; the sampler/learner mismatch
        # statistics, ~1e-7, are such differences) -- the tolerance of
        # tests/test_train.py::test_sharded_equals_unsharded.
        assert y[key] == pytest.approx(x[key], rel=1e-3, abs=1e-5), key
      else:  # rollout/, groups/, advantage/, env/, FLOP counts: the same host computation
        assert y[key] == x[key], key

  # All rows of both processes, renumbered to global groups/slots, in one process's order.
  for name in ("iter_000000.jsonl", "iter_000001.jsonl"):
    with open(os.path.join(one, "rollouts", name)) as f1, open(os.path.join(two, "rollouts", name)) as f2:
      r1, r2 = [json.loads(l) for l in f1], [json.loads(l) for l in f2]
    assert r1 == r2 and {r["group"] for r in r1} == {0, 1}

  # Final parameters and Adam moments (the bounds above), step and counts exactly.
  _assert_same_state(_final_state(one), _final_state(two), checkpoint_arrays.state_arrays(one, 1))
