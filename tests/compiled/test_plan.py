"""Compiled plans: per-device memory from shardings and memory_analysis(), on the tiny model."""

import jax
import pytest

from configs import alfworld
from hgpo_jax.cost import analytic
from hgpo_jax.compiled import plan as plan_lib
from hgpo_jax.cost.hardware import GiB
from hgpo_jax.training import experiment
from launch import plan as plan_cli


def _config(prompt=64, response=32, mini=16, micro=16, rollout_groups=2):
  c = alfworld.get_config("algo=hgpo,model=tiny,smoke")
  c.rollout.max_prompt_tokens = prompt
  c.rollout.max_new_tokens = response
  c.train.mini_batch_rows = mini
  c.train.micro_batch_rows = micro
  c.rollout.num_groups = rollout_groups
  c.model.remat = True
  return c


def _devices(n):
  if jax.device_count() < n:
    pytest.skip(f"needs {n} (fake) devices")
  return jax.devices()[:n]


def test_parse_bytes_and_mesh():
  assert plan_lib.parse_bytes("16GiB") == 16 * GiB
  assert plan_lib.parse_bytes("80GB") == 80 * 10 ** 9
  assert plan_lib.parse_bytes("95 GiB") == 95 * GiB
  assert plan_lib.parse_mesh("fsdp=8") == (-1, 8, 1)
  assert plan_lib.parse_mesh("data=2,fsdp=2,tensor=2") == (2, 2, 2)
  with pytest.raises(ValueError, match="16GiB"):
    plan_lib.parse_bytes("sixteen")
  with pytest.raises(ValueError, match="fsdp=8"):
    plan_lib.parse_mesh("fdsp=8")


def test_candidate_meshes_prefer_data_then_fsdp_then_tensor():
  exp = experiment.from_config(_config())
  tiny = plan_lib.shapes_from_config(exp).model  # 2 kv heads: tensor <= 2
  assert plan_lib.candidate_meshes(8, tiny) == [(8, 1, 1), (4, 2, 1), (2, 4, 1), (1, 8, 1), (1, 4, 2)]


def test_candidate_meshes_keep_tensor_within_one_processs_devices():
  """8 kv heads on 8 chips of 2 hosts (v5e-8: 4 chips each): tensor=8 is not offered, since
  the sampler runs on each process's own devices (`programs.sampling_mesh` refuses it)."""
  exp = experiment.from_config(_config())
  eight_kv = plan_lib.shapes_from_config(exp).model.replace(num_heads=8, num_kv_heads=8)
  assert plan_lib.candidate_meshes(8, eight_kv)[-1] == (1, 1, 8)
  assert plan_lib.candidate_meshes(8, eight_kv, devices_per_process=4)[-2:] == [(1, 4, 2), (1, 2, 4)]


def test_persistent_bytes_fall_as_one_over_fsdp():
  """Parameters + AdamW moments per device at fsdp = 1, 2, 4, 8 are 1/fsdp of the
  unsharded bytes within 5% (only the RMSNorm scales, 0.3% of the tiny model, and the
  step/rng scalars are replicated)."""
  exp = experiment.from_config(_config())
  cfg = plan_lib.shapes_from_config(exp).model
  full = 4 * analytic.param_count(cfg)  # f32 params
  for fsdp in (1, 2, 4, 8):
    per_device = plan_lib.persistent_bytes(exp, (1, fsdp, 1), devices=_devices(fsdp))
    # params + 2 moments + reference params = 4 copies.
    assert per_device == pytest.approx(4 * full / fsdp, rel=0.05), fsdp
    if fsdp == 1:  # exact up to the optimizer's int32 step counters
      assert 4 * full <= per_device <= 4 * full + 64


