"""Sampler programs listed from a config and compiled ahead of time.

`programs.rollout_calls` lists every generate call a run can make (batch and prompt
buckets, shared and unshared prefill, training and evaluation sampling);
`Sampler.precompile` compiles them; a call of a listed shape then runs its executable:
the same samples as the jit path, nothing traced. The group-sized shared prefill
(`Sampler(share_prefill=G)`) is what keeps that list finite.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import fake_devices
from configs import sokoban as sokoban_config
from hgpo_jax.models import decoder, sharding
from hgpo_jax.sampling import sampler
from hgpo_jax.sampling import SamplingParams
from hgpo_jax.sampling import types
from hgpo_jax.training import programs
from hgpo_jax.training import experiment

PROMPTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
           "put a clean apple in the fridge"]


@pytest.fixture(scope="module")
def prompts(tok):
  return [tok.encode(p) for p in PROMPTS]


def _recording(smp):
  """Wraps `smp.generate_program` to record (prefill rows, shared flag) of each jit call."""
  calls = []
  program = smp.generate_program

  def record(model, *args, **static):
    calls.append((args[0].prefill_tokens.shape[0], static["flags"].shared_prefill))
    return program(model, *args, **static)
  smp.generate_program = record
  return calls


def test_group_shared_prefill_runs_a_fixed_row_count(model, tok, prompts):
  """share_prefill=G: the shared prefill always runs bucket(ceil(Bb / G)) rows; a call with
  more distinct prompts than that prefills every row; the samples equal no sharing."""
  params = SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)
  kw = dict(prompt_buckets=(32,), batch_buckets=(1, 2, 4, 8))
  grouped = sampler.Sampler(model, tok, share_prefill=4, **kw)
  assert [grouped.shared_prefill_rows(b) for b in (1, 2, 4, 8)] == [1, 1, 1, 2]
  plain = sampler.Sampler(model, tok, share_prefill=False, **kw)
  anycount = sampler.Sampler(model, tok, share_prefill=True, **kw)
  assert anycount.shared_prefill_rows(8) is None
  seen = {s: _recording(s) for s in (grouped, anycount)}
  two = [prompts[0]] * 4 + [prompts[1]] * 4  # a first turn: two groups of four
  three = [prompts[0]] * 3 + [prompts[1]] * 3 + [prompts[2]] * 2
  for rows, grouped_call, anycount_call in ((two, (2, True), (2, True)),
                                            (three, (8, False), (4, True))):
    want = plain.generate(rows, params, jax.random.key(3))
    for smp, call in ((grouped, grouped_call), (anycount, anycount_call)):
      got = smp.generate(rows, params, jax.random.key(3))
      assert seen[smp][-1] == call
      assert got.tokens == want.tokens
      for a, b in zip(got.logprobs, want.logprobs):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
  with pytest.raises(ValueError, match="share_prefill=1 must be a bool or an int >= 2"):
    sampler.Sampler(model, tok, share_prefill=1, **kw)


def _config(**overrides):
  c = sokoban_config.get_config("algo=grpo,smoke")
  with c.unlocked():
    c.update_from_flattened_dict({"rollout.max_prompt_tokens": 32, "rollout.max_new_tokens": 8,
                                  "rollout.num_groups": 2, "rollout.group_size": 4,
                                  "rollout.constrained": False, **overrides})
  return c


def _sampler(model, tok, c):
  mesh = sharding.make_mesh(data=1, fsdp=1, tensor=1, devices=fake_devices.take(1))
  sharded = decoder.Decoder(model.cfg, rngs=nnx.Rngs(0))
  sharding.shard_model(sharded, mesh)
  return sampler.Sampler(sharded, tok, prompt_buckets=sampler.prompt_buckets(
      c.rollout.max_prompt_tokens), mesh=mesh, share_prefill=c.rollout.group_size,
      decode_slots=c.rollout.decode_slots)


def test_rollout_calls_are_every_bucket_and_prefill_variant(model, tok):
  c = _config()
  smp = _sampler(model, tok, c)
  names = [call[0] for call in programs.rollout_calls(experiment.from_config(c), smp, rows=8)]
  # batch buckets 1, 2, 4, 8 x the one prompt bucket 32, plus the shared prefill where
  # bucket(ceil(Bb / 4)) < Bb: Bb = 2, 4 (1 row) and 8 (2 rows); training (T = 1) and
  # evaluation (T = 0.4) share the flags, so one set
  assert names == [f"generate[train rows={b} prompt=32]" for b in (1, 2)] + [
      "generate[train rows=2 prompt=32 shared=1]", "generate[train rows=4 prompt=32]",
      "generate[train rows=4 prompt=32 shared=1]", "generate[train rows=8 prompt=32]",
      "generate[train rows=8 prompt=32 shared=2]"]
  greedy_eval = programs.rollout_calls(
      experiment.from_config(_config(**{"eval.temperature": 0.0})), smp, rows=8)
  assert len(greedy_eval) == 14 and greedy_eval[7][0] == "generate[eval rows=1 prompt=32]"
  with pytest.raises(ValueError, match="rollout.max_trie_nodes=0: the constrained"):
    programs.rollout_calls(experiment.from_config(_config(**{"rollout.constrained": True})), smp,
                           rows=8)
  # continuous batching: the calls with more rows than slots run the slotted program
  slotted = _config(**{"rollout.decode_slots": 2})
  calls = programs.rollout_calls(experiment.from_config(slotted), _sampler(model, tok, slotted),
                                 rows=8)
  assert [call[0] for call in calls] == names
  assert [call[2]["flags"].slots for call in calls] == [0, 0, 0, 2, 2, 2, 2]
  fixed = programs.rollout_calls(experiment.from_config(
      _config(**{"rollout.constrained": True, "rollout.max_trie_nodes": 64})), smp, rows=8)
  assert {call[2]["flags"].constraint_mode for call in fixed} == {types.WHOLE_CONSTRAINT}


def test_precompiled_calls_equal_jit_and_trace_nothing(model, tok, prompts):
  c = _config()
  smp, ref = _sampler(model, tok, c), _sampler(model, tok, c)
  exp = experiment.from_config(c)
  params = exp.sampling.train  # the rollout's: stop strings, T = 1
  assert smp.precompile([call[1:] for call in programs.rollout_calls(exp, smp, rows=8)]) == 7
  traced = smp.num_compilations
  # 8 rows of 2 prompts (shared: 2 rows), 3 rows (bucket 4), 1 row, and 4 rows of 2 prompts
  # (more than bucket(ceil(4 / 4)) = 1: unshared, the second call's program)
  batches = [[prompts[0]] * 4 + [prompts[1]] * 4, prompts, prompts[2:], prompts[:2] * 2]
  for i, rows in enumerate(batches):
    got = smp.generate(rows, params, jax.random.key(i))
    want = ref.generate(rows, params, jax.random.key(i))
    assert got.tokens == want.tokens and got.stop_reason == want.stop_reason
    for a, b in zip(got.logprobs, want.logprobs):
      np.testing.assert_array_equal(a, b)  # one program, compiled twice
  assert smp.num_compilations == traced and smp.unlisted_calls == 0
  assert ref.num_compilations == 3  # 8 rows shared, 4 rows, 1 row
  with pytest.warns(UserWarning, match="a call of 16 rows x prompt 32 .* is not among the 7 "
                                       "precompiled programs"):
    smp.generate(prompts * 5, params, jax.random.key(0))
  assert smp.unlisted_calls == 1 and smp.num_compilations == traced + 1


def test_precompile_needs_fixed_tries_when_constrained():
  c = _config(**{"rollout.constrained": True, "rollout.precompile": True})
  with pytest.raises(experiment.ConfigError, match="precompile=True with constrained decoding "
                                                   "needs max_trie_nodes > 0"):
    experiment.from_config(c)


@pytest.mark.slow
def test_trainer_rollout_runs_only_precompiled_programs(tmp_path):
  """`rollout.precompile`: the trainer compiles its listed programs at set-up and a rollout
  (real env server, constrained tries of the config's size) traces nothing; the same
  rollout through the jit path samples the same tokens."""
  from hgpo_jax import train
  from hgpo_jax.training import run as run_lib
  c = sokoban_config.get_config("algo=grpo,smoke")
  with c.unlocked():
    c.update_from_flattened_dict({"mesh.data": 1, "rollout.precompile": True,
                                  "rollout.max_trie_nodes": 64})
  run = run_lib.build(experiment.from_config(c), str(tmp_path))
  try:
    smp = run.sampler
    # 2 groups x 2: batch buckets 1, 2, 4 x prompt buckets 128, 256, 512, and the shared
    # prefill of 1 row at Bb = 2 and of 1 row at Bb = 4, per prompt bucket
    assert len(smp._compiled) == 15
    traced = smp.num_compilations
    first = train.rollout(run, 0)
    assert smp.num_compilations == traced and smp.unlisted_calls == 0
    smp._compiled.clear()  # the jit path
    second = train.rollout(run, 0)
    assert smp.num_compilations > traced
    assert [r.response_ids for r in first.rows] == [r.response_ids for r in second.rows]
    assert len(first.rows) > 4  # more than one turn
    # the sampler's decode work: every kept token was decoded, and the loops ran at least
    # one row-step per decoded token (rows of a call run until the slowest ends)
    decoded, row_steps = first.decode_work
    assert sum(len(r.response_ids) for r in first.rows) <= decoded <= row_steps
    assert first.decode_work == second.decode_work
  finally:
    run.close()


@pytest.mark.slow
def test_trainer_rollout_with_decode_slots_samples_the_lockstep_rollout(tmp_path):
  """`rollout.decode_slots=2` (2 groups x 2 trajectories: 4-row calls in 2 slots) with
  `rollout.precompile`: the slotted programs are listed and compiled at set-up, the rollout
  traces nothing and plays the same responses as the lockstep trainer."""
  from hgpo_jax import train
  from hgpo_jax.training import run as run_lib
  rows = {}
  for slots in (0, 2):
    c = sokoban_config.get_config("algo=grpo,smoke")
    with c.unlocked():
      c.update_from_flattened_dict({"mesh.data": 1, "rollout.precompile": True,
                                    "rollout.max_trie_nodes": 64, "rollout.decode_slots": slots})
    run = run_lib.build(experiment.from_config(c), str(tmp_path / f"slots_{slots}"))
    try:
      smp = run.sampler
      assert len(smp._compiled) == 15 and smp.decode_slots == slots
      traced = smp.num_compilations
      rollout = train.rollout(run, 0)
      assert smp.num_compilations == traced and smp.unlisted_calls == 0
      rows[slots] = rollout.rows
    finally:
      run.close()
  assert len(rows[0]) > 4
  assert [r.response_ids for r in rows[2]] == [r.response_ids for r in rows[0]]
  assert [(r.action, r.reward) for r in rows[2]] == [(r.action, r.reward) for r in rows[0]]
