"""The jitted actor update: alignment, gradient accumulation semantics, sharding, donation."""

import ast
import pathlib

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import fake_devices
import logprob_reference
from hgpo_jax.models import config as model_config
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding
from hgpo_jax.training import losses
from hgpo_jax.training import packing
from hgpo_jax.training import train_batch
from hgpo_jax.training import train_step

TINY = model_config.get_preset("tiny").replace(num_layers=1, vocab_size=64, mlp_dim=64)


def _model():
  return decoder.Decoder(TINY, rngs=nnx.Rngs(0))


def _mesh(data=1, fsdp=1, tensor=1):
  n = data * fsdp * tensor
  return sharding.make_mesh(data, fsdp, tensor, devices=fake_devices.take(n))


def _host_batch(rows=16, seed=0, row_multiple=16, per_token=False):
  """Random prompts/responses of varied lengths; advantages of both signs."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, TINY.vocab_size, rng.integers(1, 7)).tolist() for _ in range(rows)]
  responses = [rng.integers(1, TINY.vocab_size, rng.integers(1, 9)).tolist() for _ in range(rows)]
  if per_token:
    adv = [rng.normal(size=len(r)).tolist() for r in responses]
  else:
    adv = rng.normal(size=rows).astype(np.float32)
  batch, _ = train_batch.build_train_batch(prompts, responses, adv, prompt_buckets=[8], response_buckets=[8],
                                           row_multiple=row_multiple)
  return batch


def _config(**kw):
  base = dict(lr=1e-3, mini_batch_rows=16, micro_batch_rows=8)
  base.update(kw)
  return train_step.UpdateConfig(**base)


def _reference_filled(model, host):
  """`host` with old and reference log-probs of the readable reference (the same params)."""
  logp, _ = logprob_reference.token_logprobs(model, host.tokens, host.positions, host.input_mask)
  logp = np.where(host.response_mask, np.asarray(logp), 0.0).astype(np.float32)
  return host.replace(old_logprobs=logp, ref_logprobs=logp.copy())


def test_reference_logprobs_alignment():
  model = _model()
  b = _host_batch(4, row_multiple=4)
  logp, ent = logprob_reference.token_logprobs(model, b.tokens, b.positions, b.input_mask)
  logits, _ = model(b.tokens, b.positions, b.input_mask)
  ls = jax.nn.log_softmax(logits, -1)
  for r, l in [(0, 9), (1, 8), (2, 12), (3, 8)]:
    np.testing.assert_allclose(logp[r, l], ls[r, l - 1, b.tokens[r, l]], rtol=1e-5)
  np.testing.assert_allclose(ent[:, 1:], losses.entropy_from_logits(logits[:, :-1]), rtol=1e-5)
  assert np.all(np.asarray(logp[:, 0]) == 0)


@pytest.mark.parametrize("tail", [None, 8])
def test_scored_logprobs_of_a_plain_batch_equal_the_reference(tail):
  """The one log-prob function on an unpacked batch laid out one segment per row (score
  slots: its last `tail` columns, the response bucket) gives the reference's numbers."""
  model = _model()
  b = _host_batch(4, row_multiple=4)
  full, full_ent = logprob_reference.token_logprobs(model, b.tokens, b.positions, b.input_mask)
  seg = b.segments(tail, 4)
  assert seg.score_index.shape[1] == (b.seq_len - 1 if tail is None else tail)
  logp, ent = train_step.scored_logprobs(model, seg)
  cols = np.asarray(seg.score_index)
  mask = np.asarray(seg.score_mask)
  assert mask.sum() == np.asarray(b.response_mask).sum() > 0
  for name, got, want in (("logp", logp, full), ("entropy", ent, full_ent)):
    want = np.take_along_axis(np.asarray(want), cols, axis=1)
    np.testing.assert_allclose(np.asarray(got)[mask], want[mask], rtol=1e-5, atol=1e-6, err_msg=name)
  # the learner's log-prob pass: the same numbers, 0 on unused slots
  learner = train_step.Learner(model, _mesh(), _config(mini_batch_rows=4, micro_batch_rows=4,
                                                       scored_tail=tail))
  state = learner.init_state(nnx.state(model, nnx.Param))
  filled = train_step.fill_rows(learner, state.params, None, b)
  np.testing.assert_allclose(np.asarray(filled.old_logprobs),
                             np.where(mask, np.asarray(logp), 0.0), rtol=1e-5, atol=1e-6)