@pytest.mark.slow
def test_compiled_state_bytes_fall_as_one_over_fsdp_and_match_the_shardings():
  """memory_analysis() of the compiled update: its arguments are the state plus the
  batch, and the donated state comes back aliased; the state part is the sharded bytes
  exactly and falls as 1/fsdp (within 5%)."""
  exp = experiment.from_config(_config())
  state_bytes = {}
  for fsdp in (1, 8):
    plan = plan_lib.compile_plan(exp, (1, fsdp, 1), phases=("update",), devices=_devices(fsdp))
    update = plan.phases["update"]
    rows, seq = exp.train.update.mini_batch_rows, plan.shapes.seq
    batch_bytes = rows * seq * (4 + 4 + 1 + 1 + 4 + 4 + 4) // fsdp  # TrainBatch fields
    state = update.persistent_args  # params + moments + step + rng
    # jit drops batch fields the program does not read, so the batch is at most its bytes.
    assert 0 < update.argument - state <= batch_bytes
    assert plan.params + plan.opt_state <= state <= plan.params + plan.opt_state + 64
    assert update.alias >= plan.params + plan.opt_state  # the state is donated
    state_bytes[fsdp] = plan.params + plan.opt_state
  assert state_bytes[8] == pytest.approx(state_bytes[1] / 8, rel=0.05)


@pytest.mark.slow
def test_temporaries_shrink_with_the_micro_batch():
  """Activation/temporary bytes of the update grow with rows per micro-batch (the scan
  holds one micro-batch's activations): strictly increasing, and at least 2x from 4 to
  16 rows (4x the rows; fixed-size buffers such as the gradient accumulator make it
  less than 4x)."""
  exp = experiment.from_config(_config(mini=16))
  temps = {}
  for micro in (4, 8, 16):
    plan = plan_lib.compile_plan(exp, (1, 2, 1), micro_batch_rows=micro, phases=("update",),
                                 devices=_devices(2))
    temps[micro] = plan.phases["update"].temp
  assert temps[4] < temps[8] < temps[16]
  assert temps[16] >= 2 * temps[4]


@pytest.mark.slow
def test_sampler_program_and_flops_per_device():
  """The registry's generate program (the sampler's own jitted function) compiles with the
  rollout's shapes; its FLOPs per device with the decode loop counted max_new_tokens
  times are 1/8 of the analytic prefill + max_new_tokens decode steps of all rows."""
  exp = experiment.from_config(_config(prompt=64, response=32, rollout_groups=4))  # 4 x 2 = 8 rows
  plan = plan_lib.compile_plan(exp, (1, 8, 1), phases=("generate",), devices=_devices(8))
  cfg = plan.shapes.model
  assert plan.rollout_rows == 8
  counts = analytic.analytic_sampler_flops(cfg, batch=8, prompt=64, new_tokens=32)
  # The decode step's own new key: XLA rewrites its probs x values product (a contraction
  # over one slot) as an elementwise multiply, which its cost analysis does not count
  # among the dot FLOPs (the analytic count has 2 per multiply-add).
  single_slot_pv = 2 * 8 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  expected = counts["prefill"] + 32 * (counts["decode_step"] - single_slot_pv)
  assert plan.phases["generate"].flops * 8 == pytest.approx(expected, rel=1e-3)
  assert plan.phases["generate"].calls == exp.env.max_steps - 1


