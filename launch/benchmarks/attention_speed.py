"""Benchmark: CPU time of the decoder's forward + backward, `chunked` vs `xla` attention, by length.

  python -m launch.benchmarks.attention_speed [--lengths 512 1024 2048 4096] [--layers 2]
      [--model smollm2-135m] [--query-chunk 256] [--reps 5]

What `model.attention_impl=auto` should pick on CPU (`attention.CPU_CHUNKED_MIN_LENGTH`):
for each length, the gradient of mean(hidden²) of the first `--layers` layers of `--model`
(remat on, float32, one row, real weights' shapes with random values) is compiled for both
implementations (`xla` with causal block skipping over `--query-chunk` queries, as the
`local` and `paper` variants set `model.attn_query_chunk`; `chunked` with its default
512-key blocks) and run `--reps` times, the two sides alternating call by call; each side's
median seconds and the chunked/xla ratio are printed per length (below 1: chunked is
faster). The last line is the ratio at the longest length.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
from flax import nnx

from hgpo_jax.models import config, decoder


def step_fn(impl: str, name: str, layers: int, length: int, query_chunk: int):
  """(jitted gradient function, its arguments) for one implementation and length."""
  cfg = config.get_preset(name).replace(num_layers=layers, remat=True, attention_impl=impl,
                                        attn_query_chunk=query_chunk if impl == "xla" else 0)
  model = decoder.Decoder(cfg, rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  tokens = jax.random.randint(jax.random.key(1), (1, length), 0, cfg.vocab_size)

  def loss(state, tokens):
    m = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    hidden, _ = m.hidden(tokens, positions, jnp.ones(tokens.shape, jnp.int32))
    return jnp.mean(jnp.square(hidden.astype(jnp.float32)))
  return jax.jit(jax.grad(loss)), (state, tokens)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096])
  parser.add_argument("--layers", type=int, default=2)
  parser.add_argument("--model", default="smollm2-135m", choices=config.PRESET_NAMES)
  parser.add_argument("--query-chunk", type=int, default=256)
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {args.model}, first "
        f"{args.layers} layers, forward + backward (remat), float32, 1 row; median of "
        f"{args.reps} alternating calls")
  ratio = None
  for length in args.lengths:
    fns = {impl: step_fn(impl, args.model, args.layers, length, args.query_chunk)
           for impl in ("xla", "chunked")}
    times = {impl: [] for impl in fns}
    for impl, (fn, a) in fns.items():
      jax.block_until_ready(fn(*a))  # compile
    for _ in range(args.reps):
      for impl, (fn, a) in fns.items():
        start = time.perf_counter()
        jax.block_until_ready(fn(*a))
        times[impl].append(time.perf_counter() - start)
    med = {impl: statistics.median(v) for impl, v in times.items()}
    ratio = med["chunked"] / med["xla"]
    print(f"  T={length:5d}  xla {med['xla']:8.3f} s  chunked {med['chunked']:8.3f} s  "
          f"chunked/xla {ratio:.3f}")
  print(f"T={args.lengths[-1]} chunked/xla time: {ratio:.3f}")


if __name__ == "__main__":
  main()
