"""Bit witness of this machine's CPU numerics: run it on two machines and diff the output.

  python -m launch.cpu_numerics witness                                # print the witness
  python -m launch.cpu_numerics witness --out witness.txt              # and write it to a file
  python -m launch.cpu_numerics witness --compare docs/witness/amd_epyc_avx2_2cores_default.txt
  python -m launch.cpu_numerics witness --numerics host_math --compare ...   # another setting

Why: a run's metrics on two x86 machines part from the first update on (docs/
reproducibility.md), and a metrics file cannot say which operation rounded differently.
This tool computes, in a fresh process with the trainer's XLA settings, a SHA-256 of the
exact bits of (1) single operations (exp, tanh, log1p, a row sum, logsumexp, log-softmax,
matmuls with contraction lengths 64 ... 16384, and the long ones again as sums of
256-long partial products) and (2) each phase of a training iteration
on the tiny policy with the trainer's own programs: the sampler's tokens (greedy and
seeded) and their log-probs, the learner's log-probs, one PPO update (loss and updated
parameters), the GiGPO and HGPO estimators on a fixed rollout. With `--compare FILE` the
last line names the first line that differs (ops first, so the cause comes before its
consequences), or says that all lines are equal; the line before it lists every line
that differs. The header (CPU model, vector extensions,
cache sizes, cores, XLA flags, versions) is printed but not compared.

`--numerics` picks the XLA:CPU setting (hgpo_jax.runtime.CPU_NUMERICS): `default` is what
the trainer uses (the ISA cap and no platform-dependent math), `host_math` the ISA cap
alone, `no_ynnpack` the cap without YNNPACK fusions (docs/reproducibility.md says what
each pins on two machines).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform

OP_SEED = 0
CHUNK = 256  # the longest contraction that two x86 hosts were measured to round alike


def _digest(*arrays) -> str:
  import numpy as np
  h = hashlib.sha256()
  for a in arrays:
    a = np.ascontiguousarray(np.asarray(a))
    h.update(str(a.dtype).encode() + str(a.shape).encode())
    h.update(a.tobytes())
  return h.hexdigest()[:16]


def cpu_header() -> list[str]:
  """What identifies this machine's numerics (printed, not compared)."""
  import jax
  import jaxlib
  flags, model = set(), platform.processor()
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name") and model in ("", "x86_64"):
          model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
          flags = set(line.split(":", 1)[1].split())
  except OSError:
    pass
  wanted = ["sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
            "avx512_bf16", "avx512_fp16", "amx_tile"]
  caches = []
  base = "/sys/devices/system/cpu/cpu0/cache"
  for idx in sorted(os.listdir(base)) if os.path.isdir(base) else []:
    try:
      read = lambda n: open(os.path.join(base, idx, n)).read().strip()
      caches.append(f"L{read('level')}{read('type')[0].lower()}={read('size')}")
    except OSError:
      continue
  return [
      f"# cpu: {model}",
      f"# vector extensions: {' '.join(f for f in wanted if f in flags) or 'unknown'}",
      f"# caches (cpu0): {' '.join(caches) or 'unknown'}",
      f"# cores usable: {len(os.sched_getaffinity(0))} of {os.cpu_count()}",
      f"# XLA_FLAGS: {os.environ.get('XLA_FLAGS', '')}",
      f"# python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}",
  ]


