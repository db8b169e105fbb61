"""Orbax checkpoints: round trip onto another mesh, retention, resume order, corrupt fallback."""

import logging
import os

import jax
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.models import config as model_config
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding
from hgpo_jax.training import checkpoint
from hgpo_jax.training import train_step

TINY = model_config.get_preset("tiny").replace(num_layers=1, vocab_size=64, mlp_dim=64)
CURSOR = {"iteration": 3, "task_offset": 48}
CONFIG = {"seed": 7, "algo": "hgpo", "k": 2}


def _learner(shape):
  n = int(np.prod(shape))
  mesh = sharding.make_mesh(*shape, devices=fake_devices.take(n))
  model = decoder.Decoder(TINY, rngs=nnx.Rngs(0))
  cfg = train_step.UpdateConfig(lr=1e-3, mini_batch_rows=8, micro_batch_rows=8)
  return train_step.Learner(model, mesh, cfg), nnx.state(model, nnx.Param)


@pytest.fixture(scope="module")
def state_1dev():
  learner, params = _learner((1, 1, 1))
  state = learner.init_state(params)
  # Non-trivial optimizer moments and step so the round trip checks real values.
  bump = lambda x: x + 0.5 if x.dtype == np.float32 else x
  state = state.replace(opt_state=jax.tree.map(bump, state.opt_state), step=state.step + 5)
  return learner, params, state


def _assert_tree_equal(a, b):
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_round_trip_onto_other_mesh(tmp_path, state_1dev):
  _, params, state = state_1dev
  with checkpoint.Checkpointer(str(tmp_path / "ckpt")) as ckpt:
    assert ckpt.save(5, state.to_checkpoint(), cursor=CURSOR, config=CONFIG, metrics={"loss": np.float32(0.25)})
    ckpt.wait()  # async save, then restore right after the wait
    learner8, _ = _learner((2, 2, 2))
    target = learner8.abstract_state().to_checkpoint()
    r = ckpt.restore(target)
  assert r.step == 5 and r.cursor == CURSOR and r.config == CONFIG and r.metrics == {"loss": 0.25}
  restored = train_step.TrainState.from_checkpoint(r.state)
  _assert_tree_equal(restored.params, state.params)
  _assert_tree_equal(restored.opt_state, state.opt_state)
  assert int(restored.step) == 5
  q = restored.params["layers"]["q"]
  assert q.sharding.is_equivalent_to(learner8.param_shardings["layers"]["q"], q.ndim)
  assert {"fsdp", "tensor"} <= set(q.sharding.spec)  # really split, not replicated
  assert q.addressable_shards[0].data.size * 4 == q.size


def test_retention_keeps_last_n_and_periodic(tmp_path, state_1dev):
  _, _, state = state_1dev
  small = {"step": state.step}
  with checkpoint.Checkpointer(str(tmp_path / "c"), max_to_keep=2, keep_period=4) as ckpt:
    for step in range(1, 11):
      ckpt.save(step, small, cursor={"i": step}, config=CONFIG)
    ckpt.wait()
    assert ckpt.all_steps() == [4, 8, 9, 10]


def test_corrupt_latest_falls_back_with_warning(tmp_path, state_1dev, caplog):
  _, params, state = state_1dev
  d = str(tmp_path / "c")
  tree = state.to_checkpoint()
  with checkpoint.Checkpointer(d, async_save=False) as ckpt:
    ckpt.save(1, tree, cursor={"i": 1}, config=CONFIG)
    ckpt.save(2, tree, cursor={"i": 2}, config=CONFIG)
  # Truncate every data file of step 2's array item.
  for root, _, files in os.walk(os.path.join(d, "2", "state")):
    for f in files:
      open(os.path.join(root, f), "w").close()
  learner, _ = _learner((1, 1, 1))
  with caplog.at_level(logging.WARNING):
    with checkpoint.Checkpointer(d) as ckpt:
      r = ckpt.restore(learner.abstract_state().to_checkpoint())
  assert r.step == 1 and r.cursor == {"i": 1}
  assert any("step 2" in rec.getMessage() and "unreadable" in rec.getMessage() for rec in caplog.records)
  # Nothing readable at all (step 1's files deleted this time): a clear error.
  for root, _, files in os.walk(os.path.join(d, "1", "state")):
    for f in files:
      os.remove(os.path.join(root, f))
  with checkpoint.Checkpointer(d) as ckpt, pytest.raises(checkpoint.CheckpointError, match="none of the checkpoint steps"):
    ckpt.restore(learner.abstract_state().to_checkpoint())


def test_resume_precedence(tmp_path, state_1dev):
  learner, params, state = state_1dev
  target = learner.abstract_state().to_checkpoint()
  work, other = str(tmp_path / "work"), str(tmp_path / "other")
  assert checkpoint.resume(work, target).source == "scratch"
  with pytest.raises(checkpoint.CheckpointError, match="holds no checkpoint"):
    checkpoint.resume(work, target, resume_path=other)
  with checkpoint.Checkpointer(other, async_save=False) as ckpt:
    ckpt.save(3, state.to_checkpoint(), cursor={"from": "other"}, config=CONFIG)
  r = checkpoint.resume(work, target, resume_path=other)
  assert r.source == "resume_path" and r.restored.step == 3 and r.restored.cursor == {"from": "other"}
  with checkpoint.Checkpointer(work, async_save=False) as ckpt:
    ckpt.save(9, state.to_checkpoint(), cursor={"from": "work"}, config=CONFIG)
  r = checkpoint.resume(work, target, resume_path=other)
  assert r.source == "workdir" and r.restored.step == 9 and r.restored.cursor == {"from": "work"}
  assert checkpoint.RESUME_SOURCES == ("workdir", "resume_path", "scratch")
