"""The reproducibility contract (docs/reproducibility.md), checked on the real trainer.

Same command, same machine, same versions: bit-identical metrics with a cold or a warm
JAX compilation cache, with one or two env server processes and with any Python hash
seed. Each run is `python -m launch.main` in a subprocess (its own JAX backend and hash
seed; the compilation cache in a directory the test creates empty), 2 iterations + the final evaluation of the Sokoban
smoke config with the tiny model; seed 1 because its groups have non-zero advantages
(seed 0's are all zero), so grouping and the estimator reach the compared numbers.
One cold run and one warm run are shared: the hash-seed and env-server runs are warm
runs compared with the cold one.

Across machines the CPU's instruction set changes XLA's CPU code (`hgpo_jax.runtime.
pin_cpu_isa` caps it at AVX2); the ISA tests show that the pinned program gives the bits
committed from an AVX2 and an AVX-512 machine, and that the cap acts.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from hgpo_jax import runtime
from hgpo_jax.models import tokenizer
from hgpo_jax.training import run_records

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = [sys.executable, "-m", "launch.main", "--config=configs/sokoban.py:algo=hgpo,k=2,smoke",
       "--config.mesh.data=1", "--config.seed=1"]


def _deterministic(record):
  """All metrics but wall-clock times, env fault counters and wall-clock FLOP rates
  (as in tests/test_train.py)."""
  return {k: v for k, v in record.items()
          if not k.startswith(("time/", "env/")) and not k.endswith(("_flop_per_s", "_mfu"))}


def _launch(workdir, cache_dir, hash_seed, num_servers=1):
  """One trainer run in a fresh process; its deterministic metrics, one dict per line."""
  env = dict(os.environ, HGPO_JAX_COMPILE_CACHE=str(cache_dir), PYTHONHASHSEED=str(hash_seed),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([*RUN, f"--config.env.num_servers={num_servers}", f"--workdir={workdir}"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = run_records.read_metrics(workdir)
  return [_deterministic(l) for l in lines]


def _same(a, b):
  """Bit equality of two metric sequences (via JSON, where a NaN equals a NaN)."""
  return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _differences(a, b):
  """The (step, key) pairs where two metric sequences differ (for the failure message)."""
  out = [(x.get("step"), k, x.get(k), y.get(k)) for x, y in zip(a, b)
         for k in sorted(set(x) | set(y)) if not _same(x.get(k), y.get(k))]
  return out[:10] if len(a) == len(b) else [("lines", len(a), len(b))]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
  """A cold run into a fresh, empty cache directory, then a warm run on the same cache."""
  base = tmp_path_factory.mktemp("repro")
  cache = base / "jax_cache"
  cache.mkdir()
  cold = _launch(base / "cold", cache, hash_seed=1)
  after_cold = sorted(os.listdir(cache))
  warm = _launch(base / "warm", cache, hash_seed=1)
  after_warm = sorted(os.listdir(cache))
  return {"base": base, "cache": cache, "cold": cold, "warm": warm,
          "after_cold": after_cold, "after_warm": after_warm}


@pytest.mark.slow
def test_cold_and_warm_compilation_cache_give_identical_metrics(shared):
  cold, warm = shared["cold"], shared["warm"]
  assert [l["step"] for l in cold] == [1, 2, 3]  # 2 iterations + the final evaluation
  # The compared numbers include non-zero advantages (not an all-zero estimator output).
  assert min(l["advantage/zero_frac"] for l in cold[:2]) < 1.0
  # Not vacuous: the cold run filled the cache and the warm run compiled nothing new,
  # i.e. every program of the warm run was loaded from the cache.
  assert any(name.startswith("jit__update") for name in shared["after_cold"]), shared["after_cold"]
  assert shared["after_warm"] == shared["after_cold"]
  assert _same(warm, cold), _differences(cold, warm)


@pytest.mark.slow
def test_python_hash_seed_does_not_change_metrics(shared):
  other = _launch(shared["base"] / "hash_seed_2", shared["cache"], hash_seed=2)
  assert _same(other, shared["cold"]), _differences(shared["cold"], other)
  # Nor the compiled programs: no set or dict order reaches a traced function.
  assert sorted(os.listdir(shared["cache"])) == shared["after_cold"]


@pytest.mark.slow
def test_two_env_servers_give_the_metrics_of_one(shared):
  two = _launch(shared["base"] / "servers_2", shared["cache"], hash_seed=1, num_servers=2)
  assert _same(two, shared["cold"]), _differences(shared["cold"], two)


# --------------------------------------------------------------------- CPU instruction set
# Each witness asserts on every x86 CPU with AVX2, with or without AVX-512 (the pin caps
# the ISA at AVX2, so a CPU without it cannot run the pinned program): no test skips on
# its own outcome or on the CPU's AVX-512 flag. docs/reproducibility.md "Tests of the
# settings" says which committed measurement each one rests on.
_WITNESS = """
import sys
if sys.argv[1] == "pin":
  from hgpo_jax import runtime
  runtime.pin_cpu_isa()