def test_train_step_has_no_dispatch_on_the_batch_layout():
  """One layout, one log-prob function, one update path: train_step.py never asks
  whether a batch is packed, grouped (a tuple) or unpacked."""
  source = pathlib.Path(train_step.__file__).read_text()
  tree = ast.parse(source)
  for node in ast.walk(tree):
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
      kinds = ast.unparse(node.args[1])
      for word in ("PackedBatch", "SegmentBatch", "TrainBatch", "ValueBatch", "tuple"):
        assert word not in kinds, f"line {node.lineno}: {ast.unparse(node)}"
  assert "token_logprobs" not in source.replace("scored_logprobs", "")


def _reference_step(params, tx, opt_state, micro_batches, cfg):
  """Readable gradient accumulation: mean over micro-batches of each micro-batch's loss grad."""
  graphdef, _ = nnx.split(_model(), nnx.Param)
  def loss(p, mb):
    lp, ent = logprob_reference.token_logprobs(nnx.merge(graphdef, p), mb.tokens, mb.positions,
                                               mb.input_mask)
    return losses.actor_loss(lp, ent, mb.old_logprobs, mb.ref_logprobs, mb.advantages, mb.response_mask, cfg.loss)[0]
  grad_fn = jax.jit(jax.grad(loss))
  grads = [grad_fn(params, mb) for mb in micro_batches]
  g = jax.tree.map(lambda *x: sum(x) / len(x), *grads)
  updates, _ = tx.update(g, opt_state, params)
  return optax.apply_updates(params, updates), float(optax.tree.norm(g))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_grad_accumulation_semantics(mode):
  """k=2 micro-batches: params == mean of per-micro-batch gradients (verl).

  Under token-mean this is the mean of micro-batch token means, which differs from a
  single global token mean (k=1) when micro-batches hold different token counts; under
  seq-mean-token-sum with equally sized micro-batches it equals the one-big-batch result.
  """
  mesh = _mesh()
  loss_cfg = losses.LossConfig(loss_agg=mode)
  # eps=1 makes Adam's first step ~ lr * g (not ~ lr * sign(g)), so params see gradient scale.
  cfg_k2 = _config(loss=loss_cfg, eps=1.0, lr=0.1)
  cfg_k1 = _config(loss=loss_cfg, eps=1.0, lr=0.1, micro_batch_rows=16)
  model = _model()
  params0 = nnx.state(model, nnx.Param)
  learner = train_step.Learner(model, mesh, cfg_k2)
  state = learner.init_state(params0)
  host = _reference_filled(model, _host_batch(16, seed=3, per_token=True))
  # Perturb old log-probs so ratios differ from 1 and clipping is exercised.
  host = host.replace(old_logprobs=host.old_logprobs + 0.3 * np.sign(host.advantages) * host.response_mask)
  p0 = jax.device_get(state.params)
  new_k2, metrics = learner.update(state, learner.put_batch(host))

  micro = [train_batch.slice_rows(host, 0, 8), train_batch.slice_rows(host, 8, 16)]
  tx = train_step.make_optimizer(cfg_k2)
  ref, ref_norm = _reference_step(p0, tx, tx.init(p0), micro, cfg_k2)
  np.testing.assert_allclose(metrics["grad_norm"], ref_norm, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), jax.device_get(new_k2.params), ref)

  learner1 = train_step.Learner(_model(), mesh, cfg_k1)
  new_k1, _ = learner1.update(learner1.init_state(params0), learner1.put_batch(host))
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(jax.device_get(new_k1.params)), jax.tree.leaves(ref)))
  if mode == "seq-mean-token-sum":
    assert diff < 1e-7
  else:
    assert diff > 1e-5  # mean of micro-batch means != global token mean here


