"""Continuous batching (`rollout.decode_slots`) against lockstep decoding, one run.

  python -m launch.benchmarks.decode_slots [--dump ROLLOUT.jsonl] [--slots 4,8]
      [--reps 3] [--max-new-tokens 128]

A rollout is replayed call by call: each turn of the dump (a trainer's `rollout.dump=true`
file, `<workdir>/rollouts/iter_NNNNNN.jsonl`) is one sampler call over the trajectories
alive at that step, and each row is constrained to the token ids the run sampled
(`constrained.TokenIds`), so every row ends after exactly its recorded length whatever the
model: the decode work is the run's. The prompt of a row is its observation
(`anchor_obs`). Without --dump, a synthetic rollout: 8 calls of 32 rows, prompts of
32-200 random tokens, response lengths drawn from a geometric distribution of mean
`--max-new-tokens` / 4, capped at `--max-new-tokens` (many short responses, a few long
ones, as an agent's turns are).

Both sides run the tiny preset (random init) on this CPU with the same calls, keys and
buckets: lockstep (`decode_slots=0`: every row of a call decodes until the slowest ends)
and each `--slots` S (a finished row frees its slot for the next; one row admitted at a
time). For each side: the decoded tokens, the decode row-steps (`SampleOutput.decode_row_steps`:
rows x steps of the decode loop) and the fraction of them spent on finished or padding
rows, and the wall time of the whole replay (median over reps, compilation excluded). The
samples are checked equal between the sides first. The last line is the ratio lockstep /
slotted wall time at the first S.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import numpy as np
from flax import nnx

from hgpo_jax.models import config as model_config
from hgpo_jax.models import decoder
from hgpo_jax.models import tokenizer as tokenizer_lib
from hgpo_jax.sampling import constrained
from hgpo_jax.sampling import sampler as sampler_lib
from hgpo_jax.sampling import SamplingParams
from launch.benchmarks import harness

EXACT = constrained.ActionConstraint(prefix="", suffix="")


def dump_calls(path: str, tok) -> list[tuple[list[list[int]], list[tuple[int, ...]]]]:
  """(prompts, response ids) of each turn of a rollout dump, turns in step order."""
  turns: dict[int, list[dict]] = {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      row = json.loads(line)
      turns.setdefault(int(row["step"]), []).append(row)
  return [([tok.encode(r["anchor_obs"])[-200:] or [1] for r in rows],
           [tuple(int(t) for t in r["response_ids"]) for r in rows])
          for _, rows in sorted(turns.items())]


def synthetic_calls(seed: int, vocab: int, max_new: int, calls: int = 8, rows: int = 32):
  rng = np.random.RandomState(seed)
  out = []
  for _ in range(calls):
    prompts = [list(rng.randint(3, vocab, size=rng.randint(32, 201))) for _ in range(rows)]
    lengths = np.minimum(rng.geometric(4.0 / max_new, size=rows), max_new)
    out.append((prompts, [tuple(int(t) for t in rng.randint(3, vocab, size=n))
                          for n in lengths]))
  return out


def replay(smp, calls, params):
  """(outputs, decoded tokens, row-steps, seconds) of one replay of `calls`."""
  outs, decoded, row_steps = [], 0, 0
  t0 = time.perf_counter()
  for i, (prompts, responses) in enumerate(calls):
    allowed = [[(constrained.TokenIds(r),)] for r in responses]
    out = smp.generate(prompts, params, jax.random.key(i), allowed=allowed, constraint=EXACT)
    outs.append(out)
    decoded += out.decoded_tokens
    row_steps += out.decode_row_steps
  return outs, decoded, row_steps, time.perf_counter() - t0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--dump", default="", help="a rollout dump JSONL (default: synthetic)")
  ap.add_argument("--slots", default="4,8", help="comma-separated decode_slots to compare")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--seed", type=int, default=0)
  args = ap.parse_args(argv)
  slots = [int(s) for s in args.slots.split(",")]
  tok = tokenizer_lib.tiny_tokenizer()
  model = decoder.Decoder(model_config.get_preset("tiny"), rngs=nnx.Rngs(0))
  calls = (dump_calls(args.dump, tok) if args.dump
           else synthetic_calls(args.seed, model.cfg.vocab_size, args.max_new_tokens))
  longest = max(len(r) for _, responses in calls for r in responses)
  params = SamplingParams(temperature=1.0, max_new_tokens=max(longest, 1))
  rows = max(len(p) for p, _ in calls)
  buckets = tuple(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < rows) + (
      sampler_lib.bucket_for(rows, (1, 2, 4, 8, 16, 32, 64, 128, 256), "rows"),)
  kw = dict(prompt_buckets=(256,), batch_buckets=buckets)
  sides = [("lockstep", sampler_lib.Sampler(model, tok, **kw))] + [
      (f"slots={s}", sampler_lib.Sampler(model, tok, decode_slots=s, **kw)) for s in slots]
  print(f"workload: {args.dump or 'synthetic'}: {len(calls)} calls, "
        f"{sum(len(p) for p, _ in calls)} rows, response lengths "
        f"{min(len(r) for _, rs in calls for r in rs)}-{longest} tokens; tiny preset, "
        f"{jax.devices()[0].platform}, reps {args.reps}")
  first = {}
  for name, smp in sides:  # warm-up: compiles every bucket, checks the samples
    outs = replay(smp, calls, params)[0]
    first[name] = [o.tokens for o in outs]
    if first[name] != first["lockstep"]:
      raise SystemExit(f"decode_slots: {name} sampled other tokens than lockstep")
  work = {}

  def side(name, smp):
    def call():
      _, decoded, row_steps, _ = replay(smp, calls, params)
      work[name] = (decoded, row_steps)
    return call

  med = harness.alternating_medians({name: side(name, smp) for name, smp in sides}, args.reps)
  for name, _ in sides:
    decoded, row_steps = work[name]
    print(f"{name:>10}: {decoded} tokens in {row_steps} row-steps: "
          f"{100 * (1 - decoded / row_steps):.1f} % of decode row-steps on finished or padding "
          f"rows; {med[name]:.2f} s (median of {args.reps})")
  name = f"slots={slots[0]}"
  print(f"lockstep / {name} wall time: {med['lockstep'] / med[name]:.2f}")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
