"""The accelerator modes of the benchmarks on a CPU-only process: refused with a clear
error (they need a GPU/TPU, docs/performance.md), and their parts that run anywhere."""

import jax
import pytest

from hgpo_jax.models import config as model_config
from hgpo_jax.models import loading, sharding
from launch.benchmarks import attention_speed, train_step


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
  assert " GFLOP per call" in r["perf_line"] and r["loss"] == r["loss"]  # not NaN


def test_attention_speed_refuses_an_unknown_implementation(monkeypatch, capsys):
  monkeypatch.setattr("sys.argv", ["attention_speed", "--impls", "flash,xla"])
  with pytest.raises(SystemExit):
    attention_speed.main()
  assert "--impls takes two of" in capsys.readouterr().err
