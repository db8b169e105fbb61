"""Benchmark: one XLA:CPU setting against another, on the tiny policy's programs.

  python -m launch.cpu_numerics cost                 # default vs host_math, 3 rounds
  python -m launch.cpu_numerics cost --rounds 5 --reps 5
  python -m launch.cpu_numerics cost --baseline host_math --candidate no_ynnpack

hgpo_jax.runtime.CPU_NUMERICS names the settings; XLA flags are fixed when JAX starts, so
each (setting, round) is its own subprocess, and the rounds alternate baseline, candidate,
baseline, ... so that load on a shared machine falls on both sides alike. A child times,
after compiling, `--reps` calls of each of the three programs an ALFWorld-mini iteration
spends its time in, at that suite's shapes (tiny model, 96-row micro-batches of 256 prompt
+ 32 response tokens, 16 rollout rows): the learner's log-prob pass, one PPO update, and
the sampler's generate (32 new tokens). Per phase it prints the median over all rounds
of each side; the last line is the ratio of the summed medians, candidate / baseline
(above 1 = the candidate is slower).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS, PROMPT, RESPONSE, ROLLOUT_ROWS = 96, 256, 32, 16


def child(reps: int) -> dict:
  """Times the three programs under this process's XLA flags."""
  import jax
  import numpy as np
  from flax import nnx

  from hgpo_jax.models import loading, sharding
  from hgpo_jax.sampling import sampler as sampler_lib
  from hgpo_jax.sampling import SamplingParams
  from hgpo_jax.training import train_batch, train_step

  model, tok, cfg = loading.load_model("tiny")
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, cfg.vocab_size, PROMPT).tolist() for _ in range(ROWS)]
  responses = [rng.integers(3, cfg.vocab_size, RESPONSE).tolist() for _ in range(ROWS)]
  learner = train_step.Learner(model, sharding.make_mesh(1, 1, 1),
                               train_step.UpdateConfig(lr=1e-2, mini_batch_rows=ROWS,
                                                       micro_batch_rows=ROWS))
  state = learner.init_state(nnx.state(model, nnx.Param))
  host, _ = train_batch.build_train_batch(prompts, responses, rng.normal(size=ROWS).astype(np.float32),
                                          prompt_buckets=[PROMPT], response_buckets=[RESPONSE],
                                          row_multiple=ROWS)
  fill = lambda: train_step.fill_rows(learner, state.params, None, host)
  host = fill()
  host = host.replace(ref_logprobs=host.old_logprobs)
  batch = learner.put_batch(host)
  smp = sampler_lib.Sampler(model, tok, prompt_buckets=(PROMPT,), batch_buckets=(ROLLOUT_ROWS,))
  params = SamplingParams(temperature=1.0, max_new_tokens=RESPONSE, ignore_eos=True)
  held = {"state": state}  # the update donates its state: each call takes the last one

  def update():
    held["state"], _ = learner.update(held["state"], batch)
    jax.block_until_ready(held["state"])

  phases = {
      # fill_logprobs returns device arrays: block, or only the dispatch is timed
      "logprobs": lambda: jax.block_until_ready(
          train_step.fill_rows(learner, held["state"].params, None, host)),
      "update": update,
      "generate": lambda: smp.generate(prompts[:ROLLOUT_ROWS], params, jax.random.key(0)),
  }
  out = {}
  for name, fn in phases.items():
    fn()  # compile
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      fn()
      times.append(time.perf_counter() - start)
    out[name] = times
  return out


def main(argv=None) -> None:
  p = argparse.ArgumentParser(prog="python -m launch.cpu_numerics cost", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--rounds", type=int, default=3, help="alternating rounds per setting")
  p.add_argument("--reps", type=int, default=3, help="timed calls per program per round")
  p.add_argument("--baseline", default="host_math", help="setting measured against (runtime.CPU_NUMERICS)")
  p.add_argument("--candidate", default="default", help="setting measured")
  p.add_argument("--child", metavar="SETTING", help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  if args.child:
    from hgpo_jax import runtime
    runtime.pin_cpu_numerics(args.child)
    print("RESULT " + json.dumps(child(args.reps)), flush=True)
    return
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  base, cand = args.baseline, args.candidate
  samples = {base: {}, cand: {}}
  for r in range(args.rounds):
    for setting in samples:
      proc = subprocess.run([sys.executable, "-m", "launch.cpu_numerics", "cost", "--child", setting,
                             f"--reps={args.reps}"], env=env, capture_output=True, text=True)
      lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
      if proc.returncode or not lines:
        raise SystemExit(f"benchmark child {setting} failed:\n{proc.stderr[-3000:]}")
      for phase, times in json.loads(lines[-1][len("RESULT "):]).items():
        samples[setting].setdefault(phase, []).extend(times)
      print(f"round {r + 1} {setting}: " + ", ".join(
          f"{k} {statistics.median(v):.3f} s" for k, v in samples[setting].items()), flush=True)
  total = {s: 0.0 for s in samples}
  for phase in samples[base]:
    med = {s: statistics.median(samples[s][phase]) for s in samples}
    for s in samples:
      total[s] += med[s]
    print(f"{phase:9s} {base} {med[base]:.3f} s  {cand} {med[cand]:.3f} s  "
          f"ratio {med[cand] / med[base]:.2f}  ({len(samples[base][phase])} calls each)")
  print(f"{cand} / {base}, summed medians of log-probs + update + generate: "
        f"{total[cand] / total[base]:.2f}")