from launch.cpu_numerics import witness
print("\\n".join(witness.op_lines()))
"""
_COMMITTED = ("amd_epyc_avx2_2cores_default.txt", "intel_xeon_avx512_amx_16cores_default.txt")


def _witness_ops(mode):
  """launch.cpu_numerics.witness.op_lines() in a fresh process. mode: "pin" (hgpo_jax.runtime.
  pin_cpu_isa with the default setting) or an ISA name given as --xla_cpu_max_isa, with
  platform-dependent math off as in the default setting (so only the ISA differs)."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_cpu_max_isa" not in f and "platform_dependent_math" not in f]
  if mode != "pin":
    flags += [f"--xla_cpu_max_isa={mode}", "--xla_cpu_enable_platform_dependent_math=false"]
  env = {k: v for k, v in os.environ.items() if k != runtime.CPU_NUMERICS_ENV}
  env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _WITNESS, mode], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [l for l in proc.stdout.splitlines() if l.startswith("op ")]
  assert len(lines) == 20, proc.stdout  # every op line, not an error message
  return lines


def _committed_ops(name):
  text = (pathlib.Path(ROOT) / "docs" / "witness" / name).read_text()
  return [l for l in text.splitlines() if l.startswith("op ")]


def _cpu_flags():
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("flags"):
          return set(line.split(":", 1)[1].split())
  except OSError:
    pass
  return set()


@pytest.fixture(scope="module")
def ops():
  if "avx2" not in _cpu_flags():
    pytest.skip("needs an x86 CPU with AVX2 (read from /proc/cpuinfo); the pin is AVX2")
  return {mode: _witness_ops(mode) for mode in ("pin", "AVX")}


@pytest.mark.slow  # a fresh JAX process (shared with the next test)
def test_isa_pin_gives_the_committed_bits_on_avx2_and_avx512_cpus(ops):
  """The pinned program (ISA cap AVX2, no platform-dependent math) gives, op by op, the
  bits committed from an AMD EPYC with AVX2 only and from an Intel Xeon with AVX-512 and
  AMX (docs/witness/*_default.txt, equal to each other): elementwise ops, reductions,
  matmuls up to contraction 16384, an RMS norm and an attention block. On the AMD the
  platform-dependent-math flag is part of this (without it the long matmuls, the RMS norm
  and the attention block take other bits: docs/witness/amd_epyc_avx2_2cores_host_math.txt)."""
  amd, xeon = (_committed_ops(name) for name in _COMMITTED)
  assert len(amd) == 20 and amd == xeon
  from launch.cpu_numerics import witness
  assert witness.differing_lines(ops["pin"], amd) == []


@pytest.mark.slow  # a fresh JAX process
def test_isa_flag_changes_float_bits(ops):
  """Witness that the ISA cap reaches XLA's own kernels on this CPU: capped at AVX (no
  FMA) instead of AVX2, the jitted exp and tanh (XLA's polynomial code) round otherwise.
  The AVX code runs on every CPU with AVX2, so this asserts on AVX2 and AVX-512 CPUs
  alike; it fails if the flag is ignored."""
  pinned = dict(l.rsplit(" ", 1) for l in ops["pin"])
  capped = dict(l.rsplit(" ", 1) for l in ops["AVX"])
  assert pinned.keys() == capped.keys()
  for name in ("op exp          [64,1000]", "op tanh         [64,1000]"):
    assert capped[name] != pinned[name], name


# --------------------------------------------------------------------- time-dependent input
def test_chat_template_date_does_not_depend_on_today():
  """Llama 3.x chat templates write `strftime_now("%d %b %Y")` into the system prompt;
  transformers passes today's date, which would change prompts from day to day."""
  tiny = tokenizer.tiny_tokenizer()
  template = ('{%- if strftime_now is defined %}Today Date: {{ strftime_now("%d %b %Y") }} '
              '{% endif %}{{ messages[0]["content"] }}')
  llama_like = tokenizer.Tokenizer(tiny.backend, eos_ids=tiny.eos_ids, pad_id=tiny.pad_id,
                                   chat_template=template)
  prompt = llama_like.apply_chat_template([{"role": "user", "content": "hi"}])
  assert prompt == "Today Date: 26 Jul 2024 hi"


# --------------------------------------------------------------------- CPU numerics settings
def test_pin_cpu_numerics_adds_the_settings_flags(monkeypatch):
  monkeypatch.delenv(runtime.CPU_NUMERICS_ENV, raising=False)
  monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
  assert runtime.pin_cpu_numerics() == ("--xla_force_host_platform_device_count=2 "
                                        "--xla_cpu_max_isa=AVX2 "
                                        "--xla_cpu_enable_platform_dependent_math=false")
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX512")  # an explicit flag wins
  assert runtime.pin_cpu_numerics("no_ynnpack") == ("--xla_cpu_max_isa=AVX512 "
                                                    "--xla_cpu_experimental_ynn_fusion_type=")
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv(runtime.CPU_NUMERICS_ENV, "host_math")
  assert runtime.pin_cpu_isa() == "--xla_cpu_max_isa=AVX2"
  monkeypatch.setenv(runtime.CPU_NUMERICS_ENV, "fast")
  with pytest.raises(ValueError, match="'fast' .*HGPO_JAX_CPU_NUMERICS.* not one of "
                                       "\\['default', 'host_math', 'no_ynnpack'\\]"):
    runtime.pin_cpu_numerics()


