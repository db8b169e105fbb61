"""launch.benchmarks.lora: the analytic bound on LoRA's update saving (--flops, no run) and the
update benchmark's argument checks."""

import re

import pytest

from hgpo_jax.cost import analytic
from hgpo_jax.models import config as model_config
from launch.benchmarks import lora as lora_bench


def test_flops_table_is_the_analytic_count_and_remat_lowers_the_saving():
  lines = lora_bench.flops_table(16)
  rows = [tuple(float(x) for x in re.findall(r"full\s+([\d.]+)\s+lora\s+([\d.]+)", l)[0])
          for l in lines[1:]]
  assert len(rows) == 4
  full = analytic.analytic_update_flops(model_config.get_preset("smollm2-135m"), rows=16,
                                        seq=672, scored=32, remat=True)
  assert rows[2][0] == pytest.approx(full / 1e9, abs=0.05)
  ratios = [f / l for f, l in rows]
  # remat's extra forward and the weightless attention products are paid on both sides
  assert 1.0 < ratios[0] < ratios[1] < 1.5 and 1.0 < ratios[2] < ratios[3] < 1.5


def test_flops_refuses_a_rank_below_one(capsys):
  with pytest.raises(SystemExit):
    lora_bench.main(["--flops", "--rank", "0"])
  assert "--rank must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--rows", "--prompt", "--response", "--reps"])
def test_update_refuses_a_size_below_one(capsys, flag):
  with pytest.raises(SystemExit):
    lora_bench.main(["--update", flag, "0"])
  assert "must be >= 1" in capsys.readouterr().err



def test_top_layer_adapters_cut_the_update_below_the_frozen_layers():
  """With adapters on the last 8 of 30 layers the 22 below have no backward: the analytic
  update is more than twice cheaper than full fine-tuning's (every-layer LoRA: < 1.5x)."""
  lines = lora_bench.flops_table(16, top_layers=8)
  assert "of the last 8 layers" in lines[0]
  rows = [tuple(float(x) for x in re.findall(r"full\s+([\d.]+)\s+lora\s+([\d.]+)", l)[0])
          for l in lines[1:]]
  assert all(2.0 < f / l < 3.0 for f, l in rows), rows


def test_top_layers_beyond_the_model_are_refused(capsys):
  with pytest.raises(SystemExit):
    lora_bench.main(["--flops", "--top-layers", "31"])
  assert "SmolLM2-135M has 30 layers" in capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--rows", "12"], "a multiple of 8"), (["--reps", "0"], "must be >= 1"),
    (["--top-layers", "31"], "SmolLM2-135M has 30 layers")])
def test_adapted_layers_benchmark_refuses_bad_sizes(capsys, args, message):
  from launch.benchmarks import adapted_layers
  with pytest.raises(SystemExit):
    adapted_layers.main(args)
  assert message in capsys.readouterr().err
