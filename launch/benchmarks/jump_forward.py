"""Benchmark: constrained sampler calls with jump-forward decoding (`jump_forward=K`)
against the one-token loop (`jump_forward=0`), side by side.

  python -m launch.benchmarks.jump_forward [--cpu_numerics host_math] [--compute bfloat16]
      [--k 3,7] [--distinct 2,16] [--reps 5] [--decode_layers auto] [--unscored]

Every side is one `Sampler` over SmolLM2-135M-Instruct with LoRA rank 16 on the top 8
layers (`launch.benchmarks.decode_layers.adapted_smollm2`: the base stored in `--compute`
as the trainer stores it), making the calls of `make run-llm`'s rollout: 16 rows, prompts
of ~315 tokens in the 320 bucket, each row constrained to 24 ALFWorld-style actions
(`<action>...</action>`), temperature 1, at most 32 new tokens. `--distinct` gives the
distinct prompts per call (2: a grouped evaluation's first turn, mostly decode steps; 16: a
training turn, mostly prefill). With K > 0 a row feeds the tokens its trie forces, up to K,
in one decode step of K + 1 positions (`hgpo_jax.sampling.jump_forward`). The sides'
samples are compared first (the same action on most rows: float round-off can flip a
draw; their mean |response log-prob difference| on equal responses) with their decode steps
per call. A side's call time is the median over `--reps` repetitions of 3 calls with other
keys (after a warm-up call that compiles), the sides interleaved repetition by repetition.
With `--unscored` each K has a second side that calls with `need_logprobs=False`, as an
evaluation does (the step that only scores the final `</action>` runs is left out; same
program and tokens). The last line is the one-token/jump-forward time ratio per K and
`--distinct` value (and the scored/unscored ratio per K).
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
  parser.add_argument("--k", default="3,7", help="comma-separated K > 0 to time")
  parser.add_argument("--distinct", default="2,16", help="distinct prompts per 16-row call")
  parser.add_argument("--reps", type=int, default=5, help="timed repetitions (median)")
  parser.add_argument("--decode_layers", default="auto", help="rollout.decode_layers of all sides")
  parser.add_argument("--unscored", action="store_true",
                      help="add a side per K whose calls skip the step that only scores "
                           "(need_logprobs=False, as an evaluation calls)")
  return parser.parse_args(argv)


def _ints(text: str, what: str) -> list[int]:
  try:
    return [int(x) for x in text.split(",")]
  except ValueError:
    raise SystemExit(f"jump_forward: {what} {text!r} must be comma-separated ints") from None


def main(argv=None) -> int:
  args = _parse(sys.argv[1:] if argv is None else argv)
  runtime.pin_cpu_isa(args.cpu_numerics)
  import jax

  from hgpo_jax.sampling import sampler as sampler_lib
  from launch.benchmarks.decode_layers import (ACTIONS, PROMPT, ROWS, adapted_smollm2,
                                               side_by_side)

  ks, distinct = _ints(args.k, "--k"), _ints(args.distinct, "--distinct")
  if (any(k < 1 for k in ks) or any(not 1 <= d <= ROWS for d in distinct) or args.reps < 1):
    print(f"jump_forward: --k values must be >= 1, --distinct in [1, {ROWS}], --reps >= 1",
          file=sys.stderr)
    return 2
  model, tok = adapted_smollm2(args.compute)
  try:
    samplers = {f"K={k}": sampler_lib.Sampler(
        model, tok, prompt_buckets=(PROMPT,), batch_buckets=(1, 2, 4, 8, ROWS),
        decode_layers=args.decode_layers, jump_forward=k) for k in [0] + ks}
    if args.unscored:
      samplers.update({f"K={k} unscored": samplers[f"K={k}"] for k in ks})
  except ValueError as e:
    print(f"jump_forward: {e}", file=sys.stderr)
    return 2
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, XLA:CPU numerics "
        f"{args.cpu_numerics}, compute {args.compute}, decode_layers {args.decode_layers}; "
        f"SmolLM2-135M + LoRA r16 top 8, {ROWS} rows x prompt {PROMPT}, {len(ACTIONS)} actions")
  med = side_by_side(samplers, "K=0", distinct, args.reps,
                     unscored=frozenset(n for n in samplers if n.endswith("unscored")))
  ratios = [f"{d} distinct K={k} {m['K=0'] / m[f'K={k}']:.2f}x" for d, m in med.items()
            for k in ks]
  if args.unscored:
    ratios += [f"{d} distinct K={k} scored/unscored {m[f'K={k}'] / m[f'K={k} unscored']:.2f}x"
               for d, m in med.items() for k in ks]
  print("one-token/jump-forward call time: " + ", ".join(ratios))
  return 0


if __name__ == "__main__":
  sys.exit(main())
