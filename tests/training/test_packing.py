"""Row packing and length-grouped micro-batches of the actor update: layout invariants,
and packed == grouped == unpacked for the log-probs, the loss, the metrics and the
optimizer step (on one device and sharded)."""

import jax
import numpy as np
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

TINY = model_config.get_preset("tiny").replace(num_layers=2, vocab_size=64, mlp_dim=64)


def _model():
  return decoder.Decoder(TINY, rngs=nnx.Rngs(0))


def _mesh(data=1):
  return sharding.make_mesh(data, 1, 1, devices=fake_devices.take(data))


def _host_batch(rows=12, seed=0, row_multiple=16):
  """Prompts of 1-10 tokens, responses of 0-8 (an empty one included), per-token advantages
  of both signs; rows padded to `row_multiple` with the builder's unscored copies."""
  rng = np.random.default_rng(seed)
  prompts = [rng.integers(1, TINY.vocab_size, rng.integers(1, 11)).tolist() for _ in range(rows)]
  responses = [rng.integers(1, TINY.vocab_size, rng.integers(1, 9)).tolist() for _ in range(rows)]
  responses[3] = []
  adv = [rng.normal(size=len(r)).tolist() for r in responses]
  batch, _ = train_batch.build_train_batch(prompts, responses, adv, prompt_buckets=[10],
                                           response_buckets=[8], row_multiple=row_multiple)
  return batch


def _reference_token_mean(x, mask, micro):
  """verl's accumulation, readably: mean over micro-batches with a scored token of each
  micro-batch's token mean."""
  means = []
  for s in range(0, x.shape[0], micro):
    m = mask[s:s + micro]
    if m.any():
      means.append(float(losses.aggregate(x[s:s + micro], m, "token-mean")))
  return float(np.mean(means)) if means else 0.0


def test_token_mean_weights_give_the_mean_of_micro_batch_means():
  b = _host_batch()
  x = np.random.default_rng(1).normal(size=b.tokens.shape).astype(np.float32)
  mask = np.asarray(b.response_mask)
  for micro in (2, 4, 8, 16):
    w = packing.token_mean_weights(mask, micro)
    assert np.all(w[~mask] == 0)
    np.testing.assert_allclose(np.sum(w * x), _reference_token_mean(x, mask, micro), rtol=1e-5)
    np.testing.assert_allclose(np.sum(w), 1.0, rtol=1e-6)


def test_packed_layout_holds_every_scored_step_once_with_restarting_positions():
  b = _host_batch()
  p = packing.pack_mini_batch(b, micro_batch_rows=4, score_multiple=8)
  tokens, seg, pos = np.asarray(p.tokens), np.asarray(p.segment_ids), np.asarray(p.positions)
  assert p.num_rows % 4 == 0 and p.seq_len == b.seq_len and p.score_index.shape[1] % 8 == 0
  # segments of the packed rows, as token lists
  packed_steps = []
  for r in range(p.num_rows):
    ids = seg[r]
    n = int(np.sum(ids > 0))
    assert np.all(ids[:n] > 0) and np.all(ids[n:] == 0)  # segments first, then padding
    for s in range(1, int(ids.max(initial=0)) + 1):
      cols = np.flatnonzero(ids == s)
      assert np.all(np.diff(cols) == 1)  # contiguous
      np.testing.assert_array_equal(pos[r, cols], np.arange(len(cols)))
      packed_steps.append(tuple(tokens[r, cols]))
  # the scored rows of the unpacked batch (row 3 has an empty response; rows 12-15 are
  # the builder's unscored copies): each appears exactly once
  scored_rows = [i for i in range(b.num_rows) if np.asarray(b.response_mask)[i].any()]
  assert 3 not in scored_rows and len(scored_rows) == 11
  expected = [tuple(np.asarray(b.tokens)[i][np.asarray(b.input_mask)[i]]) for i in scored_rows]
  assert sorted(packed_steps) == sorted(expected)
  assert p.num_rows < b.num_rows  # the point of packing
  # score slots: the response tokens, their advantages and weights, in order
  rm = np.asarray(b.response_mask)
  w = packing.token_mean_weights(rm, 4)
  got_tokens = np.take_along_axis(tokens, np.asarray(p.score_index), axis=1)[np.asarray(p.score_mask)]
  assert sorted(got_tokens.tolist()) == sorted(np.asarray(b.tokens)[rm].tolist())
  np.testing.assert_allclose(np.sort(np.asarray(p.advantages)[np.asarray(p.score_mask)]),
                             np.sort(np.asarray(b.advantages)[rm]))
  np.testing.assert_allclose(np.sum(p.loss_weights), np.sum(w), rtol=1e-6)
  assert np.all(np.asarray(p.loss_weights)[~np.asarray(p.score_mask)] == 0)
  np.testing.assert_allclose(packing.token_fill([(p,)]),
                             np.sum(np.asarray(b.input_mask)[scored_rows]) / (p.num_rows * p.seq_len))


