"""The decode-step traffic count credits the decode attention kernels with what they read.

A decode attention kernel takes all layers' caches [L, B, Hkv, S, Dh] and reads one layer's
valid slots of each row (`models/decode_kernels.py`); booked in full, its operands counted
the whole cache once per layer (`decode_traffic.kernel_reads`)."""

import pytest

from configs import alfworld
from hgpo_jax.sampling import decode_traffic
from hgpo_jax.compiled import plan as plan_lib
from hgpo_jax.cost import targets
from hgpo_jax.training import experiment
from launch import plan as plan_cli

# A decode step (the outer loop, no fixed trip count) over 4 layers (`i < 4`), each one
# attention kernel over the stacked caches bf16[4,2,1,64,8] (8192 B each), the queries
# bf16[2,1,16,8] (512 B) and the layer index (4 B), writing f32[2,1,16,8] + f32[2,1,16]
# (1152 B), and one other custom call (a gemm: always booked in full).
_KERNEL_HLO = """HloModule decode

%layers (s: (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8])) -> (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8]) {
  %s = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %k = bf16[4,2,1,64,8]{4,3,2,1,0} get-tuple-element(%s), index=1
  %q = bf16[2,1,16,8]{3,2,1,0} get-tuple-element(%s), index=2
  %a = (f32[2,1,16,8]{3,2,1,0}, f32[2,1,16]{2,1,0}) custom-call(%q, %k, %k, %i), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(_generate_device)/while/body/closed_call/decode_attention_KIND/pallas_call" stack_frame_id=3}
  %g = bf16[2,1,16,8]{3,2,1,0} custom-call(%q, %k), custom_call_target="__cublas$gemm", metadata={op_name="jit(_generate_device)/while/body/dot_general"}
  ROOT %t = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) tuple(%i, %k, %g)
}

%four (s: (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8])) -> pred[] {
  %s = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%s), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%step (s: (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8])) -> (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8]) {
  %s = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) parameter(0)
  ROOT %inner = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) while(%s), condition=%four, body=%layers
}

%not_done (s: (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8])) -> pred[] {
  %s = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) parameter(0)
  %q = bf16[2,1,16,8]{3,2,1,0} get-tuple-element(%s), index=2
  ROOT %p = pred[] custom-call(%q), custom_call_target="any_row_left"
}

ENTRY %main (a: (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8])) -> (s32[], bf16[4,2,1,64,8], bf16[2,1,16,8]) {
  %a = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) parameter(0)
  ROOT %loop = (s32[], bf16[4,2,1,64,8]{4,3,2,1,0}, bf16[2,1,16,8]{3,2,1,0}) while(%a), condition=%not_done, body=%step
}
"""
CACHE, QUERIES, INDEX, OUTPUT = 8192, 512, 4, 1024 + 128
GEMM = QUERIES + CACHE + QUERIES  # no rule for it: operands and output in full


def test_kernel_reads_credit_one_layers_valid_slots_gpu_exactly_tpu_in_whole_blocks():
  """Of a [4, 2, 1, S, 8] cache operand the GPU kernel reads one layer (1/4) at the valid
  fraction (16 of 64 slots); the TPU kernel whole blocks of `tpu_block(S)` slots, i.e.
  block - 1 slots more per row: S = 64 is one block (all of the layer), S = 2048 blocks of
  512 (16 + 511 of 2048 slots). Queries and the layer index count whole; any other custom
  call is left to the full count (None)."""
  rule = decode_traffic.kernel_reads(16.0)
  name = 'metadata={op_name="jit(f)/while/body/decode_attention_%s/pallas_call"}'
  shapes = ["bf16[2,1,16,8]{3,2,1,0}", "bf16[4,2,1,64,8]{4,3,2,1,0}",
            "bf16[4,2,1,64,8]{4,3,2,1,0}", "s32[1]{0}"]
  assert rule(name % "gpu", shapes) == [QUERIES, CACHE / 4 * 16 / 64, CACHE / 4 * 16 / 64, 4]
  assert rule(name % "tpu", shapes) == [QUERIES, CACHE / 4, CACHE / 4, 4]
  long = "bf16[4,2,1,2048,8]{4,3,2,1,0}"
  assert rule(name % "tpu", [long])[0] == 32 * CACHE / 4 * (16 + 511) / 2048
  assert rule(name % "gpu", [long])[0] == 32 * CACHE / 4 * 16 / 2048
  assert rule('custom_call_target="__cublas$gemm"', shapes) is None
  assert rule(name % "cpu", shapes) is None


def test_kernel_reads_follow_what_a_kernel_declares(monkeypatch):
  """The rule finds kernels by their `pallas_call` name in the kernels' own declaration
  (`decode_kernels.CACHE_READS_BLOCK`), not by a list of its own: a newly declared kernel
  that copies blocks of 8 slots is credited 16 + 7 of 64 slots of one layer."""
  from hgpo_jax.models import decode_kernels
  rule = decode_traffic.kernel_reads(16.0)
  op = 'metadata={op_name="jit(f)/while/body/my_kernel/pallas_call"}'
  cache = "bf16[4,2,1,64,8]{4,3,2,1,0}"
  assert set(decode_kernels.CACHE_READS_BLOCK) == {"decode_attention_gpu", "decode_attention_tpu"}
  assert rule(op, [cache]) is None
  monkeypatch.setitem(decode_kernels.CACHE_READS_BLOCK, "my_kernel", lambda length: 8)
  assert rule(op, [cache]) == [CACHE / 4 * (16 + 7) / 64]