def op_lines() -> list[str]:
  """Single operations, each jitted alone on fixed float32 inputs."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  rng = np.random.default_rng(OP_SEED)
  x = jnp.asarray(rng.standard_normal((64, 1000), dtype=np.float32))
  unary = {
      "exp": jnp.exp, "tanh": jnp.tanh, "log1p": lambda v: jnp.log1p(jnp.abs(v)),
      "row_sum": lambda v: v.sum(-1), "logsumexp": lambda v: jax.nn.logsumexp(v, -1),
      "log_softmax": lambda v: jax.nn.log_softmax(v, -1),
  }
  lines = [f"op {name:12s} [64,1000] {_digest(jax.jit(fn)(x))}" for name, fn in unary.items()]
  for k in (64, 256, 1024, 4096, 16384):
    a = jnp.asarray(rng.standard_normal((64, k), dtype=np.float32))
    b = jnp.asarray(rng.standard_normal((k, 256), dtype=np.float32))
    lines.append(f"op matmul       [64,{k}]x[{k},256] {_digest(jax.jit(jnp.matmul)(a, b))}")
    if k > CHUNK:
      lines.append(f"op matmul_c{CHUNK}  [64,{k}]x[{k},256] {_digest(jax.jit(chunked_matmul)(a, b))}")
  # The layouts and shapes of the tiny policy's own products: x @ W.T with W stored
  # [out, in] (both operands contiguous along the contraction), a decode step's 8 rows
  # against the 512-token LM head, an RMS norm, and one attention head block.
  nt = jax.jit(lambda a, w: a @ w.T)
  for m, k, n in ((64, 64, 256), (64, 256, 256), (8, 64, 512), (8, 128, 64)):
    a = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
    w = jnp.asarray(rng.standard_normal((n, k), dtype=np.float32))
    lines.append(f"op matmul_nt    [{m},{k}]x[{n},{k}]^T {_digest(nt(a, w))}")
  rms = jax.jit(lambda v: v * jax.lax.rsqrt(jnp.mean(v * v, -1, keepdims=True) + 1e-5))
  lines.append(f"op rms_norm     [64,1000] {_digest(rms(x))}")
  q, kk, v = (jnp.asarray(rng.standard_normal((8, 4, 72, 16), dtype=np.float32)) for _ in range(3))
  attend = jax.jit(lambda q, k, v: jnp.einsum(
      "bhts,bhsd->bhtd", jax.nn.softmax(jnp.einsum("bhtd,bhsd->bhts", q, k) / 4.0, -1), v))
  lines.append(f"op attention    [8,4,72,16] {_digest(attend(q, kk, v))}")
  return lines


def chunked_matmul(a, b):
  """a @ b as a sum of K/CHUNK partial products of contraction CHUNK (K a multiple of CHUNK).

  Each partial product is a contraction short enough that every host blocks it the same
  way; their sum is a reduction over a leading axis, which XLA emits itself (under the
  ISA cap). Measured equal on two x86 hosts where the plain matmul is not
  (docs/reproducibility.md).
  """
  import jax.numpy as jnp
  c = a.shape[1] // CHUNK
  parts = jnp.einsum("cmk,ckn->cmn", a.reshape(a.shape[0], c, CHUNK).transpose(1, 0, 2),
                     b.reshape(c, CHUNK, b.shape[1]))
  return parts.sum(0)


def phase_lines() -> list[str]:
  """One iteration's phases on the tiny policy, through the trainer's own programs."""
  import jax
  import numpy as np
  from flax import nnx

  from hgpo_jax.advantages import build_row_batch, registry
  from hgpo_jax.models import loading, sharding
  from hgpo_jax.sampling import Sampler, SamplingParams
  from hgpo_jax.training import train_batch, train_step
  from launch.benchmarks.advantages import rollout_columns

  lines = []
  model, tok, cfg = loading.load_model("tiny")
  prompts = [tok.encode(f"task {i}: put a clean mug in the coffee machine.") for i in range(8)]
  bucket = -(-max(len(p) for p in prompts) // 8) * 8
  smp = Sampler(model, tok, prompt_buckets=(bucket,), batch_buckets=(8,))
  for name, temperature in (("greedy", 0.0), ("seeded", 1.0)):
    params = SamplingParams(temperature=temperature, max_new_tokens=24, ignore_eos=True)
    out = smp.generate(prompts, params, jax.random.key(7))
    tokens = np.array([t for row in out.tokens for t in row], np.int64)
    lines.append(f"phase rollout {name} tokens      {_digest(tokens)}")
    lines.append(f"phase rollout {name} logprobs    {_digest(np.concatenate(out.logprobs))}")
  responses = [list(row) for row in out.tokens]

  mesh = sharding.make_mesh(1, 1, 1)
  update_cfg = train_step.UpdateConfig(lr=1e-2, mini_batch_rows=8, micro_batch_rows=8)
  learner = train_step.Learner(model, mesh, update_cfg)
  state = learner.init_state(nnx.state(model, nnx.Param))
  advantages = np.linspace(-1.0, 1.0, len(prompts)).astype(np.float32)
  host, _ = train_batch.build_train_batch(prompts, responses, advantages, prompt_buckets=[bucket],
                                          response_buckets=[24], row_multiple=8)
  host = train_step.fill_rows(learner, state.params, None, host)
  lines.append(f"phase learner logprobs             {_digest(host.old_logprobs)}")
  host = host.replace(ref_logprobs=host.old_logprobs)
  batch = learner.put_batch(host)
  for step in range(2):
    state, metrics = learner.update(state, batch)
    leaves = jax.tree_util.tree_leaves(state.params)
    lines.append(f"phase update {step} loss                {_digest(metrics['loss'])}")
    lines.append(f"phase update {step} parameters          {_digest(*leaves)}")

  cols = rollout_columns(400)
  grouped = build_row_batch(cols, num_levels=3, capacity=len(cols["step"]))
  rows = jax.device_put(grouped.batch)
  for name in ("gigpo", "hgpo"):
    est = registry.get(name)
    opts = est.options(k=2) if name == "hgpo" else est.options()
    lines.append(f"phase advantages {name:6s}           {_digest(est(rows, opts).advantage)}")
  return lines


def _compared(lines: list[str]) -> list[str]:
  """The lines a comparison reads: not empty, not a '#' header."""
  return [l for l in lines if l and not l.startswith("#")]


def first_difference(mine: list[str], theirs: list[str]) -> str | None:
  """The first compared line (not a '#' header) that differs, or None when all are equal."""
  a, b = _compared(mine), _compared(theirs)
  for x, y in zip(a, b):
    if x != y:
      return f"here: {x} | there: {y}"
  if len(a) != len(b):
    return f"{len(a)} lines here, {len(b)} there"
  return None


def differing_lines(mine: list[str], theirs: list[str]) -> list[str]:
  """The names (the text before the digest) of the compared lines that differ, in order."""
  return [" ".join(x.split()[:-1]) for x, y in zip(_compared(mine), _compared(theirs)) if x != y]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.cpu_numerics witness", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--numerics", default="default", help="XLA:CPU setting: default | host_math | no_ynnpack")
  p.add_argument("--out", help="also write the witness to this file")
  p.add_argument("--compare", help="a witness file from another machine (or run)")
  args = p.parse_args(argv)

  from hgpo_jax import runtime
  runtime.pin_cpu_numerics(args.numerics)  # before JAX starts its CPU backend
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_platforms", "cpu")

  lines = cpu_header() + [f"# numerics: {args.numerics}"] + op_lines() + phase_lines()
  print("\n".join(lines), flush=True)
  if args.out:
    with open(args.out, "w") as f:
      f.write("\n".join(lines) + "\n")
  if args.compare:
    with open(args.compare) as f:
      theirs = f.read().splitlines()
    diff = first_difference(lines, theirs)
    names = differing_lines(lines, theirs)
    if names:
      print(f"witness vs {args.compare}: {len(names)} lines differ: " + "; ".join(names))
    print(f"witness vs {args.compare}: " + ("all lines equal" if diff is None else
                                             f"first difference: {diff}"))
    return 0 if diff is None else 1
  return 0