def test_packing_is_deterministic_and_first_fit_decreasing():
  assert packing._bins([5, 3, 8, 2, 4], 10) == [[2, 3], [0, 4], [1]]
  b = _host_batch(seed=4)
  p1 = packing.pack_mini_batch(b, micro_batch_rows=4)
  p2 = packing.pack_mini_batch(b, micro_batch_rows=4)
  jax.tree.map(np.testing.assert_array_equal, p1, p2)


def test_packed_logprobs_and_entropy_equal_the_unpacked_ones():
  model = _model()
  b = _host_batch()
  logp, ent = logprob_reference.token_logprobs(model, b.tokens, b.positions, b.input_mask)
  p = packing.pack_mini_batch(b, micro_batch_rows=4)
  plogp, pent = train_step.scored_logprobs(model, p)
  # map each packed slot back to its unpacked (row, column) through the token sequence
  rm = np.asarray(b.response_mask)
  seg, idx, sm = np.asarray(p.segment_ids), np.asarray(p.score_index), np.asarray(p.score_mask)
  by_tokens = {}
  for i in np.flatnonzero(rm.any(1)):
    by_tokens[tuple(np.asarray(b.tokens)[i][np.asarray(b.input_mask)[i]])] = i
  checked = 0
  for r in range(p.num_rows):
    for s in range(sm.shape[1]):
      if not sm[r, s]:
        continue
      col = idx[r, s]
      cols = np.flatnonzero(seg[r] == seg[r, col])
      i = by_tokens[tuple(np.asarray(p.tokens)[r, cols])]
      l = int(np.flatnonzero(np.asarray(b.input_mask)[i])[0]) + (col - cols[0])
      assert rm[i, l]
      np.testing.assert_allclose(plogp[r, s], logp[i, l], rtol=1e-5, atol=1e-6)
      np.testing.assert_allclose(pent[r, s], ent[i, l], rtol=1e-5, atol=1e-6)
      checked += 1
  assert checked == rm.sum()


def _layouts(host):
  """The host batch in the two layouts of `training.packing`, as the trainer passes them."""
  return {"packed": packing.pack_batch(host, mini_batch_rows=16, micro_batch_rows=4),
          "grouped": packing.group_batch(host, mini_batch_rows=16, micro_batch_rows=4,
                                         length_multiple=4)}


def _packed_vs_unpacked(mesh, on_policy=False, layout="packed"):
  cfg = train_step.UpdateConfig(lr=0.1, eps=1.0, mini_batch_rows=16, micro_batch_rows=4,
                                loss=losses.LossConfig(kl_coef=0.1, entropy_coeff=0.01))
  model = _model()
  params0 = nnx.state(model, nnx.Param)
  learner = train_step.Learner(model, mesh, cfg)
  state = learner.init_state(params0)
  ref = jax.tree.map(lambda x: x * 1.01, learner.reference_params(state))  # KL != 0
  host = _host_batch()
  filled = train_step.fill_rows(learner, state.params, ref, host)
  packed = train_step.fill_logprobs(learner, state.params, ref, _layouts(host)[layout])
  if not on_policy:  # ratio e^1.5 on every token: clipped (A > 0) and dual-clipped (A < 0)
    shift = lambda p: p.replace(old_logprobs=p.old_logprobs - 1.5 * p.score_mask)
    filled = shift(filled)
    packed = [tuple(map(shift, parts)) for parts in packed]
  s1, m1 = train_step.train_iteration(learner, state, filled, on_policy=on_policy)
  p1 = jax.device_get(s1.params)
  s2, m2 = train_step.train_iteration(learner, learner.init_state(params0), packed, on_policy=on_policy)
  return p1, m1, jax.device_get(s2.params), m2


