"""The accelerator modes of the benchmarks on a CPU-only process: refused with a clear
error (they need a GPU/TPU, docs/performance.md), and their parts that run anywhere."""

import re
import types

import jax
import pytest

from hgpo_jax import perf
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
  # with remat bound the compiled count from above, within 5 % (tests/test_perf.py
  # test_remat_adds_at_most_one_forward_of_the_layers: XLA keeps the attention products);
  # then the rate and the MFU are that count over the median step time and the peak.
  m = re.fullmatch(r"tiny devices=1 update: ([0-9.]+) GFLOP per call, ([0-9.]+) GFLOP/s, "
                   r"MFU ([0-9.]+)% of ([0-9.]+) GFLOP/s \(.+\)", r["perf_line"])
  assert m, r["perf_line"]
  gflop, rate, mfu, peak = (float(x) for x in m.groups())
  bound = perf.analytic_update_flops(cfg, rows=2, seq=32, scored=31, remat=True) / 1e9
  no_remat = perf.analytic_update_flops(cfg, rows=2, seq=32, scored=31, remat=False) / 1e9
  assert no_remat < gflop <= bound + 5e-4 and gflop >= 0.95 * bound, (gflop, bound, no_remat)
  # equal up to the printed rounding (3 and 2 decimals; the median time rounded to 0.1 ms)
  rounding = 5e-4 / gflop + 5e-5 / r["step_s_median"]
  assert rate == pytest.approx(gflop / r["step_s_median"], rel=rounding, abs=0.01)
  assert mfu == pytest.approx(100 * rate / peak, rel=1e-2, abs=0.01)
  assert peak == pytest.approx(perf.device_peak(dtype="bfloat16").flops_per_s / 1e9, abs=0.05)


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
