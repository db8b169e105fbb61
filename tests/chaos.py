r"""Fault injection: the real trainer under injected faults ends exactly like an undisturbed run.

  python -m tests.chaos [--seed 0] [--iterations 3] [--workdir /tmp/chaos] [--reduced]

Runs `launch.main` on the Sokoban smoke config (tiny model, 2 groups x 2 trajectories,
3 steps) twice, each run in fresh processes with the same seed:

1. the reference: one uninterrupted process;
2. the chaos run: the same training, restarted after every trainer kill, with faults
   injected at points drawn from `--seed`:
   * SIGKILL or SIGSTOP (a hang) of the pool's env server right before a Reset or Step
     reaches it (most Reset/Step calls of every segment; at least 20 in the full run);
   * SIGKILL of the trainer during a rollout (at a Step call), during the update (a timer
     inside `train_iteration`) and during an asynchronous checkpoint save (right after
     `Checkpointer.save` returned, while Orbax writes in the background), each followed
     by a restart in the same workdir;
   * a corrupt latest checkpoint (garbage in its array files) and a partially written
     one (its array files cut to half) before a restart;
   * a workdir that becomes unwritable (the metrics write raises EROFS, simulated) and a
     restart once it is writable again;
   * a remote env endpoint (a server the pool does not own) that is killed and comes
     back on the same port.

Then it checks that the chaos run's `metrics.jsonl` has every step exactly once and
equals the reference bit for bit apart from `time/*`, `perf/*` (timings) and the fault
counters `env/*`, that no env server outlived its trainer (processes tagged through the
environment, found in /proc), and prints the table faults injected / survived / metrics
equal / orphans. Exit status 0 iff everything held.

The faults are injected inside the trainer process by wrapping a few library functions
(`EnvPool._call`, `train_step.train_iteration`, `Checkpointer.save`,
`MetricsWriter.write`) before `launch.main` runs; the trainer code itself is unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import os
import pathlib
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONFIG = "configs/sokoban.py:smoke,model=tiny"
TAG_ENV = "HGPO_CHAOS_TAG"
# Differences allowed between the runs: wall-clock timings (and throughputs derived
# from them) and the fault counters.
IGNORED_PREFIXES = ("time/", "perf/", "env/")  # perf/*: throughput from timings


# ------------------------------------------------------------------ the trainer side
def _child(plan_path: str, argv: list[str]) -> None:
  """Runs launch.main in this process with the faults of the plan wired in."""
  with open(plan_path, encoding="utf-8") as f:
    plan = json.load(f)
  rng = random.Random(plan["seed"])
  events = open(plan["events"], "a", encoding="utf-8")

  def event(kind: str, **info) -> None:
    events.write(json.dumps({"fault": kind, **info}) + "\n")
    events.flush()
    os.fsync(events.fileno())

  def die(kind: str, **info) -> None:
    event(kind, **info)
    os.kill(os.getpid(), signal.SIGKILL)

  from hgpo_jax.envs import launcher
  from hgpo_jax.envs import pool as pool_lib

  remote = {}
  if plan.get("endpoint_flap_call") is not None:
    # The "remote" endpoint: a server this process starts itself, so the pool does not
    # own it (it waits for it with backoff instead of restarting it).
    proc = launcher.ServerProcess("sokoban", 4, {"dim": 6, "num_boxes": 1, "max_steps": 3})
    remote["proc"] = proc
    endpoint = proc.wait_ready()
    from hgpo_jax import train
    original_train = train.train_and_evaluate

    def train_on_endpoint(config, workdir):
      config.env.endpoints = (endpoint,)  # tuple fields have no --config.* override flag
      return original_train(config, workdir)

    train.train_and_evaluate = train_on_endpoint
    original_init = pool_lib.EnvPool.__init__

    def patient_init(self, *args, **kwargs):
      kwargs["max_retries"] = 8  # backoff 0.5 s doubling: up to ~2 min for the comeback
      original_init(self, *args, **kwargs)

    pool_lib.EnvPool.__init__ = patient_init

  calls = {"n": 0}
  original_call = pool_lib.EnvPool._call

  def call(self, server, method, request, replay):
    if method in ("Reset", "Step"):
      n = calls["n"]
      calls["n"] += 1
      if method == "Step" and n >= plan.get("kill_rollout_call", float("inf")):
        die("trainer_sigkill_rollout", call=n)
      if n == plan.get("endpoint_flap_call"):
        old = remote["proc"]
        old.kill()
        event("endpoint_flap", call=n, method=method)
        remote["proc"] = launcher.ServerProcess("sokoban", 4, {"dim": 6, "num_boxes": 1,
                                                               "max_steps": 3}, port=old.port)
      elif server.process is not None and rng.random() < plan["env_fault_rate"]:
        sig = rng.choice([signal.SIGKILL, signal.SIGSTOP])
        pid = server.process.pid
        os.kill(pid, sig)
        _wait_for_state(pid, ("T", "Z", "gone"))
        event("env_" + sig.name.lower(), call=n, method=method)
    return original_call(self, server, method, request, replay)

  pool_lib.EnvPool._call = call

  from hgpo_jax.training import checkpoint as checkpoint_lib
  from hgpo_jax.training import metrics as metrics_lib
  from hgpo_jax.training import train_step

  if plan.get("kill_update"):
    original_update = train_step.train_iteration

    def update(*args, **kwargs):
      delay = rng.uniform(0.0, 0.5)
      timer = threading.Timer(delay, die, ("trainer_sigkill_update",), {"delay_s": delay})
      timer.start()
      out = original_update(*args, **kwargs)
      jax_block(out)
      timer.cancel()
      die("trainer_sigkill_update", delay_s=delay, finished=True)
      return out

    train_step.train_iteration = update

  if plan.get("kill_save_step") is not None:
    original_save = checkpoint_lib.Checkpointer.save

    def save(self, step, *args, **kwargs):
      started = original_save(self, step, *args, **kwargs)
      if step == plan["kill_save_step"]:
        die("trainer_sigkill_async_save", step=step)
      return started

    checkpoint_lib.Checkpointer.save = save

  if plan.get("unwritable_at_write") is not None:
    original_write = metrics_lib.MetricsWriter.write
    writes = {"n": 0}

    def write(self, step, metrics):
      writes["n"] += 1
      if writes["n"] == plan["unwritable_at_write"]:
        event("unwritable_workdir", step=step)
        raise OSError(errno.EROFS, "Read-only file system (simulated by tests.chaos)",
                      self.jsonl_path)
      return original_write(self, step, metrics)

    metrics_lib.MetricsWriter.write = write

  from absl import app
  from launch import main as main_lib
  try:
    app.run(main_lib.main, argv=[sys.argv[0]] + argv, flags_parser=main_lib.parse_flags)
  finally:
    if "proc" in remote:
      remote["proc"].stop()


def jax_block(tree) -> None:
  import jax
  jax.block_until_ready(tree)


def _wait_for_state(pid: int, states, timeout_s: float = 5.0) -> None:
  deadline = time.monotonic() + timeout_s
  while _proc_state(pid) not in states and time.monotonic() < deadline:
    time.sleep(0.005)


def _proc_state(pid: int) -> str:
  try:
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
      return f.read().rsplit(")", 1)[-1].split()[0]
  except (FileNotFoundError, ProcessLookupError):
    return "gone"


# ------------------------------------------------------------------ the harness side
def tagged_processes(tag: str) -> list[int]:
  """Live (non-zombie) processes whose environment carries `HGPO_CHAOS_TAG=tag`."""
  out = []
  needle = f"{TAG_ENV}={tag}".encode()
  for name in os.listdir("/proc"):
    if not name.isdigit() or int(name) == os.getpid():
      continue
    try:
      with open(f"/proc/{name}/environ", "rb") as f:
        if needle not in f.read().split(b"\0"):
          continue
    except OSError:
      continue
    if _proc_state(int(name)) not in ("Z", "gone"):
      out.append(int(name))
  return out


@dataclasses.dataclass
class Segment:
  """One trainer process of the chaos run and what to do before it starts."""
  name: str
  plan: dict
  before: str = ""  # "corrupt" | "partial": damage the latest checkpoint first
  expect: str = "killed"  # "killed" | "error" | "done"


class Harness:
  """Runs the reference and the chaos run and compares them."""

  def __init__(self, workdir: str, seed: int, iterations: int, reduced: bool):
    self.workdir = pathlib.Path(workdir)
    self.seed, self.iterations, self.reduced = seed, iterations, reduced
    self.tag = uuid.uuid4().hex
    self.rng = random.Random(seed)
    self.log: list[str] = []

  def flags(self, workdir: pathlib.Path) -> list[str]:
    return [f"--config={CONFIG}", f"--workdir={workdir}", "--config.eval.at_end=false",
            f"--config.train.num_iterations={self.iterations}", "--config.env.deadline_s=3",
            f"--config.seed={self.seed}"]

  def run_trainer(self, workdir: pathlib.Path, plan: dict | None, name: str) -> int:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    env[TAG_ENV] = self.tag
    if plan is None:
      cmd = [sys.executable, "-m", "launch.main", *self.flags(workdir)]
    else:
      plan_path = self.workdir / f"plan_{name}.json"
      plan_path.write_text(json.dumps(plan))
      cmd = [sys.executable, "-m", "tests.chaos", "--child", str(plan_path), "--",
             *self.flags(workdir)]
    start = time.monotonic()
    with open(self.workdir / f"log_{name}.txt", "w", encoding="utf-8") as log:
      code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                            check=False).returncode
    self.log.append(f"{name}: exit {code} after {time.monotonic() - start:.0f} s")
    print(self.log[-1], flush=True)
    return code

  def orphans(self) -> int:
    """Tagged processes still alive 15 s after their trainer ended (then killed)."""
    deadline = time.monotonic() + 15  # servers poll their parent every 0.5 s
    while tagged_processes(self.tag) and time.monotonic() < deadline:
      time.sleep(0.2)
    left = tagged_processes(self.tag)
    for pid in left:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    return len(left)

  def segments(self) -> list[Segment]:
    rate = 0.85
    r = self.rng
    base = {"seed": self.seed, "env_fault_rate": rate}
    # Reset/Step calls per iteration: one Reset and up to 3 Steps (smoke: 3 env steps).
    segs = [Segment("1_rollout_kill", dict(base, seed=r.randrange(2**31),
                                           kill_rollout_call=4 * (self.iterations - 1)
                                           + r.randrange(1, 3)))]
    if not self.reduced:
      segs.append(Segment("2_update_kill", dict(base, seed=r.randrange(2**31), kill_update=True),
                          before="corrupt"))
      segs.append(Segment("3_async_save_kill", dict(base, seed=r.randrange(2**31),
                                                    kill_save_step=self.iterations)))
      segs.append(Segment("4_unwritable", dict(base, seed=r.randrange(2**31),
                                               unwritable_at_write=1,
                                               endpoint_flap_call=r.randrange(0, 2)),
                          before="partial", expect="error"))
    else:
      segs.append(Segment("2_update_kill", dict(base, seed=r.randrange(2**31), kill_update=True)))
    segs.append(Segment("last_finish", dict(base, seed=r.randrange(2**31)), expect="done"))
    return segs

  def damage(self, run: pathlib.Path, how: str) -> str:
    """Corrupts or truncates the array files of the latest finished checkpoint step."""
    ckpt = run / "checkpoints"
    steps = sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []
    if len(steps) < 2:
      return f"{how}: skipped (only steps {steps} on disk; a fallback needs two)"
    latest = ckpt / str(steps[-1]) / "state"
    for path in sorted(latest.rglob("*")):
      if path.is_file() and path.name != "commit_success.txt":
        data = path.read_bytes()
        path.write_bytes(b"\xde\xad" * (len(data) // 2) if how == "corrupt"
                         else data[:len(data) // 2])
    return f"{how}: step {steps[-1]} of {steps}"

  def run(self) -> int:
    if self.workdir.exists():
      if any(self.workdir.iterdir()) and not (self.workdir / "log_reference.txt").exists():
        raise SystemExit(f"tests.chaos: error: {self.workdir} is not empty and not a previous "
                         "chaos workdir; pass an empty or new --workdir")
      shutil.rmtree(self.workdir)
    self.workdir.mkdir(parents=True)
    events = self.workdir / "events.jsonl"
    t0 = time.monotonic()
    ref = self.workdir / "reference"
    self.run_trainer(ref, None, "reference")
    ref_orphans = self.orphans()
    run = self.workdir / "chaos"
    rows: dict[str, dict] = {}

    def row(kind: str) -> dict:
      return rows.setdefault(kind, {"injected": 0, "survived": 0, "orphans": 0})

    for seg in self.segments():
      damaged = None
      if seg.before:
        note = self.damage(run, seg.before)
        self.log.append(note)
        print(note, flush=True)
        if "skipped" not in note:
          damaged = row({"corrupt": "corrupt latest checkpoint",
                         "partial": "partially written checkpoint"}[seg.before])
          damaged["injected"] += 1
      before = _count_lines(events)
      code = self.run_trainer(run, dict(seg.plan, events=str(events)), seg.name)
      orphans = self.orphans()
      new = [json.loads(l) for l in events.read_text().splitlines()[before:]] if (
          events.exists()) else []
      ok = {"killed": code == -signal.SIGKILL, "error": code == 1, "done": code == 0}[seg.expect]
      if not ok:
        self.log.append(f"{seg.name}: expected {seg.expect}, got exit {code}")
      for e in new:
        r = row(_LABELS[e["fault"]])
        r["injected"] += 1
        r["orphans"] += orphans
      if damaged is not None:
        damaged["orphans"] += orphans
      # A fault is survived when the trainer went on: env faults and the endpoint flap
      # inside a segment that ended as planned; a kill or write failure when the next
      # segment resumed (checked below through the metrics).
      for e in new:
        if e["fault"].startswith(("env_", "endpoint")) and ok:
          row(_LABELS[e["fault"]])["survived"] += 1
      if not ok:
        break
    equal, problems = compare(ref / "metrics.jsonl", run / "metrics.jsonl", self.iterations)
    finished = (run / "metrics.jsonl").exists() and not problems
    for label, r in rows.items():
      if not label.startswith(("env server", "remote")):
        r["survived"] = r["injected"] if finished else 0
    counters = _fault_counters(run / "metrics.jsonl")
    print(f"\nreference orphans: {ref_orphans}\nfault counters in the chaos run's metrics.jsonl: "
          f"{counters}")
    for p in problems:
      print("problem:", p)
    print(table(rows, equal))
    print(f"total {time.monotonic() - t0:.0f} s")
    injected = sum(r["injected"] for r in rows.values())
    good = (equal and not problems and ref_orphans == 0
            and all(r["orphans"] == 0 and r["survived"] == r["injected"] for r in rows.values())
            and injected >= (5 if self.reduced else 20))
    return 0 if good else 1


_LABELS = {
    "env_sigkill": "env server SIGKILL during Reset/Step",
    "env_sigstop": "env server SIGSTOP (hang) during Reset/Step",
    "trainer_sigkill_rollout": "trainer SIGKILL during rollout",
    "trainer_sigkill_update": "trainer SIGKILL during update",
    "trainer_sigkill_async_save": "trainer SIGKILL during async checkpoint save",
    "unwritable_workdir": "workdir unwritable (metrics write fails)",
    "endpoint_flap": "remote endpoint gone and back",
}


def _count_lines(path: pathlib.Path) -> int:
  return len(path.read_text().splitlines()) if path.exists() else 0


def _fault_counters(path: pathlib.Path) -> str:
  """The env/* counters of each metrics line (cumulative within one trainer process)."""
  if not path.exists():
    return "(no metrics)"
  out = []
  for line in path.read_text().splitlines():
    record = json.loads(line)
    counters = ", ".join(f"{k[4:]} {v:g}" for k, v in sorted(record.items())
                         if k.startswith("env/"))
    out.append(f"step {record['step']}: {counters}")
  return "; ".join(out)


def compare(reference: pathlib.Path, chaos: pathlib.Path, iterations: int):
  """(equal, problems): steps 1..iterations exactly once in both, values bit-equal
  except the ignored prefixes."""
  problems = []
  runs = []
  for path in (reference, chaos):
    if not path.exists():
      return False, [f"{path} is missing"]
    lines = [json.loads(l) for l in path.read_text().splitlines() if l.strip()]
    steps = [l["step"] for l in lines]
    if steps != list(range(1, iterations + 1)):
      problems.append(f"{path}: steps {steps}, expected 1..{iterations} once each")
    runs.append({l["step"]: {k: v for k, v in l.items() if not k.startswith(IGNORED_PREFIXES)}
                 for l in lines})
  ref, got = runs
  for step in sorted(ref):
    if step not in got:
      problems.append(f"step {step}: missing")
    elif ref[step] != got[step]:
      diff = sorted(k for k in set(ref[step]) | set(got.get(step, {}))
                    if ref[step].get(k) != got.get(step, {}).get(k))
      problems.append(f"step {step}: metrics differ in {diff[:8]}")
  return not problems, problems


def table(rows: dict[str, dict], equal: bool) -> str:
  lines = ["| fault | injected | survived | metrics equal | orphans |",
           "|---|---:|---:|---|---:|"]
  for label in list(_LABELS.values()) + ["corrupt latest checkpoint",
                                         "partially written checkpoint"]:
    if label in rows:
      r = rows[label]
      lines.append(f"| {label} | {r['injected']} | {r['survived']} | "
                   f"{'yes' if equal else 'NO'} | {r['orphans']} |")
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--child"]:
    _child(argv[1], argv[3:])
    return 0
  p = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.split("\n")[0])
  p.add_argument("--seed", type=int, default=0, help="training seed and fault schedule")
  p.add_argument("--iterations", type=int, default=3, help="training iterations per run")
  p.add_argument("--workdir", default="/tmp/hgpo_chaos",
                 help="runs and logs (a previous chaos workdir is wiped first)")
  p.add_argument("--reduced", action="store_true",
                 help="two trainer kills instead of all fault kinds (the slow test)")
  args = p.parse_args(argv)
  if args.iterations < 2:
    p.error("--iterations must be >= 2 (a restart needs a checkpoint to fall back to)")
  return Harness(args.workdir, args.seed, args.iterations, args.reduced).run()


if __name__ == "__main__":
  sys.exit(main())
