"""The critic: clipped value loss, estimator targets from critic values, sharded update."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import fake_devices
from hgpo_jax.advantages import hae
from hgpo_jax.advantages import registry
from hgpo_jax.advantages.hae import TAG_ACTION as A
from hgpo_jax.advantages.hae import TAG_SUBGOAL as G
from hgpo_jax.advantages.hae import TAG_SWITCH as S
from hgpo_jax.models import config as model_config
from hgpo_jax.models import critic
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding
from hgpo_jax.rollout import rollout as rollout_lib
from hgpo_jax.training import critic_step
from hgpo_jax.training import losses
from hgpo_jax.training import train_batch
from hgpo_jax.training import train_step
from hgpo_jax.training import value_targets

TINY = model_config.get_preset("tiny").replace(num_layers=1, vocab_size=64, mlp_dim=64)


# ---------------------------------------------------------------------------- value loss
def _reference_value_loss(v, v_old, r, mask, c, scale):
  """verl compute_value_loss, written out per entry (float64)."""
  num = den = clipped = 0.0
  for idx in zip(*np.nonzero(mask)):
    v_clip = min(max(v[idx], v_old[idx] - c), v_old[idx] + c)
    l1, l2 = (v[idx] - r[idx]) ** 2, (v_clip - r[idx]) ** 2
    num += max(l1, l2)
    den += 1
    clipped += l2 > l1
  return scale * num / den, clipped / den


def test_value_loss_golden_entries():
  # (V, V_old, R): clipped from above (V moved 1.0 > c away from V_old, the clipped value
  # 0.5 is farther from R=2) -> max((1-2)^2, (0.5-2)^2) = 2.25, clipped; inside the clip
  # range -> (0.2-2)^2 = 3.24, not clipped; clipping helps -> the unclipped loss counts.
  v = np.array([[1.0, 0.2, -1.0]], np.float32)
  v_old = np.array([[0.0, 0.0, 0.0]], np.float32)
  r = np.array([[2.0, 2.0, -3.0]], np.float32)
  # third: V_clip = -0.5, l1 = 4, l2 = 6.25 -> 6.25 (clipped): PPO's pessimistic max.
  for cols, loss, frac in (([0], 0.5 * 2.25, 1.0), ([1], 0.5 * 3.24, 0.0), ([2], 0.5 * 6.25, 1.0),
                           ([0, 1, 2], 0.5 * (2.25 + 3.24 + 6.25) / 3, 2 / 3)):
    mask = np.zeros((1, 3), bool)
    mask[0, cols] = True
    got_loss, got_frac = losses.value_loss(v, v_old, r, mask, 0.5, 0.5)
    assert float(got_loss) == pytest.approx(loss, rel=1e-6)
    assert float(got_frac) == pytest.approx(frac, rel=1e-6)


@pytest.mark.parametrize("c", [0.05, 0.5, 100.0])
def test_value_loss_equals_reference_on_random_inputs(c):
  rng = np.random.default_rng(0)
  v, v_old, r = (rng.normal(size=(6, 9, 3)).astype(np.float32) for _ in range(3))
  mask = rng.random((6, 9, 3)) < 0.4
  loss, frac = losses.value_loss(v, v_old, r, mask, c, 0.5)
  ref_loss, ref_frac = _reference_value_loss(v.astype(np.float64), v_old, r, mask, c, 0.5)
  if c == 100.0:
    assert ref_frac == 0.0  # nothing clipped: the loss is half the masked MSE
    assert ref_loss == pytest.approx(0.5 * np.mean(np.square(v - r)[mask]), rel=1e-6)
  else:
    assert 0.0 < ref_frac < 1.0  # both branches are exercised
  # ~70 float32 squared terms summed: relative round-off < 70 * 6e-8.
  assert float(loss) == pytest.approx(ref_loss, rel=1e-5)
  assert float(frac) == pytest.approx(ref_frac, abs=1e-7)


def test_explained_variance():
  r = np.array([1.0, 2.0, 3.0, 4.0, 100.0])
  v = np.array([1.5, 2.0, 2.0, 5.0, -7.0])
  mask = np.array([1, 1, 1, 1, 0], bool)
  # R - V over the mask = [-0.5, 0, 1, -1]: var_unbiased = 0.729166..; Var(R) = 1.666..
  expected = 1 - (np.var([-0.5, 0, 1, -1], ddof=1) / (np.var([1, 2, 3, 4], ddof=1) + 1e-5))
  assert critic_step.explained_variance(v, r, mask) == pytest.approx(expected, rel=1e-12)
  assert critic_step.explained_variance(r, r, mask) == pytest.approx(1.0, abs=1e-12)
  assert critic_step.explained_variance(v, r, np.eye(1, 5, dtype=bool)[0]) == 0.0


# ---------------------------------------------------------------------------- targets
@dataclasses.dataclass
class Row:
  """The StepRow fields the critic path reads."""

  group: int
  traj: int
  step: int
  response_ids: list
  reward: float = 0.0
  valid: bool = True
  done: bool = False
  anchor_obs: str = ""
  token_tags: list = None
  switch: str = None
  subgoal: str = None


def _targets(rows, name, opts, values_nlh, prompt_len, num_tokens):
  est = registry.get(name)
  return value_targets.critic_targets(
      rows, rollout_lib.advantage_columns(rows), est, opts, values_nlh, prompt_len=prompt_len,
      num_tokens=num_tokens, gamma=0.95, invalid_penalty=0.1, capacity=8)


def test_ppo_targets_are_per_row_gae_of_the_token_values():
  # traj 0: two valid steps, reward 10 at the end; traj 1: one invalid step, reward 0.
  rows = [Row(0, 0, 0, [1, 2, 3]), Row(0, 0, 1, [4, 5], reward=10.0, done=True),
          Row(1, 1, 0, [6, 7, 8, 9], valid=False, done=True)]
  rows = [rows[2], rows[0], rows[1]]  # any order: results come back in this order
  p, t = 2, 5
  rng = np.random.default_rng(1)
  values = rng.normal(size=(3, p + t, 1)).astype(np.float32)
  out = _targets(rows, "gae", registry.get("gae").options(), values, p, t)
  score = [-0.1, 10.0, 10.0]  # S = R(tau) - eta (1 - valid)
  lengths = [4, 3, 2]
  mask = np.zeros((3, t), bool)
  raw = np.zeros((3, t))
  for i in range(3):
    mask[i, :lengths[i]] = True
    for j in range(lengths[i]):  # gamma = lambda = 1: A_j = S - V_j (docs/algorithms.md)
      raw[i, j] = score[i] - values[i, p + j, 0]
  sel = raw[mask]
  whitened = (raw - sel.mean()) / np.sqrt(sel.var(ddof=1) + 1e-8)
  np.testing.assert_array_equal(out.loss_mask, mask)
  np.testing.assert_array_equal(out.value_mask[..., 0], mask)
  # rtol: a handful of float32 ops per entry plus a 9-term mean/variance.
  np.testing.assert_allclose(out.token_advantage[mask], whitened[mask], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out.returns[..., 0][mask], np.broadcast_to(np.array(score)[:, None], (3, t))[mask],
                             rtol=1e-6)
  np.testing.assert_array_equal(out.old_values[..., 0][mask], values[:, p:, 0][mask])
  assert np.all(out.token_advantage[~mask] == 0) and np.all(out.returns[~out.value_mask] == 0)


def test_hiper_targets_read_values_at_the_tagged_positions():
  """One 3-turn trajectory, switches [start, KEEP, SWITCH], rewards [0, 0, 10] (done),
  gamma = lambda_turn = 1, lambda_seg = 0.95. Values sit at the read-out positions;
  every other column holds -50, so a wrong position changes every number below.

  By hand: V_low = [2, 3, 6], V_high(0) = 1.5, V_high(2) = 5, V_term = [1, 2, 4].
  A_low: t1 = 0 + V_high(2) - 3 = 2; t0 = (0 + 3 - 2) + 2 = 3; t2 = 10 - 6 = 4.
  A_high: segment 2: 10 - 5 = 5; segment 1: (0 + 5 - 1.5) + 0.95 * 5 = 8.25.
  ret_term = [5, 5, 10]; A_term = ret_term - V_term = [4, 3, 6].
  """
  tags = [[S, S, G, G, A, A],  # complete: V_low after </subgoal> at 4
          [S, S, A, A],  # no subgoal: V_low after </switch> at 2
          [S, S, G, G]]  # truncated in the subgoal: after </switch> at 2
  rows = [Row(0, 0, t, list(range(1, len(tags[t]) + 1)), token_tags=tags[t], switch=sw,
              subgoal="find key", reward=10.0 * (t == 2), done=t == 2)
          for t, sw in enumerate(("SWITCH", "KEEP", "SWITCH"))]
  order = [1, 2, 0]
  rows = [rows[i] for i in order]
  p, t = 3, 6
  values = np.full((3, p + t, 3), -50.0, np.float32)
  low_at = [4, 2, 2]
  for turn, (v_low, v_high, v_term) in enumerate(((2, 1.5, 1), (3, 99, 2), (6, 5, 4))):
    i = order.index(turn)
    values[i, p + low_at[turn], hae.HEAD_LOW] = v_low
    values[i, p, hae.HEAD_HIGH] = v_high
    values[i, p, hae.HEAD_TERM] = v_term
  opts = hae.HaeOptions(norm_adv=False)
  out = _targets(rows, "hae", opts, values, p, t)
  by_turn = lambda x: np.asarray(x)[[order.index(k) for k in range(3)]]
  np.testing.assert_allclose(by_turn(out.fields["values"]), [[2, 1.5, 1], [3, 99, 2], [6, 5, 4]])
  np.testing.assert_array_equal(by_turn(out.fields["segment_start"]), [True, False, True])
  expected = {  # turn -> [(column, head, target)]
      0: [(4, hae.HEAD_LOW, 5.0), (0, hae.HEAD_HIGH, 9.75), (0, hae.HEAD_TERM, 5.0)],
      1: [(2, hae.HEAD_LOW, 5.0), (0, hae.HEAD_TERM, 5.0)],  # KEEP: no V_high target
      2: [(2, hae.HEAD_LOW, 10.0), (0, hae.HEAD_HIGH, 10.0), (0, hae.HEAD_TERM, 10.0)]}
  for turn, entries in expected.items():
    i = order.index(turn)
    want = np.zeros((t, 3), bool)
    for col, head, target in entries:
      want[col, head] = True
      assert out.returns[i, col, head] == pytest.approx(target, abs=1e-5)
      assert out.old_values[i, col, head] == values[i, p + col, head]
    np.testing.assert_array_equal(out.value_mask[i], want)
  # Turn 2 has no <action> block: released, its whole response also gets A_low = 4
  # (switch 6 + 4, subgoal 5 + 4; docs/algorithms.md §8).
  token_adv = {0: [4, 4, 8.25, 8.25, 3, 3], 1: [3, 3, 2, 2, 0, 0], 2: [10, 10, 9, 9, 0, 0]}
  for turn, want in token_adv.items():
    np.testing.assert_allclose(out.token_advantage[order.index(turn)], want, atol=1e-5)
  np.testing.assert_array_equal(out.loss_mask[order.index(1)], [1, 1, 1, 1, 0, 0])


def test_hiper_targets_need_token_tags():
  rows = [Row(0, 0, 0, [1, 2], switch="KEEP")]
  with pytest.raises(ValueError, match="response_format='hiper'"):
    _targets(rows, "hae", hae.HaeOptions(), np.zeros((1, 4, 3), np.float32), 2, 2)
  rows[0].token_tags = [S]
  with pytest.raises(ValueError, match="1 token_tags for 2"):
    _targets(rows, "hae", hae.HaeOptions(), np.zeros((1, 4, 3), np.float32), 2, 2)


# ---------------------------------------------------------------------------- update
def _value_batch(rows=32, heads=1, seed=0):
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, TINY.vocab_size, rng.integers(1, 7)).tolist() for _ in range(rows)]
  responses = [rng.integers(1, TINY.vocab_size, rng.integers(1, 9)).tolist() for _ in range(rows)]
  batch, _ = train_batch.build_train_batch(prompts, responses, np.zeros(rows, np.float32),
                                           prompt_buckets=[8], response_buckets=[8], row_multiple=16)
  mask = np.repeat(np.asarray(batch.response_mask)[..., None], heads, axis=-1)
  returns = rng.normal(size=mask.shape).astype(np.float32) * 3
  old = rng.normal(size=mask.shape).astype(np.float32) * 0.1
  return critic_step.value_batch(batch, mask, returns, old)


def _critic_learner(mesh, heads=1, **kw):
  cfg = train_step.UpdateConfig(**{"lr": 1e-3, "mini_batch_rows": 32, "micro_batch_rows": 8, **kw})
  policy = decoder.Decoder(TINY, rngs=nnx.Rngs(0))
  learner = critic_step.CriticLearner(critic.abstract_critic(TINY, heads), mesh, cfg)
  params = critic.params_from_policy(nnx.state(policy, nnx.Param), TINY, heads, seed=0)
  return learner, learner.init_state(params)


def _mesh(data=1, fsdp=1, tensor=1):
  return sharding.make_mesh(data, fsdp, tensor, devices=fake_devices.take(data * fsdp * tensor))


def test_update_lowers_the_value_loss_and_values_match_the_model():
  learner, state = _critic_learner(_mesh(), heads=3, lr=1e-2)
  batch = _value_batch(heads=3)
  v0 = critic_step.compute_values(learner, state.params, batch)
  model = nnx.merge(learner.graphdef, state.params)
  direct = np.asarray(model.values(batch.tokens, batch.positions, batch.input_mask))
  # Same program up to micro-batching (lax.map over 8-row blocks): f32 round-off only.
  np.testing.assert_allclose(v0, direct, rtol=1e-5, atol=1e-6)
  batch = batch.replace(old_values=np.where(batch.value_mask, v0, 0.0).astype(np.float32))
  losses_seen = []
  for _ in range(5):
    state, m = train_step.train_iteration(learner, state, batch)
    losses_seen.append(m["value_loss"])
  assert int(state.step) == 5
  # Random targets leave an irreducible loss and c = 0.5 bounds each move from V_old,
  # so the loss falls steadily but not to 0 (measured, the sum of the three heads' token
  # means: 27.38, 25.26, 23.44, 22.36, 22.34).
  assert all(b < a for a, b in zip(losses_seen, losses_seen[1:])), losses_seen
  assert losses_seen[-1] < 0.9 * losses_seen[0], losses_seen


# Sharded vs single device, one step with Adam's eps = 1 (the update lr * g / (|g| + 1)
# is Lipschitz in the gradient): parameter updates agree to float32 reduction accuracy,
# 1e-5 relative to the largest update (the reasoning of test_train_step's sharded test).
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_critic_step_equals_single_device(shape):
  batch = _value_batch(heads=3, seed=3)
  updates, metrics = {}, {}
  for name, mesh in (("single", _mesh()), ("sharded", _mesh(*shape))):
    learner, state = _critic_learner(mesh, heads=3, eps=1.0, lr=0.1)
    p0 = jax.device_get(state.params)
    state, metrics[name] = learner.update(state, learner.put_batch(batch))
    if name == "sharded" and shape == (2, 2, 2):
      q = state.params["backbone"]["layers"]["q"]
      assert {"fsdp", "tensor"} <= set(q.sharding.spec)
    updates[name] = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, jax.device_get(state.params), p0)
  scale = max(float(np.max(np.abs(u))) for u in jax.tree.leaves(updates["single"]))
  assert scale > 1e-3
  diff = max(float(np.max(np.abs(a - b))) for a, b in
             zip(jax.tree.leaves(updates["sharded"]), jax.tree.leaves(updates["single"])))
  assert diff <= 1e-5 * scale
  for k in ("value_loss", "grad_norm"):
    np.testing.assert_allclose(metrics["sharded"][k], metrics["single"][k], rtol=1e-5)
  assert float(metrics["sharded"]["value_clipfrac"]) == pytest.approx(
      float(metrics["single"]["value_clipfrac"]), abs=1.0 / 200)