def _run(mesh, cfg, steps_batches):
  model = _model()
  learner = train_step.Learner(model, mesh, cfg)
  state = learner.init_state(nnx.state(model, nnx.Param))
  ref = learner.reference_params(state)
  initial = jax.device_get(state.params)
  for host in steps_batches:
    filled = train_step.fill_rows(learner, state.params, ref, host)
    state, metrics = train_step.train_iteration(learner, state, filled)
  return learner, state, metrics, initial


@pytest.fixture(scope="module")
def single_device_run():
  cfg = _config(ppo_epochs=2)
  batches = [_host_batch(32, seed=s, row_multiple=16) for s in (1, 2)]
  _, state, metrics, initial = _run(_mesh(), cfg, batches)
  return cfg, batches, initial, jax.device_get(state.params), metrics


def _max_abs(tree_a, tree_b) -> float:
  return max(float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
             for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b)))


def _norm(tree) -> float:
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in jax.tree.leaves(tree))))


# Float32 reductions (matmuls, the gradient all-reduce, the loss means) are summed in an
# order that depends on the mesh, the CPU's vector width and XLA's thread count, so a
# sharded run equals the single-device run only up to round-off. The two tests below bound
# that round-off on principle instead of with a tolerance tuned on one machine:
#   1. one optimizer step with Adam's eps = 1, where the update lr * g / (|g| + 1) is
#      Lipschitz in the gradient with constant lr: the parameter updates must agree to
#      float32 reduction accuracy (1e-5 relative to the largest update);
#   2. several steps with the real eps = 1e-8, where Adam divides by sqrt(v) and so turns
#      a round-off-sized gradient difference on a near-zero coordinate into up to ~lr per
#      step. There the distance between the two runs is compared with the distance the
#      parameters travelled (lr x steps scale): a sharding bug (a dropped shard, a wrong
#      all-reduce) moves them by O(1) of that distance, round-off by < 1e-3 of it.
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_one_step_equals_single_device(shape):
  cfg = _config(eps=1.0, lr=0.1, mini_batch_rows=32)
  host = _host_batch(32, seed=1, row_multiple=16)
  updates, metrics = {}, {}
  for name, mesh in (("single", _mesh()), ("sharded", _mesh(*shape))):
    model = _model()
    learner = train_step.Learner(model, mesh, cfg)
    state = learner.init_state(nnx.state(model, nnx.Param))
    p0 = jax.device_get(state.params)
    filled = train_step.fill_rows(learner, state.params, learner.reference_params(state), host)
    state, metrics[name] = learner.update(state, learner.put_batch(filled))
    updates[name] = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, jax.device_get(state.params), p0)
  scale = max(float(np.max(np.abs(u))) for u in jax.tree.leaves(updates["single"]))
  assert scale > 1e-3  # the step moved the parameters: the comparison is not vacuous
  assert _max_abs(updates["sharded"], updates["single"]) <= 1e-5 * scale
  for k in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(metrics["sharded"][k], metrics["single"][k], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_update_equals_single_device(single_device_run, shape):
  cfg, batches, params0, params1, metrics1 = single_device_run
  learner, state, metrics, _ = _run(_mesh(*shape), cfg, batches)
  assert int(state.step) == 8  # 2 iterations x 2 epochs x 2 mini-batches
  if shape == (2, 2, 2):  # really sharded: embed over fsdp, heads over tensor
    q = state.params["layers"]["q"]
    assert {"fsdp", "tensor"} <= set(q.sharding.spec)
    assert q.sharding.is_equivalent_to(learner.param_shardings["layers"]["q"], q.ndim)
    assert state.opt_state[1][0].mu["layers"]["q"].sharding.is_equivalent_to(q.sharding, q.ndim)
  travelled = _norm(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, params1, params0))
  assert travelled > 1e-3  # 8 AdamW steps at lr 1e-3: each coordinate moves by up to ~8e-3
  distance = _norm(jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, jax.device_get(state.params), params1))
  assert distance <= 1e-3 * travelled
  # Per coordinate Adam's step is at most ~lr, so no coordinate may differ by more than a
  # small part of the total step budget lr x steps.
  assert _max_abs(jax.device_get(state.params), params1) <= 0.05 * cfg.lr * 8
  # The metrics are means over the last mini-batch, computed from parameters that differ
  # by the round-off above: they agree to a relative 1e-4.
  for k in ("loss", "kl", "grad_norm"):
    np.testing.assert_allclose(metrics[k], metrics1[k], rtol=1e-4, atol=1e-7)
  assert metrics["pg_clipfrac"] == pytest.approx(metrics1["pg_clipfrac"], abs=1.0 / 64)


