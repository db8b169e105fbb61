"""Benchmark: the trainer's rollout sampler decoding on one accelerator, against its roofline.

  python -m launch.benchmarks.rollout --accelerator [--model qwen2.5-1.5b] [--rows 1,32,128]
      [--prompt 1024] [--new 512] [--reps 2] [--hf] [--profile] [--allow-cpu]

On one GPU or TPU chip (the process's first device; a CPU is refused): the sampler the
trainer runs, built by the program registry (`hgpo_jax.training.programs.build` on a
one-device mesh, from `configs/alfworld.py`'s HGPO config of `--model` with
`--config.rollout.max_prompt_tokens=P`, `max_new_tokens=N`), holding random bfloat16
weights of the preset (`loading.init_model`, as `Run.update_sampler` points the sampler at
the actor's weights). Each setting of `--rows` samples that many prompts of random token
ids with lengths uniform in [P/2, P] at temperature 1 (top-k/top-p off, the rollout's),
exactly N new tokens each (EOS ignored, no stop strings: those need a real vocabulary),
through `Sampler.generate` (the host side included). Timings exclude compilation (a warm-up
call of each shape) and are the median of `--reps` calls. Per setting it prints:

* ms per decode step = (the N-token call - the 1-token call: prefill + one step) / (N - 1),
  and tokens/s = rows x N / the N-token call;
* the memory roofline of a step: the bf16 weights + each row's mean valid keys and values
  over the N steps (row r of prompt length l_r reads l_r + j + 1 slots at step j:
  `decode_traffic.necessary_bytes`), at the copy bandwidth measured in the same process (a
  jitted x + 1 over `--copy-mib` MiB: bytes read + written / time) and at the chip's
  datasheet bandwidth (`hardware.ACCELERATORS`), and the fraction of each reached;
* with `--hf`: transformers' `generate` on the same device (a randomly initialised
  `Qwen2ForCausalLM` / `LlamaForCausalLM` of the preset's shapes, bf16, static cache,
  sampling at temperature 1, `min_new_tokens` = `max_new_tokens` = N, same prompts);
* with `--profile`: the top device kernels of one decode step (a `jax.profiler` trace of
  the N-token call at the largest row count, its Perfetto JSON parsed: kernel time / N),
  the kernels launched per step (the call's kernels, memory copies aside, / N: against the
  deviceless proxy's count, docs/performance.md) and their mean duration, the device's busy
  fraction over the call, and the device-to-host copies per step (a
  `while` loop whose trip count XLA:GPU does not know copies its condition to the host
  each iteration: one per step means the step waits on the host).

The last line is the fraction of the measured-bandwidth roofline at the largest row count.
The parts run on any backend (tests/launch/test_accelerator_benchmarks.py runs them on CPU
with the tiny preset); only `--accelerator`'s entry point insists on a GPU or TPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import gzip
import json
import os
import tempfile

from launch.benchmarks import harness


def datasheet_bandwidth(kind: str):
  """(table key, bytes/s) of the chip's datasheet HBM bandwidth (`hardware.ACCELERATORS`, the
  longest key `kind` starts with), or (None, None) for a device the table does not hold."""
  from hgpo_jax.cost import hardware
  return hardware.memory_bandwidth(kind)


def copy_bandwidth(nbytes: int = 1 << 31, reps: int = 5, device=None) -> float:
  """Bytes/s of a jitted x + 1 over a float32 array of `nbytes` (read once, written once:
  2 x nbytes per call), median of `reps` calls after a warm-up."""
  import jax
  import jax.numpy as jnp

  x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), device)
  add = jax.jit(lambda a: a + 1)
  add(x).block_until_ready()
  return 2 * x.nbytes / harness.median_seconds(lambda: add(x), reps)[0]


class RandomIdsTokenizer:
  """What the sampler reads from a tokenizer, for random-id prompts: EOS (the last id:
  ignored with `ignore_eos`), the pad id, and a decode that returns no text."""

  def __init__(self, vocab_size: int):
    self.eos_ids = (vocab_size - 1,)
    self.pad_id = 0

  def decode(self, ids) -> str:
    return ""

  def token_strings(self):
    raise RuntimeError("random-id prompts have no vocabulary (no stop strings or constraints)")


def trainer_sampler(model_name: str, device, prompt: int, new_tokens: int, *, dtype="bfloat16",
                    seed: int = 0, decode_impl: str = "auto", decode_chunk: int = 0):
  """(sampler, its SamplingParams): the program registry's sampler for `model_name` on a
  one-device mesh of `device`, holding random `dtype` weights (module doc), with
  `config.model.decode_attention_impl=decode_impl` and
  `config.rollout.decode_chunk_steps=decode_chunk`."""
  from configs import alfworld
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import loading, sharding
  from hgpo_jax.training import experiment, programs

  config = alfworld.get_config(f"algo=hgpo,model={model_name}")
  config.model.dtype = dtype
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
  config.rollout.max_prompt_tokens = prompt
  config.rollout.max_new_tokens = new_tokens
  config.model.decode_attention_impl = decode_impl
  config.rollout.decode_chunk_steps = decode_chunk
  mesh = sharding.make_mesh(1, 1, 1, devices=[device])
  vocab = model_config.get_preset(model_name).vocab_size
  exp = experiment.from_config(config)
  registry = programs.build(exp, mesh, local_devices=[device], num_processes=1,
                            tokenizer=RandomIdsTokenizer(vocab))
  sampler = registry.sampler
  sampler.model = loading.init_model(registry.model_cfg, seed=seed, mesh=mesh)
  params = dataclasses.replace(exp.sampling.train, max_new_tokens=new_tokens,
                               ignore_eos=True, stop_strings=())
  return sampler, params


def random_prompts(rows: int, prompt: int, vocab: int, seed: int = 0) -> list[list[int]]:
  """`rows` prompts of random ids in [3, vocab - 1), lengths uniform in [P/2, P]."""
  import numpy as np
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(prompt // 2, 1), prompt + 1, rows)
  return [rng.integers(3, vocab - 1, n).tolist() for n in lengths]


def _median_call(fn, reps: int) -> float:
  """Median seconds of `reps` calls of `fn` after one warm-up call (compilation)."""
  from launch.benchmarks import sampler as sampler_bench
  fn()
  return sampler_bench._median_time(fn, reps)


def time_decode(sampler, params, rows: int, prompt: int, reps: int, bandwidth: float,
                datasheet=None, seed: int = 0) -> dict:
  """Times `sampler.generate` on `rows` random prompts (module doc); returns the setting's
  numbers: call and per-step times, tokens/s, roofline bytes and fractions."""
  import jax

  from hgpo_jax.sampling import decode_traffic

  n = params.max_new_tokens
  if n < 2:
    raise ValueError("time_decode: max_new_tokens must be >= 2 (a step is the N-token call "
                     "less the 1-token call, over N - 1)")
  prompts = random_prompts(rows, prompt, sampler.cfg.vocab_size, seed)
  key = jax.random.key(seed)
  one = dataclasses.replace(params, max_new_tokens=1)
  full_s = _median_call(lambda: sampler.generate(prompts, params, key), reps)
  one_s = _median_call(lambda: sampler.generate(prompts, one, key), reps)
  out = sampler.generate(prompts, params, key)
  if out.decoded_tokens != rows * n:
    raise RuntimeError(f"time_decode: {out.decoded_tokens} tokens decoded, expected {rows * n}")
  step_s = (full_s - one_s) / (n - 1)
  unmeasured = step_s <= 0  # the N-token call no slower than the 1-token call: noise
  if unmeasured:
    step_s = float("nan")
  mean_prompt = sum(len(p) for p in prompts) / rows
  need = decode_traffic.necessary_bytes(sampler, rows, prompt, n, mean_prompt=mean_prompt)
  roofline_s = need.total / bandwidth
  r = dict(rows=rows, prompt=prompt, new_tokens=n, mean_prompt=mean_prompt, full_s=full_s,
           one_s=one_s, step_ms=1e3 * step_s, tokens_per_s=rows * n / full_s,
           weight_bytes=need.weights, kv_bytes=need.kv, bandwidth=bandwidth,
           roofline_ms=1e3 * roofline_s, fraction=roofline_s / step_s)
  if unmeasured:
    r["note"] = (f"not measured: the {n}-token call ({full_s:.4f} s) took no longer than the "
                 f"1-token call ({one_s:.4f} s); noise swamps the decode, raise --new or --reps")
  if datasheet:
    r["datasheet_roofline_ms"] = 1e3 * need.total / datasheet
    r["datasheet_fraction"] = need.total / datasheet / step_s
  return r


def format_setting(model_name: str, r: dict) -> str:
  line = (f"{model_name} rows {r['rows']:4d} P {r['prompt']} (mean {r['mean_prompt']:.0f}) / N "
          f"{r['new_tokens']}: {r['step_ms']:8.2f} ms per decode step, "
          f"{r['tokens_per_s']:10,.0f} tokens/s; roofline "
          f"{(r['weight_bytes'] + r['kv_bytes']) / 1e6:,.1f}"
          f" MB per step (weights {r['weight_bytes'] / 1e6:,.1f} + valid KV "
          f"{r['kv_bytes'] / 1e6:,.1f}) = {r['roofline_ms']:.2f} ms at "
          f"{r['bandwidth'] / 1e9:,.0f} GB/s measured ({r['fraction']:.0%} reached)")
  if "datasheet_fraction" in r:
    line += (f", {r['datasheet_roofline_ms']:.2f} ms at the datasheet's "
             f"({r['datasheet_fraction']:.0%} reached)")
  if "note" in r:
    line += f" [{r['note']}]"
  return line


# --------------------------------------------------------------------------------- --hf
def hf_model(cfg, device: str, dtype: str = "bfloat16"):
  """A randomly initialised transformers causal LM of `cfg`'s shapes (Qwen2 with q/k/v
  biases, else Llama), in `dtype` on the torch `device`, eval mode."""
  import torch
  import transformers

  common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_dim,
                intermediate_size=cfg.mlp_dim, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                rms_norm_eps=cfg.rms_eps, rope_theta=cfg.rope_theta,
                max_position_embeddings=cfg.max_seq_len, tie_word_embeddings=cfg.tie_embeddings)
  if cfg.qkv_bias:
    hf_cfg = transformers.Qwen2Config(**common)
    model = transformers.Qwen2ForCausalLM(hf_cfg)
  else:
    hf_cfg = transformers.LlamaConfig(head_dim=cfg.head_dim, **common)
    model = transformers.LlamaForCausalLM(hf_cfg)
  return model.to(device=device, dtype=getattr(torch, dtype)).eval()


def time_hf(model, prompts: list[list[int]], new_tokens: int, pad_id: int, reps: int,
            device: str) -> dict:
  """transformers' `generate` (static cache, sampling at T=1, exactly `new_tokens`;
  `launch.benchmarks.sampler.hf_generate`) on left-padded `prompts`: median seconds per
  call and tokens/s."""
  import torch

  from launch.benchmarks import sampler as sampler_bench

  def run():
    out = sampler_bench.hf_generate(model, prompts, pad_id, new_tokens, sample=True,
                                    static_cache=True, device=device)
    if device.startswith("cuda"):
      torch.cuda.synchronize()
    return out

  made = run().shape[1]
  if made != new_tokens:
    raise RuntimeError(f"hf generate made {made} tokens, asked {new_tokens}")
  seconds = _median_call(run, reps)
  return dict(seconds=seconds, tokens_per_s=len(prompts) * new_tokens / seconds)


# ---------------------------------------------------------------------------- --profile
def trace_events(log_dir: str) -> tuple[list[dict], dict[int, str], dict[tuple, str]]:
  """The complete ("X") events of the Perfetto trace `jax.profiler.trace(...,
  create_perfetto_trace=True)` wrote under `log_dir`, the process names by pid and the
  thread names by (pid, tid)."""
  paths = sorted(glob.glob(os.path.join(log_dir, "**", "perfetto_trace.json.gz"), recursive=True))
  if not paths:
    raise RuntimeError(f"no perfetto_trace.json.gz under {log_dir}")
  with gzip.open(paths[-1], "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  meta = [e for e in events if e.get("ph") == "M"]
  processes = {e["pid"]: e.get("args", {}).get("name", "") for e in meta
               if e.get("name") == "process_name"}
  threads = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in meta
             if e.get("name") == "thread_name"}
  return [e for e in events if e.get("ph") == "X" and "dur" in e], processes, threads


def summarize_trace(events: list[dict], process_names: dict[int, str], steps: int,
                    top: int = 8, thread_names: dict[tuple, str] | None = None) -> dict:
  """Top kernels per decode step, device busy fraction and device-to-host copies per step
  of one traced call of `steps` decode steps. Device events are those of processes named
  "/device:GPU..." or "/device:TPU...", on their "Stream" threads (GPU kernels) if any,
  else their "XLA Ops" threads (TPU), else all of them; busy = their summed time over the
  span from the first to the last of them. Without a device (a CPU) the host's events
  other than Python frames ("$file:line") stand in, and busy is None."""
  threads = thread_names or {}
  device_pids = {pid for pid, name in process_names.items()
                 if name.startswith(("/device:GPU", "/device:TPU"))}
  kernels = [e for e in events if e["pid"] in device_pids]
  for prefix in ("Stream", "XLA Ops"):
    chosen = [e for e in kernels if threads.get((e["pid"], e.get("tid")), "").startswith(prefix)]
    if chosen:
      kernels = chosen
      break
  if not device_pids:
    kernels = [e for e in events if not e["name"].startswith("$")]
  per_name: dict[str, float] = {}
  for e in kernels:
    per_name[e["name"]] = per_name.get(e["name"], 0.0) + float(e["dur"])
  busy = None
  if device_pids and kernels:
    span = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    busy = sum(per_name.values()) / span if span else None
  d2h = [e for e in events if _is_device_to_host(e["name"])]
  ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
  launched = [e for e in kernels if not _is_copy(e["name"])] if device_pids else []
  return dict(top=[(name, us / steps) for name, us in ranked], busy_fraction=busy,
              device_to_host_per_step=len(d2h) / steps, on_device=bool(device_pids),
              kernels_per_step=len(launched) / steps if device_pids else None,
              mean_kernel_us=(sum(float(e["dur"]) for e in launched) / len(launched)
                              if launched else None))


def _is_copy(name: str) -> bool:
  """A memory copy on a device stream (not a kernel the program launches)."""
  low = name.lower()
  return low.startswith("memcpy") or low.startswith("memset")


def _is_device_to_host(name: str) -> bool:
  low = name.lower().replace(" ", "")
  return any(k in low for k in ("memcpydtoh", "devicetohost", "d2h", "memcpy_dtoh"))


def profile_call(fn, steps: int, log_dir: str | None = None) -> dict:
  """Traces one call of `fn` (`steps` decode steps) with `jax.profiler` and summarizes it
  (`summarize_trace`)."""
  import jax

  fn()  # compiled outside the trace
  log_dir = log_dir or tempfile.mkdtemp(prefix="rollout_profile_")
  with jax.profiler.trace(log_dir, create_perfetto_trace=True):
    fn()
  events, processes, threads = trace_events(log_dir)
  return summarize_trace(events, processes, steps, thread_names=threads)


def format_profile(p: dict) -> list[str]:
  where = "device kernels" if p["on_device"] else "host events (no device in the trace)"
  lines = [f"profile: top {where} per decode step (us):"]
  lines += [f"  {us:10.1f}  {name[:110]}" for name, us in p["top"]]
  busy = "n/a" if p["busy_fraction"] is None else f"{p['busy_fraction']:.0%}"
  waits = p["device_to_host_per_step"]
  if p.get("kernels_per_step") is not None:
    mean = p["mean_kernel_us"]
    lines.append(f"profile: {p['kernels_per_step']:.1f} kernels per decode step"
                 + (f", {mean:.1f} us each on average" if mean is not None else "")
                 + " (the deviceless XLA:GPU proxy counts them too: docs/performance.md)")
  lines.append(f"profile: device busy {busy} of the traced call; {waits:.2f} device-to-host "
               f"copies per decode step ("
               + ("the step waits on the host)" if waits >= 1 else "no host round trip per step)"))
  return lines


# -------------------------------------------------------------------------------- main
def _print_header(args, device, bandwidth: float, key, sheet) -> None:
  """Prints the run's first line: jax, the chip, the settings and both bandwidths."""
  import jax

  print(f"jax {jax.__version__} on {device.device_kind}; {args.model} (random bf16 weights, "
        f"the trainer's sampler from the program registry), prompts of random ids in "
        f"[{args.prompt // 2}, {args.prompt}], {args.new} new tokens at T=1, median of "
        f"{args.reps}; copy bandwidth {bandwidth / 1e9:,.0f} GB/s (jitted x+1 over "
        f"{args.copy_mib} MiB), datasheet "
        + (f"{sheet / 1e9:,.0f} GB/s ({key})" if sheet else "unknown for this chip"), flush=True)


