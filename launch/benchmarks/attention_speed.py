"""Benchmark: time of the decoder's forward + backward, `chunked` vs `xla` attention, by length.

  python -m launch.benchmarks.attention_speed [--lengths 512 1024 2048 4096] [--layers 2]
      [--model smollm2-135m] [--query-chunk 256] [--reps 5]
  python -m launch.benchmarks.attention_speed --impls cudnn,xla --dtype bfloat16 \
      --model qwen2.5-1.5b --layers 4 --lengths 1024 2048 4096 8192    # on a GPU

What `model.attention_impl=auto` should pick on CPU (`attention.CPU_CHUNKED_MIN_LENGTH`):
for each length, the gradient of mean(hidden²) of the first `--layers` layers of `--model`
(remat on, float32, one row, real weights' shapes with random values) is compiled for both
implementations (`xla` with causal block skipping over `--query-chunk` queries, as the
`local` and `paper` variants set `model.attn_query_chunk`; `chunked` with its default
512-key blocks) and run `--reps` times, the two sides alternating call by call; each side's
median seconds and the chunked/xla ratio are printed per length (below 1: chunked is
faster). The last line is the ratio at the longest length.

`--impls A,B` times implementation A against B instead (the ratio printed is A/B), and
`--dtype` sets the activation dtype (`ModelConfig.dtype`; float32 parameters): on a GPU,
`--impls cudnn,xla --dtype bfloat16` times what `auto` picks there (cuDNN's fused kernel,
bf16 only) against the reference. A side that fails to compile is reported with its error.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hgpo_jax.models import attention, config, cudnn_check, decoder
from launch.benchmarks import harness


def step_fn(impl: str, name: str, layers: int, length: int, query_chunk: int,
            dtype: str = "float32"):
  """(jitted gradient function, its arguments) for one implementation and length."""
  cfg = config.get_preset(name).replace(num_layers=layers, remat=True, attention_impl=impl,
                                        attn_query_chunk=query_chunk if impl == "xla" else 0,
                                        dtype=dtype)
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
  parser.add_argument("--impls", default="chunked,xla",
                      help="A,B: time implementation A against B (ratio A/B)")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  args = parser.parse_args()
  impls = args.impls.split(",")
  if len(impls) != 2 or any(i not in attention.IMPLEMENTATIONS for i in impls):
    parser.error(f"--impls takes two of {attention.IMPLEMENTATIONS}, got {args.impls!r}")
  a_name, b_name = impls
  cudnn_check.check_if_gpu()  # on a GPU: cuDNN attention == the reference, before timing it
  device = jax.devices()[0]
  print(f"jax {jax.__version__} on {device.platform} ({device.device_kind}); {args.model}, "
        f"first {args.layers} layers, forward + backward (remat), {args.dtype}, 1 row; "
        f"median of {args.reps} alternating calls")
  ratio = None
  for length in args.lengths:
    fns, failed = {}, {}
    for impl in impls:
      fn, fn_args = step_fn(impl, args.model, args.layers, length, args.query_chunk, args.dtype)
      try:
        jax.block_until_ready(fn(*fn_args))  # compile
        fns[impl] = (fn, fn_args)
      except Exception as e:  # noqa: BLE001 (reported, the other side still runs)
        failed[impl] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    med = harness.alternating_medians(
        {impl: functools.partial(fn, *fn_args) for impl, (fn, fn_args) in fns.items()}, args.reps)
    cells = [f"{impl} {med[impl]:8.4f} s" if impl in med else f"{impl} FAILED ({failed[impl]})"
             for impl in impls]
    ratio = med[a_name] / med[b_name] if len(med) == 2 else None
    print(f"  T={length:5d}  " + "  ".join(cells)
          + (f"  {a_name}/{b_name} {ratio:.3f}" if ratio is not None else ""))
  print(f"T={args.lengths[-1]} {a_name}/{b_name} time: "
        + (f"{ratio:.3f}" if ratio is not None else "n/a (a side failed)"))


if __name__ == "__main__":
  main()