def test_donation_and_no_recompilation():
  mesh = _mesh(8)
  cfg = _config()
  model = _model()
  learner = train_step.Learner(model, mesh, cfg)
  state = learner.init_state(nnx.state(model, nnx.Param))
  b1 = learner.put_batch(_host_batch(16, seed=5))
  old_leaf = state.params["embed"]
  state, _ = learner.update(state, b1)
  assert old_leaf.is_deleted()
  b2 = learner.put_batch(_host_batch(16, seed=6))  # other lengths, same bucket
  state, m = learner.update(state, b2)
  assert learner.update._cache_size() == 1
  assert int(state.step) == 2 and np.isfinite(m["loss"])


def test_updates_raise_logprob_of_positive_advantage_tokens():
  mesh = _mesh()
  cfg = _config(lr=1e-2, loss=losses.LossConfig(use_kl_loss=False, entropy_coeff=0.0))
  model = _model()
  learner = train_step.Learner(model, mesh, cfg)
  state = learner.init_state(nnx.state(model, nnx.Param))
  host = _host_batch(16, seed=7)
  host = host.replace(advantages=np.where(host.response_mask, 1.0, 0.0).astype(np.float32))
  before = train_step.fill_rows(learner, state.params, None, host)
  for _ in range(3):
    filled = train_step.fill_rows(learner, state.params, None, host)
    state, _ = train_step.train_iteration(learner, state, filled)
  after = train_step.fill_rows(learner, state.params, None, host)
  m = np.asarray(before.score_mask)
  assert m.sum() == host.response_mask.sum()
  assert np.asarray(after.old_logprobs)[m].mean() > np.asarray(before.old_logprobs)[m].mean() + 0.1


def test_a_non_finite_gradient_skips_the_step_and_is_counted():
  """A mini-batch whose gradient norm is not finite leaves params and optimizer state as
  they were (verl's rule) and is counted in `skipped_steps`; the next one steps."""
  mesh = _mesh()
  learner = train_step.Learner(_model(), mesh, _config(mini_batch_rows=8, micro_batch_rows=8))
  model = _model()
  state = learner.init_state(nnx.state(model, nnx.Param))
  host = _host_batch(16, seed=7)
  adv = np.array(host.advantages)
  adv[:8] = np.where(host.response_mask[:8], np.nan, 0.0)  # the first mini-batch only
  filled = train_step.fill_rows(learner, state.params, state.params, host.replace(advantages=adv))
  before = jax.device_get(state.params)
  chunks = train_step.mini_batches(learner, filled)
  assert len(chunks) == 2
  state, first = learner.update_mini_batch(state, chunks[0])
  assert float(first["skipped_step"]) == 1.0 and not np.isfinite(float(first["grad_norm"]))
  assert int(state.step) == 0
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
  state = learner.init_state(nnx.state(model, nnx.Param))
  filled = train_step.fill_rows(learner, state.params, state.params, host.replace(advantages=adv))
  state, metrics = train_step.train_iteration(learner, state, filled)
  assert metrics["skipped_steps"] == 1.0 and metrics["num_updates"] == 2.0
  assert metrics["skipped_step"] == 0.5 and int(state.step) == 1