_FUSIONS = """
import re, sys
from hgpo_jax import runtime
runtime.pin_cpu_numerics(sys.argv[1])
import jax, jax.numpy as jnp
text = jax.jit(lambda a, b: jnp.tanh(a @ b).sum(-1)).lower(
    jnp.ones((64, 128)), jnp.ones((128, 256))).compile().as_text()
print(sorted(set(re.findall(r'"kind":"(__[a-z_]+)"', text))))
"""


@pytest.mark.slow  # two fresh JAX processes
def test_no_ynnpack_numerics_hands_no_kernel_to_ynnpack():
  """Witness that the setting acts: with JAX 0.10.2 the default setting fuses a matmul and
  its reduction into a YNNPACK call; the no_ynnpack setting compiles no YNNPACK fusion."""
  kinds = {}
  for mode in ("default", "no_ynnpack"):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run([sys.executable, "-c", _FUSIONS, mode], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(env, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    kinds[mode] = proc.stdout.strip().splitlines()[-1]
  assert "__ynn_fusion" in kinds["default"], kinds
  assert "ynn" not in kinds["no_ynnpack"], kinds


def test_witness_names_the_first_differing_line():
  from launch.cpu_numerics import witness
  mine = ["# cpu: A", "op exp 1", "op tanh 2", "phase update 3"]
  assert witness.first_difference(mine, ["# cpu: B", "op exp 1", "op tanh 2",
                                               "phase update 3"]) is None  # headers ignored
  assert witness.first_difference(mine, ["op exp 1", "op tanh 9", "phase update 8"]) == (
      "here: op tanh 2 | there: op tanh 9")
  assert witness.first_difference(mine, ["op exp 1"]) == "3 lines here, 1 there"
  assert witness.differing_lines(mine, ["# cpu: B", "op exp 1", "op tanh 9",
                                              "phase update 8"]) == ["op tanh", "phase update"]
  assert witness.differing_lines(mine, mine) == []


def test_witness_chunked_matmul_is_the_sum_of_its_chunk_products():
  """The witness's host-independent form of a long matmul: sum over k-chunks of a_c @ b_c."""
  import jax.numpy as jnp
  import numpy as np
  from launch.cpu_numerics import witness
  rng = np.random.default_rng(3)
  k = 4 * witness.CHUNK
  a = rng.standard_normal((8, k), dtype=np.float32)
  b = rng.standard_normal((k, 5), dtype=np.float32)
  got = np.asarray(witness.chunked_matmul(jnp.asarray(a), jnp.asarray(b)))
  c = witness.CHUNK
  want = sum(a[:, i * c:(i + 1) * c].astype(np.float64) @ b[i * c:(i + 1) * c].astype(np.float64)
             for i in range(4))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)  # float32 sums of 256 products


@pytest.mark.slow  # two fresh JAX processes, each compiling the tiny policy's programs
def test_witness_is_identical_in_a_fresh_process(tmp_path):
  """Every op and phase digest of the witness is the same in a second process."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  first = tmp_path / "first.txt"
  cmd = [sys.executable, "-m", "launch.cpu_numerics", "witness"]
  proc = subprocess.run(cmd + ["--out", str(first)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = first.read_text().splitlines()
  assert sum(l.startswith("op ") for l in lines) == 20
  assert sum(l.startswith("phase ") for l in lines) == 11
  proc = subprocess.run(cmd + ["--compare", str(first)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
  assert proc.returncode == 0 and proc.stdout.strip().endswith("all lines equal"), (
      proc.stdout[-2000:] + proc.stderr[-2000:])
  # The two-machine claim of docs/reproducibility.md: under the default setting, the AMD
  # EPYC (AVX2) and the Intel Xeon (AVX-512) witnessed the same bits on every line; an x86
  # machine with AVX2 running the pinned versions is expected to print them too.
  from launch.cpu_numerics import witness
  if "avx2" in _cpu_flags():
    for name in ("amd_epyc_avx2_2cores_default.txt", "intel_xeon_avx512_amx_16cores_default.txt"):
      theirs = (pathlib.Path(ROOT) / "docs" / "witness" / name).read_text().splitlines()
      assert witness.differing_lines(lines, theirs) == [], name


def test_the_cpu_numerics_tool_names_its_commands_in_one_line(capsys):
  """`python -m launch.cpu_numerics` is one tool with three commands (witness, probe,
  cost); a missing or unknown command is one `prog: error:` line and exit status 2."""
  from launch.cpu_numerics import __main__ as tool
  assert sorted(tool.COMMANDS) == ["cost", "probe", "witness"]
  assert tool.main(["bogus"]) == 2
  err = capsys.readouterr().err
  assert err == ("python -m launch.cpu_numerics: error: name a command: witness, probe, cost "
                 "(got 'bogus')\n")
  assert tool.main([]) == 2 and "(got none)" in capsys.readouterr().err