def _time_settings(args, device, sampler, params, baseline, hf_torch_model, bandwidth: float,
                   sheet) -> list[dict]:
  """Times and prints every `--rows` setting (the baseline sampler and transformers beside
  it where asked); returns the settings' results, a current side that failed beside a
  baseline that did not as {"rows", "failed": True, "baseline"}."""
  results = []
  for rows in args.rows:
    r = _setting(f"current rows {rows}", lambda: time_decode(
        sampler, params, rows, args.prompt, args.reps, bandwidth, sheet))
    if r is not None:
      results.append(r)
      print(format_setting(args.model, r), flush=True)
    if baseline is not None:
      b = _setting(f"baseline rows {rows}", lambda: time_decode(
          baseline, params, rows, args.prompt, args.reps, bandwidth, sheet))
      if b is not None:
        if r is None:  # the baseline alone still reports the setting
          r = {"rows": rows, "failed": True}
          results.append(r)
        r["baseline"] = b
        print("  baseline (xla decode attention, one step per loop iteration): "
              + format_setting(args.model, b), flush=True)
    if r is None or r.get("failed"):
      continue
    if args.hf:
      hf = time_hf(hf_torch_model, random_prompts(rows, args.prompt, sampler.cfg.vocab_size),
                   args.new, sampler.pad_id, args.reps, "cuda" if device.platform == "gpu"
                   else "cpu")
      print(f"  transformers generate (static cache): {hf['tokens_per_s']:10,.0f} tokens/s; "
            f"sampler / transformers {r['tokens_per_s'] / hf['tokens_per_s']:.2f}x", flush=True)
  return results