def test_filled_logprobs_stay_on_the_mesh_for_the_update():
  """fill_logprobs leaves the laid-out mini-batches on the mesh, and the update reads them
  there: no host-to-device copy of a batch (nor of its log-probs) during the epochs."""
  model = _model()
  learner = train_step.Learner(model, _mesh(8), _config(ppo_epochs=2))
  state = learner.init_state(nnx.state(model, nnx.Param))
  batches = train_step.fill_logprobs(learner, state.params, learner.reference_params(state),
                                     packing.plain_batch(_host_batch(32, seed=8), mini_batch_rows=16))
  assert [len(parts) for parts in batches] == [1, 1]
  for parts in batches:
    leaves = jax.tree.leaves(parts[0])
    assert all(isinstance(x, jax.Array) and x.sharding == learner.row_sharding for x in leaves)
    assert all(a is b for a, b in zip(jax.tree.leaves(learner.put_batch(parts[0])), leaves))
    assert np.any(np.asarray(parts[0].old_logprobs) != 0)
  with jax.transfer_guard_host_to_device("disallow"):
    state, metrics = train_step.train_iteration(learner, state, batches)
  assert int(state.step) == 4 and np.isfinite(metrics["loss"])


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_bf16_reference_holds_half_the_bytes_and_close_logprobs():
  """`reference_dtype="bfloat16"`: the reference's floating params are bf16 (half the bytes,
  the same shardings), and its log-probs are those of the bf16-rounded weights: equal to
  the f32 learner's log-probs of params rounded to bf16 and back, and within bf16 rounding
  of the f32 reference's."""
  model = _model()
  mesh = _mesh(2)
  f32 = train_step.Learner(model, mesh, _config())
  bf16 = train_step.Learner(model, mesh, _config(reference_dtype="bfloat16"))
  state = f32.init_state(nnx.state(model, nnx.Param))
  ref32, ref16 = f32.reference_params(state), bf16.reference_params(state)
  assert {x.dtype for x in jax.tree.leaves(ref16)} == {np.dtype("bfloat16")}
  assert all(a.sharding == b.sharding for a, b in zip(jax.tree.leaves(ref16),
                                                       jax.tree.leaves(ref32)))
  assert _bytes(ref16) * 2 == _bytes(ref32)
  abstract = bf16.abstract_reference(state.params)
  assert [(a.shape, a.dtype) for a in jax.tree.leaves(abstract)] == [
      (x.shape, x.dtype) for x in jax.tree.leaves(ref16)]
  batch = bf16.put_batch(_host_batch(16, seed=3))
  got = np.asarray(bf16.compute_logprobs(ref16, batch))
  rounded = jax.tree.map(lambda x: x.astype("bfloat16").astype(x.dtype), ref32)
  np.testing.assert_allclose(got, np.asarray(f32.compute_logprobs(rounded, batch)), atol=1e-5)
  exact = np.asarray(f32.compute_logprobs(ref32, batch))
  assert 0 < np.max(np.abs(got - exact)) < 0.05
  with pytest.raises(ValueError, match="reference_dtype='float16': use one of"):
    _config(reference_dtype="float16")
  # "auto" (the configs' default): bf16 when the model computes in bf16, else unrounded
  assert train_step.Learner(model, mesh, _config(reference_dtype="auto")).reference_dtype == ""
  model.cfg = model.cfg.replace(dtype="bfloat16")
  auto = train_step.Learner(model, mesh, _config(reference_dtype="auto"))
  assert auto.reference_dtype == "bfloat16"
  assert {x.dtype for x in jax.tree.leaves(auto.reference_params(state))} == {
      np.dtype("bfloat16")}