@pytest.mark.slow
def test_cli_prints_the_plan_and_a_recommendation(capsys):
  if jax.device_count() != 8:
    pytest.skip("the CLI is run in-process with the suite's 8 fake devices")
  rc = plan_cli.main(["--config=configs/alfworld.py:algo=hgpo,model=tiny,smoke", "--devices", "8",
                      "--mesh", "data=1,fsdp=4,tensor=2", "--device-memory", "1GiB",
                      "--config.rollout.max_prompt_tokens=64", "--config.rollout.max_new_tokens=16",
                      "--config.train.micro_batch_rows=8", "--search"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "mesh data=1 fsdp=4 tensor=2" in out and "XLA:CPU (approximation)" in out
  assert out.strip().splitlines()[-1].startswith("fits: peak ")
  # 8-row micro-batch on a 1 GiB device: pure data parallelism fits first.
  assert "recommended: --config.mesh.data=8 --config.mesh.fsdp=1 --config.mesh.tensor=1 " \
         "--config.train.micro_batch_rows=8" in out
  assert "sampler: at most " in out


def test_cli_rejects_bad_overrides(capsys):
  """The plan loads its config as every entry point does (`configs.common.load`): a bad
  field or file is one `launch.plan: error:` line and exit status 2."""
  assert plan_cli.main(["--config=configs/alfworld.py:model=tiny", "--devices", "8",
                        "--config.train.no_such_field=1"]) == 2
  assert capsys.readouterr().err.startswith(
      "launch.plan: error: unknown config field --config.train.no_such_field")
  assert plan_cli.main(["--config=configs/nope.py", "--devices", "8"]) == 2
  assert capsys.readouterr().err.startswith(
      "launch.plan: error: config file could not be loaded (No such file or directory: "
      "'configs/nope.py')")


def test_constrained_generate_takes_its_trie_shapes_from_the_config():
  """With `rollout.max_trie_nodes` the registry's generate program is the constrained
  rollout call with tries of exactly that many nodes and the rollout's stop table (the
  call `Sampler.generate` makes, whatever a turn's allowed actions), and it compiles."""
  from hgpo_jax.models import sharding
  from hgpo_jax.sampling import constrained, types
  from hgpo_jax.training import programs
  config = _config(prompt=64, response=32)
  config.rollout.max_trie_nodes = 64
  registry = programs.build(experiment.from_config(config),
                            sharding.make_mesh(8, 1, 1, devices=_devices(8)))
  gen = registry.programs["generate"]
  assert gen.static["flags"].constraint_mode == types.WHOLE_CONSTRAINT
  assert registry.sampler.trie_nodes == 64
  rows = registry.rollout_rows
  tries = vars(gen.args[1].tries)
  assert tries["edge_parent"].shape == (rows, 64) and tries["terminal"].shape == (rows, 64)
  assert gen.args[1].stop_table.shape[0] == constrained.automaton_rows(("</action>",))  # stop table
  gen.lower().compile()
  config.rollout.max_trie_nodes = 0  # sized per call: the registry lists free decoding
  free = programs.build(experiment.from_config(config),
                        sharding.make_mesh(8, 1, 1, devices=_devices(8)))
  assert free.programs["generate"].static["flags"].constraint_mode == types.NO_CONSTRAINT


@pytest.mark.parametrize("memory", ["device", "host"])
def test_kl_coef_zero_keeps_no_reference_and_lists_no_reference_pass(memory):
  """`train.kl_coef=0` with no KL in the reward: nothing reads the reference's log-probs,
  so the registry counts no reference bytes (on the devices or in host memory) and its one
  log-prob program is the old policy's pass (none here: one optimizer step per iteration
  computes its own), one pass per mini-batch fewer; the KL in the reward brings the
  reference back."""
  from hgpo_jax.models import sharding
  from hgpo_jax.training import programs
  mesh = sharding.make_mesh(2, 1, 1, devices=_devices(2))
  config = _config()
  config.train.reference_memory = memory
  base = programs.build(experiment.from_config(config), mesh)
  config.train.kl_coef = 0.0
  free = programs.build(experiment.from_config(config), mesh)
  assert base.reference_bytes + base.reference_host_bytes == base.params_bytes
  assert free.reference_bytes == free.reference_host_bytes == 0
  assert free.persistent == base.persistent - base.reference_bytes
  passes = lambda registry: sum(p.calls for name, p in registry.programs.items()
                                if name.startswith("logprobs"))
  mini_batches = base.programs["update"].calls // config.train.ppo_epochs
  assert passes(free) == 0 and passes(base) == mini_batches > 0
  assert "logprobs_old" not in free.programs
  assert free.programs["logprobs"].jitted is free.learner.compute_logprobs
  config.train.kl_in_reward = True
  assert programs.build(experiment.from_config(config), mesh).persistent == base.persistent


def test_host_reference_leaves_the_persistent_device_bytes_and_has_its_own_program():
  """`train.reference_memory=host`: the registry counts the reference in host memory, not
  in the devices' persistent bytes, and its pass is the "logprobs" program over
  pinned-host params (the trainer's `compute_reference_logprobs`)."""
  from hgpo_jax.models import sharding
  from hgpo_jax.training import programs
  mesh = sharding.make_mesh(2, 1, 1, devices=_devices(2))
  base = programs.build(experiment.from_config(_config()), mesh)
  config = _config()
  config.train.reference_memory = "host"
  exp = experiment.from_config(config)
  offloaded = programs.build(exp, mesh)
  assert offloaded.reference_bytes == 0 and base.reference_host_bytes == 0
  assert offloaded.reference_host_bytes == base.reference_bytes == base.params_bytes
  assert offloaded.persistent == base.persistent - base.reference_bytes
  program = offloaded.programs["logprobs"]
  assert program.jitted is offloaded.learner.compute_reference_logprobs and program.persistent == 0
  assert {x.sharding.memory_kind for x in jax.tree.leaves(program.args[0])} == {"pinned_host"}
  plan = plan_lib.compile_plan(exp, (2, 1, 1), devices=_devices(2), phases=["logprobs"])
  assert plan.reference == 0 and plan.reference_host == base.reference_bytes
  assert " GiB in host memory), critic" in plan_cli.format_plan(plan)


def test_bf16_reference_halves_its_persistent_bytes_and_has_its_own_program():
  """`train.reference_dtype=bfloat16`: the registry counts half the reference bytes, and
  the reference pass is the "logprobs" program over bf16 params (the old-policy pass, when
  an iteration has one, is "logprobs_old"); the plan compiles them."""
  from hgpo_jax.models import sharding
  from hgpo_jax.training import programs
  mesh = sharding.make_mesh(2, 1, 1, devices=_devices(2))
  base = programs.build(experiment.from_config(_config()), mesh)
  config = _config()
  config.train.reference_dtype = "bfloat16"
  half = programs.build(experiment.from_config(config), mesh)
  assert half.reference_bytes * 2 == base.reference_bytes == base.params_bytes
  ref_args = jax.tree.leaves(half.programs["logprobs"].args[0])
  assert {x.dtype.name for x in ref_args} == {"bfloat16"}
  assert "logprobs_old" not in half.programs  # one optimizer step: pi_old from the update
  config.train.ppo_epochs = 2
  exp = experiment.from_config(config)
  two = programs.build(exp, mesh)
  assert {x.dtype.name for x in jax.tree.leaves(two.programs["logprobs_old"].args[0])} == {"float32"}
  plan = plan_lib.compile_plan(exp, (2, 1, 1), devices=_devices(2),
                               phases=["logprobs", "logprobs_old"])
  assert plan.reference * 2 == plan.params


def test_decode_step_traffic_against_its_necessary_bytes_per_device():
  """A generate program on mesh fsdp=2 tensor=2 (8 rows, prompt 64 + 32 new): the step's
  necessary bytes per device are the weights' shards (the matrices split 4 ways, the three
  norms of 64 whole: float32 on CPU) and the device's 4 rows x 1 kv head of keys and
  values at 3/4 of the prompt + (32 + 1) / 2 slots; the compiled step moves at least the
  weights, and the plan prints the ratio."""
  exp = experiment.from_config(_config(prompt=64, response=32, rollout_groups=4))
  plan = plan_lib.compile_plan(exp, (1, 2, 2), phases=("generate",), devices=_devices(4))
  cfg = plan.shapes.model
  need = plan.decode_necessary
  norms = (2 * cfg.num_layers + 1) * cfg.hidden_dim
  assert need.weights == 4 * ((analytic.param_count(cfg) - norms) / 4 + norms)
  assert need.kv == 2 * cfg.num_layers * 4 * 1 * cfg.head_dim * 4 * (0.75 * 64 + 33 / 2)
  step = plan.phases["generate"].step
  assert step.cycles == 0.0 and step.traffic > need.weights
  (line,) = plan_cli.decode_step_lines(plan)
  assert line.startswith("decode step of generate (8 rows)")
  assert line.endswith(f"{step.traffic / need.total:.2f}x")


def test_a_chunked_decode_counts_steps_not_chunks():
  """With `rollout.decode_chunk_steps` = 4 (the lockstep loop runs 4 steps per iteration,
  the GPU default's form) the plan's FLOPs of the whole program and its decode step's
  traffic equal the one-step loop's: the loop is weighted by 32 / 4 iterations and a step
  is a quarter of one. Without that accounting both came out 4x too large (the chunk's
  inner loop of known trip count weighted again by max_new_tokens)."""
  plans = {}
  for chunk in (1, 4):
    config = _config(prompt=64, response=32, rollout_groups=4)
    config.rollout.decode_chunk_steps = chunk
    plans[chunk] = plan_lib.compile_plan(experiment.from_config(config), (1, 2, 2),
                                         phases=("generate",), devices=_devices(4))
  one, four = plans[1].phases["generate"], plans[4].phases["generate"]
  assert four.flops == pytest.approx(one.flops, rel=0.02)
  assert four.step.traffic == pytest.approx(one.step.traffic, rel=0.15)


def test_the_micro_batch_override_reaches_the_critic_and_the_search_starts_at_one_row_per_device():
  """A smoke config (micro-batch 4) on 8 data-parallel devices: the override of 8 rows is
  every learner's (the critic kept 4 and refused the mesh); the search's candidates start
  at one row per device and stay within the mini-batch of 8."""
  from configs import webshop
  from hgpo_jax.models import sharding
  from hgpo_jax.training import programs
  exp = experiment.from_config(webshop.get_config("algo=hiper,smoke"))
  registry = programs.build(exp, sharding.make_mesh(8, 1, 1, devices=_devices(8)),
                            micro_batch_rows=8)
  assert registry.learner.config.micro_batch_rows == 8
  assert registry.critic.config.micro_batch_rows == 8
  assert plan_lib.learner_phases(exp) == ("update", "critic_update")
  assert plan_lib.learner_phases(
      experiment.from_config(alfworld.get_config("algo=hgpo,smoke"))) == ("update",)
  assert plan_lib.micro_batch_candidates(exp, 8) == [8]
  assert plan_lib.micro_batch_candidates(exp, 2) == [2, 4]
  assert plan_lib.micro_batch_candidates(exp, 16) == []
  moved = plan_lib.with_mesh(exp, (1, 4, 2))
  assert (moved.mesh.data, moved.mesh.fsdp, moved.mesh.tensor) == (1, 4, 2)
  assert (exp.mesh.data, exp.mesh.fsdp, exp.mesh.tensor) == (-1, 1, 1)


@pytest.mark.slow
def test_the_search_prefills_in_row_chunks_when_one_prefill_does_not_fit():
  """A sampler whose prefill of all 32 rows of 512 tokens at once is over the budget, where
  the update fits: the search keeps the mesh and micro-batch and prefills in chunks, the
  largest that fits (16 rows, halvings of the call that stay multiples of the 8
  data-parallel devices), and the run's command line carries the chunk."""
  config = _config(prompt=512, response=16, mini=16, micro=16, rollout_groups=16)
  exp = experiment.from_config(config)
  devices = _devices(8)
  assert plan_lib.prefill_chunk_candidates(exp, (8, 1, 1), devices) == [16, 8]
  whole = plan_lib.compile_plan(exp, (8, 1, 1), devices=devices)
  chunked = plan_lib.compile_plan(plan_lib.with_prefill_chunk(exp, 16), (8, 1, 1),
                                  devices=devices)
  assert whole.rollout_rows == 32
  # the prefill's temporaries shrink with the chunk; the learners' do not move
  assert chunked.phases["generate"].temp < 0.7 * whole.phases["generate"].temp
  assert chunked.phases["update"].temp == whole.phases["update"].temp
  # a budget (90 % of the device) between the chunked plan's peak and the whole prefill's
  budget = (chunked.peak() + whole.peak("generate")) / 2
  assert chunked.peak() < budget < whole.peak("generate")
  lines = []
  best, tried = plan_lib.recommend(exp, 8, int(budget / 0.9), 0.1, log=lines.append,
                                   devices=devices)
  assert best is not None and best.mesh == (8, 1, 1) and best.prefill_chunk_rows == 16
  said = [l.split(", ", 1)[1] for l in lines if "generate " in l and "prefill" in l]
  assert said[0].startswith("generate prefilling all 32 rows at once: ") and said[0].endswith(": no")
  assert said[1].startswith("generate with prefill chunks of 16 rows: ") and said[1].endswith("fits")
  assert len(said) == 2  # the largest chunk that fits, then no smaller one
  assert best.shapes.micro_batch_rows == 16
  assert best.phases["generate"].temp == chunked.phases["generate"].temp
  assert plan_cli.run_flags(best)[-1] == "--config.rollout.prefill_chunk_rows=16"
  command = plan_cli.run_command("C", ["--config.rollout.prefill_chunk_rows=0"], best)
  assert command.count("prefill_chunk_rows") == 1
  assert plan_lib.plan_config(exp, best).rollout.prefill_chunk_rows == 16
  # a config that sets its own chunk keeps it: the search adds no flag of its own
  config.rollout.prefill_chunk_rows = 16
  best, _ = plan_lib.recommend(experiment.from_config(config), 8, int(budget / 0.9), 0.1,
                               log=lambda s: None, devices=devices)
  assert best.mesh == (8, 1, 1) and best.prefill_chunk_rows == 0
  assert best.phases["generate"].temp == chunked.phases["generate"].temp
  command = plan_cli.run_command("C", ["--config.rollout.prefill_chunk_rows=16"], best)
  assert command.count("--config.rollout.prefill_chunk_rows=16") == 1


@pytest.mark.slow
def test_the_search_drops_a_shared_first_turn_prefill_that_does_not_fit():
  """Groups of 8 trajectories: the first turn's 16 distinct prompts prefilled once and
  copied to the 128 rows (`generate_shared`) need more than the rows' own prefill in chunks
  of 2 (`generate`). On a budget between the two the search keeps the mesh and prefills
  the first turn's rows as every other turn's (`rollout.share_prefill=false`: no
  generate_shared program), and the run's command line says so."""
  config = _config(prompt=512, response=16, mini=16, micro=1, rollout_groups=16)
  config.rollout.group_size = 8
  config.rollout.prefill_chunk_rows = 2
  exp = experiment.from_config(config)
  devices = _devices(1)
  both = plan_lib.compile_plan(exp, (1, 1, 1), micro_batch_rows=1, devices=devices)
  assert both.rollout_rows == 128
  assert max(both.peak("update"), both.peak("logprobs")) < both.peak("generate") \
      < both.peak("generate_shared")
  budget = (both.peak("generate") + both.peak("generate_shared")) / 2
  lines = []
  best, _ = plan_lib.recommend(exp, 1, int(budget / 0.9), 0.1, log=lines.append,
                               devices=devices)
  assert best is not None and best.mesh == (1, 1, 1) and not best.share_prefill
  assert "generate_shared" not in best.phases and best.decode_slots == 0
  assert best.phases["generate"].temp == both.phases["generate"].temp
  assert any("generate_shared: temporaries" in l and "rollout.share_prefill=false" in l
             for l in lines)
  assert plan_cli.run_flags(best)[-1] == "--config.rollout.share_prefill=false"
  unshared = plan_lib.plan_config(exp, best)
  assert unshared.rollout.share_prefill is False
  assert "generate_shared" not in plan_lib.program_names(unshared, (1, 1, 1), devices)
  # with room for both, the shared prefill stays
  best, _ = plan_lib.recommend(exp, 1, int(both.peak() / 0.9) + 1, 0.1,
                               log=lambda s: None, devices=devices)
  assert best.share_prefill and "generate_shared" in best.phases


@pytest.mark.slow
def test_the_search_decodes_in_slots_only_when_no_mesh_fits_every_row_at_once():
  """A sampler whose KV cache of all 128 rows (1,024 new tokens each) is over the budget on
  the one device, where the update fits and no prefill chunk helps (the cache, not the
  prefill, is what does not fit): after every chunk, the last resort decodes the rows
  through 64 cache rows (`rollout.decode_slots`, the most that fit), and the run's command
  line carries the slots and no chunk."""
  exp = experiment.from_config(
      _config(prompt=32, response=1024, mini=16, micro=1, rollout_groups=64))
  devices = _devices(1)
  assert plan_lib.decode_slot_candidates(exp, (1, 1, 1), devices) == [64, 32, 16, 8, 4, 2, 1]
  whole = plan_lib.compile_plan(exp, (1, 1, 1), micro_batch_rows=1, devices=devices)
  slotted = plan_lib.compile_plan(plan_lib.with_decode_slots(exp, 64), (1, 1, 1),
                                  micro_batch_rows=1, devices=devices, phases=("generate",))
  assert whole.rollout_rows == 128
  # the cache of every row, as allocated: layers x rows x kv heads x slots x head_dim, K and V
  m = whole.shapes.model
  assert whole.decode_necessary.cache == (2 * m.num_layers * 128 * m.num_kv_heads
                                          * (32 + 1024) * m.head_dim * 4)
  assert slotted.phases["generate"].temp < 0.6 * whole.phases["generate"].temp
  budget = (max(whole.peak("update"), slotted.peak("generate")) + whole.peak("generate")) / 2
  assert whole.peak("update") < budget and slotted.peak("generate") < budget < whole.peak("generate")
  lines = []
  best, tried = plan_lib.recommend(exp, 1, int(budget / 0.9), 0.1, log=lines.append,
                                   devices=devices)
  assert best is not None and best.mesh == (1, 1, 1)
  assert best.decode_slots == 64 and best.prefill_chunk_rows == 0
  said = [l.split(", ", 1)[1] for l in lines if "generate " in l]
  assert said[0].startswith("generate prefilling all 128 rows at once: ")
  assert [x.split(":")[0] for x in said[1:8]] == [
      f"generate with prefill chunks of {r} rows" for r in (64, 32, 16, 8, 4, 2, 1)]
  assert all(x.endswith(": no") for x in said[:8])
  assert said[8].startswith("generate refused or over budget")  # the first pass's verdict
  assert said[9].startswith("generate decoding in 64 slots: ") and said[9].endswith("fits")
  assert best.phases["generate"].temp == slotted.phases["generate"].temp
  assert plan_cli.run_flags(best)[-1] == "--config.rollout.decode_slots=64"
  command = plan_cli.run_command("C", ["--config.rollout.decode_slots=0"], best)
  assert command.count("decode_slots") == 1 and "prefill_chunk_rows" not in command
  assert plan_lib.plan_config(exp, best).rollout.decode_slots == 64
  assert tried[-1][2].endswith(": fits")


def test_cli_search_that_finds_nothing_names_what_would_shrink_the_plan(capsys):
  """A device too small for the persistent state on every candidate mesh: no compile, exit
  1, the last line `does not fit`, and the hints name the config's own levers (float32
  parameters, the KL reference kept on the devices)."""
  if jax.device_count() != 8:
    pytest.skip("the CLI is run in-process with the suite's 8 fake devices")
  rc = plan_cli.main(["--config=configs/alfworld.py:algo=hgpo,model=tiny,smoke", "--devices", "8",
                      "--device-memory", "1KiB", "--search"])
  out = capsys.readouterr().out.strip().splitlines()
  assert rc == 1
  assert out[-1].startswith("does not fit: no candidate mesh and micro-batch fits on 8 fake CPU "
                            "devices (XLA:CPU approximation) (last tried: persistent ")
  hint = [l for l in out if l.startswith("recommended: none of the candidate meshes fits")]
  assert len(hint) == 1
  assert "--config.model.dtype=bfloat16" in hint[0]
  assert "--config.train.reference_memory=host" in hint[0]
  assert "--config.train.reference_dtype=bfloat16" in hint[0]