# Tolerances: packed and unpacked are different float32 programs (other attention mask
# layouts, other summation orders of the loss), so they agree to float32 rounding of
# sums over ~100 tokens (~1e-6 relative), amplified by one AdamW step with eps=1, lr=0.1.
@pytest.mark.parametrize("layout", ["packed", "grouped"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_packed_update_equals_unpacked_update(on_policy, layout):
  p1, m1, p2, m2 = _packed_vs_unpacked(_mesh(), on_policy, layout)
  assert set(m1) == set(m2)
  for k in m1:
    np.testing.assert_allclose(m2[k], m1[k], rtol=2e-5, atol=1e-6, err_msg=k)
  if not on_policy:
    assert m1["pg_clipfrac"] > 0 and m1["pg_clipfrac_lower"] > 0 and m1["kl"] > 0
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p2, p1)
  assert max(float(np.max(np.abs(a))) for a in jax.tree.leaves(jax.tree.map(np.subtract, p2, p1))) < 1e-5


@pytest.mark.parametrize("layout", ["packed", "grouped"])
def test_packed_update_is_the_same_sharded(layout):
  _, _, one, m_one = _packed_vs_unpacked(_mesh(1), layout=layout)
  _, _, two, m_two = _packed_vs_unpacked(_mesh(2), layout=layout)
  for k in m_one:
    np.testing.assert_allclose(m_two[k], m_one[k], rtol=2e-5, atol=1e-6, err_msg=k)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), two, one)