def test_host_reference_lives_in_host_memory_and_gives_the_same_logprobs():
  """`reference_memory="host"`: the reference's params are in the devices' pinned host
  memory with the params' layout; its log-probs (copied onto the devices for the pass) equal
  the device-resident reference's bit for bit, through `fill_rows` on a data x fsdp
  mesh; the policy's own arrays stay on the devices."""
  model = _model()
  mesh = _mesh(2, 2)
  on_device = train_step.Learner(model, mesh, _config())
  offloaded = train_step.Learner(model, mesh, _config(reference_memory="host"))
  state = on_device.init_state(nnx.state(model, nnx.Param))
  ref_dev = on_device.reference_params(state)
  ref_host = offloaded.reference_params(offloaded.init_state(nnx.state(model, nnx.Param)))
  for h, d in zip(jax.tree.leaves(ref_host), jax.tree.leaves(ref_dev)):
    assert h.sharding.memory_kind == "pinned_host" and d.sharding.memory_kind == "device"
    assert h.sharding.spec == d.sharding.spec
    np.testing.assert_array_equal(np.asarray(h), np.asarray(d))
  assert all(a.sharding.memory_kind == "pinned_host"
             for a in jax.tree.leaves(offloaded.abstract_reference(state.params)))
  host = _host_batch(32, seed=4)
  a = train_step.fill_rows(on_device, state.params, ref_dev, host)
  b = train_step.fill_rows(offloaded, state.params, ref_host, host)
  assert np.any(np.asarray(a.ref_logprobs) != 0)
  np.testing.assert_array_equal(np.asarray(b.ref_logprobs), np.asarray(a.ref_logprobs))
  np.testing.assert_array_equal(np.asarray(b.old_logprobs), np.asarray(a.old_logprobs))
  assert b.ref_logprobs.sharding.memory_kind == "device"
  with pytest.raises(ValueError, match="reference_memory='disk': use one of"):
    _config(reference_memory="disk")


def test_config_errors():
  with pytest.raises(ValueError, match="multiple of micro_batch_rows"):
    train_step.UpdateConfig(mini_batch_rows=10, micro_batch_rows=4)
  with pytest.raises(ValueError, match="data-parallel size 8"):
    train_step.Learner(_model(), _mesh(8), _config(micro_batch_rows=4, mini_batch_rows=16))


def test_padding_rows_do_not_change_the_update():
  """8 real rows: k=2 micro-batches of 4 == the same rows padded to 16 (2 all-padding micro-batches)."""
  mesh = _mesh()
  model = _model()
  params0 = nnx.state(model, nnx.Param)
  host8 = _host_batch(8, seed=11, row_multiple=8)
  host16 = _host_batch(8, seed=11, row_multiple=16)
  assert host16.num_rows == 16 and not host16.response_mask[8:].any()
  out = []
  for host, mini in ((host8, 8), (host16, 16)):
    learner = train_step.Learner(model, mesh, _config(mini_batch_rows=mini, micro_batch_rows=4))
    state = learner.init_state(params0)
    filled = train_step.fill_rows(learner, state.params, state.params, host)
    state, metrics = learner.update(state, learner.put_batch(filled))
    out.append((jax.device_get(state.params), metrics))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), out[0][0], out[1][0])
  np.testing.assert_allclose(out[0][1]["loss"], out[1][1]["loss"], rtol=1e-6)


