"""The sampler's GPU programs compiled by XLA:GPU's deviceless compiler for an H100, no GPU.

The devices come from `jax.experimental.topologies` with a GPU target description
(`targets.devices`, `--topology h100-1` of `launch.plan`), so XLA:GPU compiles the
trainer's own generate program as it would on the chip, the Pallas kernels included:
Triton lowers `decode_attention_gpu` and `decode_merge_gpu` to PTX for sm_90a here, which
which a GPU host would otherwise be the first to find out. Needs the CUDA plugin
(`pip install -r requirements.txt -r requirements-cuda12.txt`, about 5.5 GB of CUDA
libraries, no GPU); skipped, with the reason, without it (CI does not install it).
"""

import collections
import re

import pytest

from configs import alfworld
from hgpo_jax.models import config as config_lib
from hgpo_jax.models import sharding
from hgpo_jax.compiled import plan as plan_lib
from hgpo_jax.training import experiment
from hgpo_jax.training import programs
from hgpo_jax.cost import targets

pytestmark = [
    pytest.mark.gpu_compile,
    pytest.mark.skipif(targets.cuda_plugin_available() is not None,
                       reason=targets.cuda_plugin_available() or ""),
]


def _config(model: str, prompt: int, new: int):
  c = alfworld.get_config(f"algo=hgpo,model={model}")
  c.model.compute_dtype = "bfloat16"
  c.model.decode_attention_impl = "pallas_gpu"
  c.rollout.max_prompt_tokens = prompt
  c.rollout.max_new_tokens = new
  return c


def _devices():
  return targets.devices(targets.resolve("h100-1"))


def _generate(config, rows: int) -> plan_lib.Plan:
  return plan_lib.compile_plan(experiment.from_config(config), (1, 1, 1), rollout_rows=rows,
                               micro_batch_rows=1, phases=("generate",), devices=_devices())


def _kernel_calls(config, rows: int) -> dict[str, int]:
  """Pallas calls by kernel name in the compiled generate program's HLO."""
  mesh = sharding.make_mesh(1, 1, 1, devices=_devices())
  registry = programs.build(experiment.from_config(config), mesh, micro_batch_rows=1,
                            rollout_rows=rows)
  text = registry.programs["generate"].lower().compile().as_text()
  calls = [line for line in text.splitlines() if "custom-call(" in line]
  names = [m.group(1) for line in calls
           for m in [re.search(r'op_name="[^"]*/(\w+)/pallas_call"', line)] if m]
  return collections.Counter(names)


@pytest.mark.parametrize("rows,merge_kernel", [(1, True), (32, False)])
def test_the_decode_kernels_compile_for_an_h100(rows, merge_kernel):
  """With few rows the kernel splits each row's cache into enough parts that the merge runs
  as the second Pallas kernel (`decode_kernels.GPU_MERGE_MIN_SPLITS`); with many, XLA
  merges them. Both compile to PTX, and the decode step calls each once per layer."""
  config = _config("tiny", prompt=1024, new=16)
  layers = config_lib.get_preset("tiny").num_layers
  calls = _kernel_calls(config, rows)
  assert calls["decode_attention_gpu"] == layers, calls  # the decode loop's, one per layer
  assert calls["decode_merge_gpu"] == (layers if merge_kernel else 0), calls
  plan = _generate(config, rows)
  assert plan.platform == "gpu" and not plan.phases["generate"].refused
  assert plan.phases["generate"].step.launches > 2 * layers


@pytest.mark.slow
def test_qwen2_5_1_5b_decode_step_on_an_h100_at_one_row():
  """The proxy figures of docs/performance.md ("Fewer kernels per decode step on GPUs")
  at the benchmark's one-row shape: 396 kernels per decode step and the bytes at the
  floor (1.01x the weights + valid KV)."""
  plan = _generate(_config("qwen2.5-1.5b", prompt=1024, new=512), rows=1)
  step = plan.phases["generate"].step
  # (the chunk loop's own ops, once per 16 steps, add a sixteenth of a kernel each)
  assert step.launches == pytest.approx(396, abs=0.5)
  assert step.traffic / plan.decode_necessary.total == pytest.approx(1.01, abs=0.01)