def _print_profiles(args, sampler, params, baseline) -> None:
  """--profile: prints the profile of each sampler's N-token call at the largest row count."""
  import jax

  rows = args.rows[-1]
  prompts = random_prompts(rows, args.prompt, sampler.cfg.vocab_size)
  sides = [("current", sampler)] + ([("baseline", baseline)] if baseline is not None else [])
  for name, s in sides:
    p = _setting(f"profile of the {name} sampler", lambda: profile_call(
        lambda: s.generate(prompts, params, jax.random.key(0)), args.new))
    if p is not None:
      print(f"{name} sampler at {rows} rows:", flush=True)
      print("\n".join(format_profile(p)), flush=True)


def _print_roofline_fraction(results: list[dict]) -> None:
  """Prints the last line: the fraction of the measured-bandwidth roofline at the largest
  row count (the baseline's too where it ran); exits when every setting failed."""
  if not results:
    raise SystemExit("rollout benchmark: every setting failed (the lines above say why)")
  last = results[-1]
  if last.get("failed"):
    b = last["baseline"]
    print(f"fraction of the measured-bandwidth roofline at {last['rows']} rows: current "
          f"failed; baseline {b['fraction']:.1%} ({b['step_ms']:.2f} ms per decode step vs "
          f"{b['roofline_ms']:.2f} ms)")
    return
  tail = ""
  if "baseline" in last:
    b = last["baseline"]
    tail = (f"; baseline {b['fraction']:.1%} ({b['step_ms']:.2f} ms), current / baseline "
            f"speed {b['step_ms'] / last['step_ms']:.2f}x")
  print(f"fraction of the measured-bandwidth roofline at {last['rows']} rows: "
        f"{last['fraction']:.1%} ({last['step_ms']:.2f} ms per decode step vs "
        f"{last['roofline_ms']:.2f} ms){tail}")