def test_on_policy_update_equals_the_separate_old_logprob_pass():
  """One optimizer step from the rollout's params: taking log pi_old from the update's own
  forward pass (detached) is the separate pass in exact arithmetic, so the step's metrics
  agree to f32 round-off (ratio exactly 1 instead of 1 +- ulps: approx_kl is 0) and the
  new parameters to a fraction of one AdamW step (lr)."""
  cfg = _config(micro_batch_rows=8)
  assert cfg.on_policy(16) and not cfg.on_policy(32)
  assert not _config(ppo_epochs=2).on_policy(16)
  assert not _config(reuse_on_policy_logprobs=False).on_policy(16)
  host = _host_batch(16, seed=11)
  out = {}
  for on_policy in (False, True):
    model = _model()
    learner = train_step.Learner(model, _mesh(), cfg)
    state = learner.init_state(nnx.state(model, nnx.Param))
    filled = train_step.fill_rows(learner, state.params, learner.reference_params(state), host,
                                      old=not on_policy)
    if on_policy:
      assert np.all(np.asarray(filled.old_logprobs) == 0)  # never computed, never read
    state, metrics = train_step.train_iteration(learner, state, filled, on_policy=on_policy)
    out[on_policy] = (jax.device_get(state.params), metrics)
  (p_sep, m_sep), (p_on, m_on) = out[False], out[True]
  assert m_on["approx_kl"] == 0.0 and abs(m_sep["approx_kl"]) < 1e-6
  for key in ("loss", "pg_loss", "entropy", "kl", "grad_norm"):
    np.testing.assert_allclose(m_on[key], m_sep[key], rtol=1e-5, atol=1e-7, err_msg=key)
  assert m_on["pg_clipfrac"] == m_sep["pg_clipfrac"] == 0.0
  for a, b in zip(jax.tree.leaves(p_sep), jax.tree.leaves(p_on)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=0.05 * cfg.lr)


def test_kl_coef_zero_trains_bitwise_as_before_without_the_reference_pass(monkeypatch):
  """kl_coef=0 (`LossConfig.kl_in_loss` false): iterations with no reference pass give
  bitwise the params and metrics, all but `kl`, of the rule before (the reference pass and
  the KL term at weight 0 whenever `use_kl_loss`)."""
  cfg = _config(ppo_epochs=2, loss=losses.LossConfig(kl_coef=0.0))
  batches = [_host_batch(32, seed=s) for s in (1, 2)]

  def train(with_reference):
    model = _model()
    learner = train_step.Learner(model, _mesh(), cfg)
    state = learner.init_state(nnx.state(model, nnx.Param))
    ref = learner.reference_params(state) if with_reference else None
    history = []
    for host in batches:
      filled = train_step.fill_rows(learner, state.params, ref, host)
      state, metrics = train_step.train_iteration(learner, state, filled)
      history.append({k: float(v) for k, v in metrics.items()})
    return jax.device_get(state.params), history

  params, history = train(with_reference=False)
  with monkeypatch.context() as m:
    m.setattr(losses.LossConfig, "kl_in_loss", property(lambda self: self.use_kl_loss))
    before_params, before_history = train(with_reference=True)
  assert before_history[1].pop("kl") > 0 and "kl" in before_history[0].keys()
  before_history[0].pop("kl")
  assert history == before_history and history[1]["grad_norm"] > 0
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before_params)):
    assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_on_policy_update_refuses_more_than_one_step():
  model = _model()
  learner = train_step.Learner(model, _mesh(), _config(micro_batch_rows=8))
  state = learner.init_state(nnx.state(model, nnx.Param))
  host = _host_batch(32, seed=12)  # two mini-batches: the second starts from new params
  with pytest.raises(ValueError, match="one optimizer step"):
    train_step.train_iteration(learner, state, host, on_policy=True)


def _constrained_host_batch(rows=8, seed=0):
  """`_host_batch` with planted constraint choices: per response token a set holding the
  token and 0-3 others (a set of one: forced), and some rows decoded freely (None)."""
  b = _host_batch(rows, seed=seed, row_multiple=rows)
  rng = np.random.default_rng(seed + 100)
  tokens, rm = np.asarray(b.tokens), np.asarray(b.response_mask)
  choices = []
  for i in range(rows):
    if i % 4 == 3:
      choices.append(None)
      continue
    row = []
    for t in tokens[i][rm[i]]:
      others = rng.choice([v for v in range(1, TINY.vocab_size) if v != t],
                          size=int(rng.integers(0, 4)), replace=False)
      row.append(tuple(sorted({int(t), *others.tolist()})))
    choices.append(row)
  return b, choices


