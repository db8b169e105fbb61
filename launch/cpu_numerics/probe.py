"""Which XLA:CPU flags change how a float32 matmul rounds: run on two machines, compare.

  python -m launch.cpu_numerics probe                      # every setting, all usable cores
  taskset -c 0,1 python -m launch.cpu_numerics probe       # the same on two cores
  python -m launch.cpu_numerics probe --settings default host_math

For each setting (a set of XLA flags added to the ISA cap of hgpo_jax.runtime; `default`
and `host_math` are hgpo_jax.runtime.CPU_NUMERICS's) it starts
a fresh process and prints one line per contraction length K = 64 ... 16384 of a
[64, K] x [K, 256] float32 matmul: the SHA-256 prefix of the product's bits, the same for
the product written as a sum of K/256 partial products of contraction 256
(`witness.chunked_matmul`), and the median time of the plain product in ms. Two
machines whose lines carry the same digest for a setting round that matmul alike under
it. docs/reproducibility.md has what an AMD EPYC (AVX2) and an Intel Xeon (AVX-512)
printed; the witness (`launch/cpu_numerics/witness.py`) then shows what the differences do to a
training iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from hgpo_jax import runtime

# The trainer's settings (their flags beyond the ISA cap), then the probe's own candidates.
SETTINGS = {
    **{name: " ".join(f for f in flags if not f.startswith("--xla_cpu_max_isa="))
       for name, flags in runtime.CPU_NUMERICS.items()},
    "no_ynnpack_eigen_1thread": ("--xla_cpu_experimental_ynn_fusion_type= "
                                 "--xla_cpu_multi_thread_eigen=false"),
    "no_library_fusions": ("--xla_cpu_experimental_ynn_fusion_type= "
                           "--xla_cpu_experimental_xnn_fusion_type= --xla_cpu_use_xnnpack=false "
                           "--xla_cpu_experimental_onednn_fusion_type="),
    "strict_dot_math": "--xla_cpu_strict_dot_conv_math=true",
    "legacy_runtime": "--xla_cpu_use_thunk_runtime=false",
    "llvm_ir_gemm": ("--xla_cpu_experimental_ynn_fusion_type= "
                     "--xla_backend_extra_options=xla_force_enable_experimental_llvm_ir_gemm"),
}
LENGTHS = (64, 256, 1024, 4096, 16384)

_CHILD = r"""
import hashlib, json, statistics, sys, time
import numpy as np, jax, jax.numpy as jnp
from launch.cpu_numerics.witness import CHUNK, chunked_matmul
digest = lambda x: hashlib.sha256(np.asarray(x).tobytes()).hexdigest()[:12]
rng = np.random.default_rng(0)
out = {}
for k in json.loads(sys.argv[1]):
  a = jnp.asarray(rng.standard_normal((64, k), dtype=np.float32))
  b = jnp.asarray(rng.standard_normal((k, 256), dtype=np.float32))
  plain = jax.jit(jnp.matmul)
  product = plain(a, b)
  times = []
  for _ in range(7):
    t = time.perf_counter(); plain(a, b).block_until_ready(); times.append(time.perf_counter() - t)
  chunked = digest(jax.jit(chunked_matmul)(a, b)) if k > CHUNK else "-"
  out[k] = [digest(product), chunked, 1e3 * statistics.median(times)]
print("RESULT " + json.dumps(out))
"""


def probe(flags: str, lengths=LENGTHS) -> dict | str:
  """{K: [plain digest, 256-chunked digest, median ms]} under `flags`, or the error line."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"{' '.join(runtime.CPU_NUMERICS['host_math'])} {flags}".strip(),
             PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
  proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(list(lengths))], env=env,
                        capture_output=True, text=True, timeout=600, cwd=root)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}
  err = (proc.stderr.strip().splitlines() or ["no output"])[-1]
  return f"failed: {err[:200]}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m launch.cpu_numerics probe", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--settings", nargs="+", choices=sorted(SETTINGS), default=list(SETTINGS))
  args = p.parse_args(argv)
  print(f"# cores usable: {len(os.sched_getaffinity(0))} of {os.cpu_count()}")
  print("# setting: K=plain digest/256-chunked digest/median ms ...")
  for name in args.settings:
    got = probe(SETTINGS[name])
    cells = got if isinstance(got, str) else "  ".join(
        f"K={k}:{d}/{c}/{ms:.2f}" for k, (d, c, ms) in got.items())
    print(f"{name:24s} {cells}", flush=True)
  return 0