def run_accelerator(args, allow_cpu: bool = False) -> None:
  """--accelerator: every setting on the first device (module doc); `allow_cpu` lets the
  test suite run the whole command on a CPU with the tiny preset."""
  import jax

  device = jax.devices()[0]
  if device.platform == "cpu" and not allow_cpu:
    raise SystemExit("--accelerator needs a GPU or TPU (this process's first device is a CPU); "
                     "the CPU sampler benchmark is `python -m launch.benchmarks.sampler`.")
  key, sheet = datasheet_bandwidth(device.device_kind)
  bandwidth = copy_bandwidth(args.copy_mib << 20, device=device)
  _print_header(args, device, bandwidth, key, sheet)
  sampler, params = trainer_sampler(args.model, device, args.prompt, args.new,
                                    decode_impl=args.decode_impl,
                                    decode_chunk=args.decode_chunk)
  print(f"current: decode attention {args.decode_impl} "
        f"(cache slots a multiple of {sampler.engine.cache_multiple}), "
        f"{sampler.engine.decode_chunk} decode steps per device-loop iteration", flush=True)
  baseline = None
  if args.baseline:
    baseline, _ = trainer_sampler(args.model, device, args.prompt, args.new,
                                  decode_impl="xla", decode_chunk=1)
  hf_torch_model = None
  if args.hf:
    hf_torch_model = hf_model(sampler.cfg, "cuda" if device.platform == "gpu" else "cpu")
  results = _time_settings(args, device, sampler, params, baseline, hf_torch_model, bandwidth,
                           sheet)
  if args.profile:
    _print_profiles(args, sampler, params, baseline)
  _print_roofline_fraction(results)