def test_with_choices_keeps_the_choices_and_drops_forced_tokens():
  b, choices = _constrained_host_batch()
  c = train_batch.with_choices(b, choices, max_choices=4)
  rm, kept = np.asarray(b.response_mask), np.asarray(c.response_mask)
  for i, row in enumerate(choices):
    cols = np.flatnonzero(rm[i])
    if row is None:
      assert kept[i].tolist() == rm[i].tolist() and np.all(c.choices[i] == -1)
      continue
    for col, ids in zip(cols, row):
      assert kept[i, col] == (len(ids) > 1)
      want = list(ids) + [-1] * (4 - len(ids)) if len(ids) > 1 else [-1] * 4
      assert c.choices[i, col].tolist() == want
  assert 0 < kept.sum() < rm.sum()
  with pytest.raises(ValueError, match="had 4 allowed tokens, more than train.max_choices=3"):
    train_batch.with_choices(b, [[(1, 2, 3, 4)] + [(1, 2)] * (len(choices[0]) - 1)], 3)


@pytest.mark.parametrize("tail", [None, 8])
def test_constrained_logprobs_equal_the_reference(tail):
  """With choices the one log-prob function scores the constrained policy (the
  log-softmax over the allowed ids), the free rows under the full softmax; its gradient is
  finite; and the learner's log-prob pass gives the same numbers."""
  model = _model()
  b, choices = _constrained_host_batch()
  c = train_batch.with_choices(b, choices, max_choices=4)
  want_logp, want_ent = logprob_reference.constrained_token_logprobs(
      model, c.tokens, c.positions, c.input_mask, c.choices)
  seg = c.segments(tail, 8)
  logp, ent = train_step.scored_logprobs(model, seg)
  cols, mask = np.asarray(seg.score_index), np.asarray(seg.score_mask)
  for got, want in ((logp, want_logp), (ent, want_ent)):
    np.testing.assert_allclose(np.asarray(got)[mask],
                               np.take_along_axis(want, cols, axis=1)[mask], rtol=1e-5, atol=1e-6)
  free, _ = logprob_reference.token_logprobs(model, b.tokens, b.positions, b.input_mask)
  free = np.take_along_axis(np.asarray(free), cols, axis=1)
  assert not np.allclose(np.asarray(logp)[mask], free[mask], atol=1e-3)
  rows_free = np.array([r is None for r in choices])[:, None] & mask
  np.testing.assert_allclose(np.asarray(logp)[rows_free], free[rows_free], rtol=1e-5, atol=1e-6)
  params = nnx.state(model, nnx.Param)
  graphdef = nnx.graphdef(model)

  def total(p):
    lp, en = train_step.scored_logprobs(nnx.merge(graphdef, p), seg)
    return jax.numpy.sum(jax.numpy.where(mask, lp + en, 0.0))
  grads = jax.grad(total)(params)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
  learner = train_step.Learner(model, _mesh(), _config(mini_batch_rows=8, micro_batch_rows=4,
                                                       scored_tail=tail))
  state = learner.init_state(params)
  filled = train_step.fill_rows(learner, state.params, None, c)
  np.testing.assert_allclose(np.asarray(filled.old_logprobs), np.where(mask, np.asarray(logp), 0.0),
                             rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["pack", "group"])
def test_packed_and_grouped_layouts_carry_the_choices(layout):
  """The packed and length-grouped layouts score the same constrained log-probs as the
  plain rows (the same values, each once)."""
  model = _model()
  b, choices = _constrained_host_batch()
  c = train_batch.with_choices(b, choices, max_choices=4)
  seg = c.segments(None, 8)
  plain, _ = train_step.scored_logprobs(model, seg)
  plain = np.sort(np.asarray(plain)[np.asarray(seg.score_mask)])
  parts = ((packing.pack_mini_batch(c, micro_batch_rows=4),) if layout == "pack" else
           packing.group_mini_batch(c, micro_batch_rows=4, length_multiple=4))
  got = []
  for part in parts:
    assert part.choices is not None
    logp, _ = train_step.scored_logprobs(model, part)
    got += np.asarray(logp)[np.asarray(part.score_mask)].tolist()
  np.testing.assert_allclose(np.sort(got), plain, rtol=1e-5, atol=1e-6)