def test_length_grouped_micro_batches_hold_every_scored_step_once_longest_first():
  b = _host_batch(rows=14, seed=2, row_multiple=16)
  micro = packing.group_mini_batch(b, micro_batch_rows=4, length_multiple=4, score_multiple=8)
  rm, im, toks = (np.asarray(x) for x in (b.response_mask, b.input_mask, b.tokens))
  scored_rows = [i for i in range(b.num_rows) if rm[i].any()]
  assert len(scored_rows) == 13  # row 3's response is empty; rows 14, 15 are copies
  assert len(micro) == 4  # ceil(13 / 4): the copies are dropped, not carried
  lengths, steps = [], []
  for m in micro:
    seg, pos, t = np.asarray(m.segment_ids), np.asarray(m.positions), np.asarray(m.tokens)
    assert m.num_rows == 4 and m.seq_len % 4 == 0 and m.score_index.shape[1] % 8 == 0
    n = (seg > 0).sum(axis=1)
    assert m.seq_len == -(-n.max() // 4) * 4  # the longest step, rounded up to the multiple
    for r in range(4):
      assert np.all(seg[r, :n[r]] == 1) and np.all(seg[r, n[r]:] == 0)  # one step from column 0
      np.testing.assert_array_equal(pos[r, :n[r]], np.arange(n[r]))
      if n[r]:
        steps.append(tuple(t[r, :n[r]]))
        lengths.append(int(n[r]))
  assert lengths == sorted(lengths, reverse=True)  # longest first, across micro-batches
  assert sorted(steps) == sorted(tuple(toks[i][im[i]]) for i in scored_rows)
  # the weights are the unpacked mini-batch's: they sum to 1 and follow their tokens
  w = packing.token_mean_weights(rm, 4)
  assert sum(float(np.sum(m.loss_weights)) for m in micro) == pytest.approx(1.0, rel=1e-6)
  got = sorted(x for m in micro for x in np.asarray(m.loss_weights)[np.asarray(m.score_mask)])
  np.testing.assert_allclose(got, np.sort(w[rm]), rtol=0)
  real = sum(int(np.sum(im[i])) for i in scored_rows)
  assert packing.token_fill([micro]) == pytest.approx(real / sum(m.num_rows * m.seq_len for m in micro))
  assert packing.num_rows([micro]) == 16
  # a coarse multiple is capped at the batch's own row length
  assert {m.seq_len for m in packing.group_mini_batch(b, micro_batch_rows=4, length_multiple=1000)} == {b.seq_len}


def test_length_grouped_logprobs_equal_the_unpacked_ones():
  model = _model()
  b = _host_batch()
  logp, _ = logprob_reference.token_logprobs(model, b.tokens, b.positions, b.input_mask)
  rm, im, toks = (np.asarray(x) for x in (b.response_mask, b.input_mask, b.tokens))
  by_tokens = {tuple(toks[i][im[i]]): i for i in np.flatnonzero(rm.any(1))}
  checked = 0
  for m in packing.group_mini_batch(b, micro_batch_rows=4, length_multiple=4):
    glogp, _ = train_step.scored_logprobs(model, m)
    seg, idx, sm = np.asarray(m.segment_ids), np.asarray(m.score_index), np.asarray(m.score_mask)
    for r in range(m.num_rows):
      if not sm[r].any():
        continue
      i = by_tokens[tuple(np.asarray(m.tokens)[r][seg[r] > 0])]
      first = int(np.flatnonzero(im[i])[0])
      for s in np.flatnonzero(sm[r]):
        np.testing.assert_allclose(glogp[r, s], logp[i, first + idx[r, s]], rtol=1e-5, atol=1e-6)
        checked += 1
  assert checked == rm.sum()


def test_length_grouping_config_errors():
  with pytest.raises(ValueError, match="two layouts"):
    train_step.UpdateConfig(pack_rows=True, group_by_length=True)
  with pytest.raises(ValueError, match="token-mean"):
    train_step.UpdateConfig(group_by_length=True, loss=losses.LossConfig(loss_agg="seq-mean-token-sum"))
  with pytest.raises(ValueError, match="length_multiple"):
    train_step.UpdateConfig(length_multiple=0)


def test_weighted_loss_is_defined_for_token_mean_only():
  x = np.zeros((1, 2), np.float32)
  with pytest.raises(ValueError, match="token-mean"):
    losses.weighted_actor_loss(x, x, x, x, x, x, losses.LossConfig(loss_agg="seq-mean-token-mean"))


def test_packing_refuses_rows_with_holes():
  b = _host_batch()
  holes = np.asarray(b.input_mask).copy()
  col = int(np.flatnonzero(holes[0])[1])
  holes[0, col] = False
  with pytest.raises(ValueError, match="not contiguous"):
    packing.pack_mini_batch(b.replace(input_mask=holes), micro_batch_rows=4)


def _zeroed_host_batch():
  """`_host_batch` with the advantages of rows 0, 1, 5 and 9 set to 0 (a group that scored
  alike), and one token of row 2 set to 0 (a row that still moves)."""
  host = _host_batch()
  adv = np.array(host.advantages)
  adv[[0, 1, 5, 9]] = 0.0
  adv[2, np.flatnonzero(np.asarray(host.response_mask)[2])[0]] = 0.0
  return host.replace(advantages=adv)


@pytest.mark.parametrize("layout", ["packed", "grouped"])
@pytest.mark.parametrize("on_policy", [False, True])
def test_skipping_zero_advantage_rows_keeps_the_update(layout, on_policy):
  """train.skip_zero_advantage leaves out the rows whose advantages are all 0 and takes the
  same optimizer step: parameters, loss and every metric but entropy and approx_kl (then
  means over the updated tokens, checked against the reference) as without it."""
  host = _zeroed_host_batch()
  out = {}
  for skip in (False, True):
    cfg = train_step.UpdateConfig(lr=0.1, eps=1.0, mini_batch_rows=16, micro_batch_rows=4,
                                  loss=losses.LossConfig(use_kl_loss=False, entropy_coeff=0.0),
                                  skip_zero_advantage=skip, pack_rows=layout == "packed",
                                  group_by_length=layout == "grouped")
    model = _model()
    learner = train_step.Learner(model, _mesh(), cfg)
    state = learner.init_state(nnx.state(model, nnx.Param))
    options = dict(mini_batch_rows=16, micro_batch_rows=4, skip_zero_advantage=skip)
    batches = (packing.pack_batch(host, **options) if layout == "packed" else
               packing.group_batch(host, length_multiple=4, **options))
    steps = sum(len({int(np.asarray(p.segment_ids)[r, c]) for c in np.asarray(p.score_index)[r][np.asarray(p.score_mask)[r]]})
                for parts in batches for p in parts for r in range(p.num_rows))
    filled = train_step.fill_logprobs(learner, state.params, None, batches, old=not on_policy)
    if not on_policy:  # ratios away from 1: clipped and dual-clipped tokens
      shift = lambda p: p.replace(old_logprobs=p.old_logprobs - 1.5 * p.score_mask)  # noqa: E731
      filled = [tuple(map(shift, parts)) for parts in filled]
    state, metrics = train_step.train_iteration(learner, state, filled, on_policy=on_policy)
    out[skip] = (jax.device_get(state.params), metrics, steps)
  (p0, m0, n0), (p1, m1, n1) = out[False], out[True]
  assert n0 == 11 and n1 == 7  # 12 rows, one empty response; 4 rows of zero advantage left out
  assert set(m1) == set(m0) | {"updated_weight"} and 0 < m1["updated_weight"] < 1
  for k in m0:
    if k not in ("entropy", "approx_kl", "scored_tokens"):
      np.testing.assert_allclose(m1[k], m0[k], rtol=2e-5, atol=1e-6, err_msg=k)
  # old - new log-prob: 0 on policy, the planted -1.5 off it, on every token and so on
  # the updated ones
  np.testing.assert_allclose(m1["approx_kl"], 0.0 if on_policy else -1.5, atol=1e-5)
  assert m0["pg_loss"] != 0 and (on_policy or m0["pg_clipfrac"] > 0)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), p1, p0)
  # the entropy's weighted sum covers the updated rows only; over their weight, their mean
  rm = np.asarray(host.response_mask)
  moving = (np.asarray(host.advantages) != 0) & rm
  kept = rm & moving.any(axis=1, keepdims=True)
  w = packing.token_mean_weights(rm, 4)
  assert m1["updated_weight"] == pytest.approx(float(w[kept].sum()), rel=1e-6)
  assert (m0["scored_tokens"], m1["scored_tokens"]) == (rm.sum(), kept.sum())  # the update's
  _, entropy = logprob_reference.token_logprobs(_model(), host.tokens, host.positions, host.input_mask)
  mean = float((w * np.asarray(entropy))[kept].sum() / w[kept].sum())
  assert m1["entropy"] == pytest.approx(mean, rel=1e-4)  # the forward of the initial params


def test_skipping_zero_advantage_refusals():
  with pytest.raises(ValueError, match="needs pack_rows or group_by_length"):
    train_step.UpdateConfig(skip_zero_advantage=True, loss=losses.LossConfig(use_kl_loss=False, entropy_coeff=0.0))
  for loss in (losses.LossConfig(entropy_coeff=0.0), losses.LossConfig(use_kl_loss=False)):
    with pytest.raises(ValueError, match="exact only for a loss whose every term") as e:
      train_step.UpdateConfig(skip_zero_advantage=True, group_by_length=True, loss=loss)
    assert "\n" not in str(e.value)
  train_step.UpdateConfig(skip_zero_advantage=True, group_by_length=True,
                          loss=losses.LossConfig(kl_coef=0.0, entropy_coeff=0.0))