def _setting(what: str, fn):
  """fn()'s result, or None after one line saying why it failed (so one side's failure on
  a first run, a kernel that does not compile say, still leaves the other side's figures)."""
  try:
    return fn()
  except Exception as e:  # noqa: BLE001 - reported, the run goes on
    first = (str(e).strip().splitlines() or [""])[0][:300]
    print(f"{what}: FAILED {type(e).__name__}: {first}", flush=True)
    return None


def _int_list(text: str) -> list[int]:
  try:
    values = [int(v) for v in text.split(",") if v]
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers")
  if not values or min(values) < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,32,128")
  return values


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--accelerator", action="store_true",
                  help="run on the first GPU/TPU device (required: there is no CPU mode)")
  ap.add_argument("--allow-cpu", action="store_true",
                  help="let --accelerator run on a CPU (a plumbing check with the tiny preset: "
                       "launch/gpu_checks/device_check.sh --tiny); its timings mean nothing")
  ap.add_argument("--model", default="qwen2.5-1.5b", help="model preset (random weights)")
  ap.add_argument("--rows", type=_int_list, default=[1, 32, 128],
                  help="rows per call, e.g. 1,32,128")
  ap.add_argument("--prompt", type=int, default=1024, help="P: prompt lengths in [P/2, P]")
  ap.add_argument("--new", type=int, default=512, help="N: new tokens per row (>= 2)")
  ap.add_argument("--reps", type=int, default=2, help="timed calls per setting (median)")
  ap.add_argument("--copy-mib", type=int, default=2048, help="array of the copy bandwidth")
  ap.add_argument("--hf", action="store_true", help="also transformers' generate (static cache)")
  ap.add_argument("--decode-impl", default="auto",
                  help="config.model.decode_attention_impl of the current side: auto | xla | "
                       "pallas_gpu | pallas_tpu")
  ap.add_argument("--decode-chunk", type=int, default=0,
                  help="config.rollout.decode_chunk_steps of the current side (0: by platform)")
  ap.add_argument("--baseline", action="store_true",
                  help="also time the XLA decode attention with one step per loop iteration "
                       "(the sampler before the chunked loop and the kernels), side by side")
  ap.add_argument("--profile", action="store_true",
                  help="top kernels of a decode step and host waits (jax profiler trace)")
  args = ap.parse_args(argv)
  if args.new < 2 or args.prompt < 2 or args.reps < 1:
    raise SystemExit("--new and --prompt must be >= 2 and --reps >= 1")
  from hgpo_jax.models import attention_names
  if args.decode_impl not in attention_names.DECODE_CHOICES:
    raise SystemExit(f"--decode-impl {args.decode_impl!r}: use one of "
                     f"{attention_names.DECODE_CHOICES}")
  if args.decode_chunk < 0:
    raise SystemExit("--decode-chunk must be >= 0 (0: by platform)")
  if not args.accelerator:
    raise SystemExit("launch.benchmarks.rollout runs on a GPU or TPU: pass --accelerator "
                     "(the CPU sampler benchmark is `python -m launch.benchmarks.sampler`).")
  from hgpo_jax.models import config as model_config
  try:
    model_config.get_preset(args.model)
  except (KeyError, ValueError) as e:
    raise SystemExit(f"--model: {e}") from None
  run_accelerator(args, allow_cpu=args.allow_cpu)


if __name__ == "__main__":
  main()
