"""Benchmark: peak temporary memory of attention's forward + backward, `chunked` vs `xla`.

  python -m launch.benchmarks.attention_memory [--length 4096] [--batch 1] [--dtype float32]
      [--block 512] [--model smollm2-135m] [--skip-model]

Two programs per implementation, compiled by XLA for this process's devices (CPU here) and
measured by the compiler's buffer assignment (`compiled.memory_analysis()`: the bytes of
temporaries live at the peak, arguments and outputs excluded; no run is needed):
  attention  the gradient of sum(attention(q, k, v) * w) in SmolLM2-135M's geometry (9
             query heads, 3 kv heads, head dim 64), one row of `--length` tokens;
  backbone   the gradient of mean(hidden²) of the `--model` decoder's layers (abstract
             parameters, remat on as in training) on the same row; chunked with the
             decoder's default block (512 keys). The output layer is left out: at this
             length its f32 logits [T, V] (805 MB for SmolLM2) set the peak of the whole
             NLL gradient for both implementations (measured: 3386 vs 3370 MiB).
`xla` materialises [B, H, T, T] f32 scores and keeps the probabilities for its backward:
O(T²) per layer. `chunked` (online softmax over key blocks of `--block`, recomputing
backward) holds one [B, H, T, block] block at a time: O(T · block). The last line is the
backbone's chunked/xla ratio of peak temporary bytes.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from hgpo_jax.models import attention, config, decoder

MiB = 2 ** 20


def _temp_bytes(fn, *args) -> int:
  return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def attention_bytes(impl: str, batch: int, length: int, dtype, block: int) -> int:
  """Peak temporary bytes of grad(sum(attention(q, k, v) * w)) wrt q, k, v."""
  heads, kv_heads, dim = 9, 3, 64
  q = jax.ShapeDtypeStruct((batch, length, heads, dim), dtype)
  kv = jax.ShapeDtypeStruct((batch, length, kv_heads, dim), dtype)
  seg = jax.ShapeDtypeStruct((batch, length), jnp.int32)

  def loss(q, k, v, seg):
    out = attention.attention(q, k, v, seg, impl=impl, block_kv=block)
    return jnp.sum(out.astype(jnp.float32))
  return _temp_bytes(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, seg)


def backbone_bytes(impl: str, name: str, batch: int, length: int, dtype: str) -> int:
  """Peak temporary bytes of the gradient of mean(hidden²) of the decoder (remat on)."""
  cfg = config.get_preset(name).replace(dtype=dtype, remat=True, attention_impl=impl)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: decoder.Decoder(cfg, rngs=nnx.Rngs(0))))
  tokens = jax.ShapeDtypeStruct((batch, length), jnp.int32)

  def loss(state, tokens):
    model = nnx.merge(graphdef, state)
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    hidden, _ = model.hidden(tokens, positions, jnp.ones(tokens.shape, jnp.int32))
    return jnp.mean(jnp.square(hidden.astype(jnp.float32)))
  return _temp_bytes(jax.grad(loss), state, tokens)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--length", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--dtype", default="float32", choices=tuple(config.DTYPES))
  parser.add_argument("--block", type=int, default=512, help="chunked: keys per block")
  parser.add_argument("--model", default="smollm2-135m", choices=config.PRESET_NAMES)
  parser.add_argument("--skip-model", action="store_true", help="the attention program only")
  args = parser.parse_args()
  dtype = config.DTYPES[args.dtype]
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; batch {args.batch} x "
        f"{args.length} tokens, {args.dtype}; chunked block {args.block}; peak temporary "
        "bytes of the compiled forward + backward (memory_analysis)")
  att = {impl: attention_bytes(impl, args.batch, args.length, dtype, args.block)
         for impl in ("xla", "chunked")}
  for impl, n in att.items():
    print(f"  attention (9 heads / 3 kv, dim 64)  {impl:8s} {n / MiB:10.1f} MiB")
  print(f"attention chunked/xla peak temporary bytes: {att['chunked'] / att['xla']:.4f}")
  if args.skip_model:
    return
  mod = {impl: backbone_bytes(impl, args.model, args.batch, args.length, args.dtype)
         for impl in ("xla", "chunked")}
  for impl, n in mod.items():
    print(f"  {args.model} backbone gradient (remat) {impl:8s} {n / MiB:10.1f} MiB")
  ratio = mod["chunked"] / mod["xla"]
  print(f"{args.model} backbone T={args.length} chunked/xla peak temporary bytes: "
        f"{ratio:.4f} ({1 / ratio:.1f}x less)")


if __name__ == "__main__":
  main()