@pytest.mark.parametrize("kind, cache_read", [("gpu", CACHE / 4 * 16 / 64), ("tpu", CACHE / 4)])
def test_step_cost_credits_the_kernel_and_keeps_its_bytes_apart(kind, cache_read):
  """One decode step = 4 layers. With the rule each kernel call books the queries, its two
  cache reads (credited), the index and its output; without it, both whole caches.
  `kernel_bytes` is the kernels' credited reads, the part XLA:TPU's cycles leave out."""
  text = _KERNEL_HLO.replace("KIND", kind)
  kernel_reads = QUERIES + 2 * cache_read + INDEX
  credited = decode_traffic.step_cost(text, (512,), valid_slots=16.0)
  assert credited.traffic == 4 * (kernel_reads + OUTPUT + GEMM)
  assert credited.kernel_bytes == 4 * kernel_reads
  full = decode_traffic.step_cost(text, (512,))
  assert full.traffic == 4 * (QUERIES + 2 * CACHE + INDEX + OUTPUT + GEMM)
  assert full.kernel_bytes == 0.0
  # launches: the kernel and the gemm in each of the 4 layers; the tuples, the loop and
  # the loop conditions' custom call launch nothing that the step's body counts
  assert credited.launches == full.launches == 8.0
  assert decode_traffic.step_cost(text, (512,), steps_per_iteration=4).launches == 2.0


def test_a_plan_adds_the_kernels_reads_at_the_chips_bandwidth():
  """XLA:TPU's cycles leave the Mosaic call out: the plan's estimate per decode step adds
  the credited kernel bytes at the chip's datasheet bandwidth (v5e: 819 GB/s), and per
  generate call once per decode step (max_new_tokens of them)."""
  step = decode_traffic.StepCost(traffic=3e9, cycles=1e6, kernel_bytes=819e6)
  phase = plan_lib.Phase(name="generate", flops=0.0, argument=0, output=0, alias=0, temp=0,
                         persistent_args=0, calls=2, cycles=5e6, step=step)
  shapes = plan_lib.shapes_from_config(
      experiment.from_config(alfworld.get_config("algo=hgpo,model=tiny,smoke")))
  plan = plan_lib.Plan(mesh=(1, 1, 1), shapes=shapes, params=0, opt_state=0, reference=0,
                       phases={"generate": phase}, platform="tpu", device_kind="TPU v5 lite")
  seconds = plan_lib.estimated_seconds(plan, 1e-9)
  assert seconds["generate decode step"] == pytest.approx(1e-3 + 1e-3)
  assert seconds["generate"] == pytest.approx(2 * (5e-3 + shapes.response * 1e-3))
  plan.device_kind = "cpu"  # no datasheet bandwidth: the cycles alone
  assert plan_lib.estimated_seconds(plan, 1e-9)["generate decode step"] == pytest.approx(1e-3)


@pytest.mark.tpu_compile
@pytest.mark.skipif(targets.libtpu_available() is not None,
                    reason=targets.libtpu_available() or "")
def test_a_tpu_compiled_generate_with_the_kernel_is_credited_with_its_valid_blocks():
  """The tiny model's generate program with `decode_attention_impl=pallas_tpu`, compiled
  by XLA:TPU for one v5e chip (32 rows, prompt 4096 + 512 new: cache S = 4608, blocks of
  512): the Mosaic calls of one decode step are found by name and credited with each
  layer's rows' valid slots + 511 (block rounding), keys and values (+ the queries and
  bounds, < 1 %); booked in full they were the whole cache once per layer. (With fewer
  rows XLA:TPU keeps the tiny model's caches in on-chip memory, which moves no HBM bytes.)"""
  config = alfworld.get_config("algo=hgpo,model=tiny,smoke")
  config.rollout.max_prompt_tokens = 4096
  config.rollout.max_new_tokens = 512
  config.rollout.num_groups = 16
  config.model.decode_attention_impl = "pallas_tpu"
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 1, 1, 1
  devices = targets.devices(targets.resolve("v5e-8"))[:1]
  plan = plan_lib.compile_plan(experiment.from_config(config), (1, 1, 1), phases=("generate",),
                               devices=devices)
  cfg, need, step = plan.shapes.model, plan.decode_necessary, plan.phases["generate"].step
  rows, slots = plan.rollout_rows, 4608
  assert rows == 32 and need.valid_slots == 0.75 * 4096 + 513 / 2
  one_layer_cache = rows * cfg.num_kv_heads * slots * cfg.head_dim * 2  # bf16, one of k/v
  cache_reads = cfg.num_layers * 2 * one_layer_cache * (need.valid_slots + 511) / slots
  assert cache_reads < step.kernel_bytes < 1.01 * cache_reads
  line = plan_cli.decode_step_lines(plan)[0]
  assert f"the attention kernels' valid blocks {step.kernel_bytes / 1e6:.1f} MB" in line
