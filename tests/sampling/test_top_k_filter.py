"""Top-k / top-p over `lax.top_k` candidates against a full-vocabulary sort.

The reference, `_sort_filter_reference`, is a sort-based filter without the candidate
bound (temperature left out): sort the row, keep the top-k ranks, then the ranks whose
mass-before is below top_p, and every logit >= the last kept one (ties kept). The
candidate filter must give the same array, on its fast path wherever it claims exactness
and through its sort fallback elsewhere, and the sampler must draw the same tokens for the
same keys.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hgpo_jax.models import config, decoder
from hgpo_jax.sampling import logits as logits_lib
from hgpo_jax.sampling import sampler
from hgpo_jax.sampling import SamplingParams

PROMPTS = ["go to cabinet 1", "You are in the middle of a room. Looking quickly around you",
           "<|im_start|>user\nput a clean apple in the fridge<|im_end|>\n<|im_start|>assistant\n"]
VOCAB = 300


def _sort_filter_reference(logits_bv, temperature, top_k, top_p):
  """The sort-based filter_logits of before the candidate bound."""
  scaled_bv = logits_bv / temperature
  vocab = scaled_bv.shape[-1]
  sorted_bv = -jnp.sort(-scaled_bv, axis=-1)  # descending
  rank_v = jnp.arange(vocab)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k_bv = rank_v[None, :] < k
  probs_bv = jax.nn.softmax(jnp.where(in_top_k_bv, sorted_bv, -jnp.inf), axis=-1)
  mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
  keep_bv = in_top_k_bv & ((mass_before_bv < top_p) | (top_p >= 1.0))
  num_kept_b = jnp.sum(keep_bv, axis=-1)
  cutoff_b = jnp.take_along_axis(sorted_bv, (num_kept_b - 1)[:, None], axis=-1)
  return jnp.where(scaled_bv >= cutoff_b, scaled_bv, -jnp.inf)


def _logits(kind: str) -> np.ndarray:
  """f32[8, VOCAB] test rows: `normal` (wide nuclei), `peaked` (a few likely tokens),
  `ties` (integer logits: many ties at every cut-off), `masked` (constrained decoding:
  most tokens -inf, one row with 3 allowed tokens, fewer than most top_k here)."""
  rng = np.random.default_rng({"normal": 0, "peaked": 1, "ties": 2, "masked": 3}[kind])
  x = rng.normal(size=(8, VOCAB)).astype(np.float32)
  if kind == "peaked":
    x = x * 8.0
  elif kind == "ties":
    x = np.round(x * 2.0)
  elif kind == "masked":
    x = np.where(rng.random(size=x.shape) < 0.9, -np.inf, x * 3.0).astype(np.float32)
    x[0] = -np.inf
    x[0, [7, 70, 170]] = [1.0, 2.0, 2.0]
  return x


SETTINGS = [(0, 1.0), (1, 1.0), (5, 1.0), (20, 1.0), (200, 1.0), (0, 0.5), (0, 0.9),
            (0, 1e-6), (10, 0.8), (50, 0.95), (200, 0.9)]


@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "masked"])
@pytest.mark.parametrize("top_k,top_p", SETTINGS)
def test_filter_equals_the_sort_filter(kind, top_k, top_p):
  """Same kept sets (so the same probabilities after the softmax) as the sort, for every
  bound: K = 1 and 8 (mostly the fallback), 64, and K >= V (always the fast path)."""
  logits = jnp.asarray(_logits(kind))
  want = np.asarray(_sort_filter_reference(logits, 0.7, jnp.int32(top_k), jnp.float32(top_p)))
  for cands in (1, 8, 64, VOCAB, 1000):
    got = np.asarray(logits_lib.filter_logits(logits, 0.7, jnp.int32(top_k), jnp.float32(top_p),
                                           cands))
    np.testing.assert_array_equal(got, want, err_msg=f"max_candidates={cands}")
    # The fast path on its own, wherever it claims exactness.
    fast, exact = logits_lib.candidate_filter(logits / 0.7, jnp.int32(top_k), jnp.float32(top_p),
                                           cands)
    exact = np.asarray(exact)
    np.testing.assert_array_equal(np.asarray(fast)[exact], want[exact])
    if (0 < top_k <= cands) or cands >= VOCAB:
      assert exact.all()  # the configured values it is exact for, by construction
    if top_k == 0 and top_p == 1.0 and cands < VOCAB:
      assert not exact.any()  # nothing to filter: only the sort path keeps every token
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
  if top_k == 0 and top_p == 1.0:  # off: the scaled logits, untouched
    np.testing.assert_array_equal(want, np.asarray(logits / 0.7))


def test_ties_at_the_cut_off_are_kept():
  """Integer logits: the k-th and the last nucleus logits are shared by several tokens;
  all of them are kept, on the fast path as by the sort."""
  logits = jnp.asarray(_logits("ties"))
  for top_k, top_p in ((5, 1.0), (0, 0.5)):
    got, exact = logits_lib.candidate_filter(logits, jnp.int32(top_k), jnp.float32(top_p), 64)
    assert np.asarray(exact).all()
    kept = np.isfinite(np.asarray(got))
    cutoff = np.where(kept, np.asarray(logits), np.inf).min(axis=1)
    np.testing.assert_array_equal(kept, np.asarray(logits) >= cutoff[:, None])  # all ties in
    if top_k:
      assert (kept.sum(axis=1) > top_k).any()  # ties at the k-th logit pushed past k


def test_nucleus_wider_than_the_candidates_falls_back_to_the_sort():
  """top_p = 0.9 over near-uniform logits needs ~270 of 300 tokens: not exact from 64
  candidates, so the filter sorts; from a peaked row the nucleus fits and it does not."""
  flat = jnp.asarray(np.random.default_rng(5).normal(size=(2, VOCAB)).astype(np.float32) * 0.1)
  _, exact = logits_lib.candidate_filter(flat, jnp.int32(0), jnp.float32(0.9), 64)
  assert not np.asarray(exact).any()
  got = logits_lib.filter_logits(flat, 1.0, jnp.int32(0), jnp.float32(0.9), 64)
  want = _sort_filter_reference(flat, 1.0, jnp.int32(0), jnp.float32(0.9))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.isfinite(np.asarray(got)).sum(axis=1).min() > 64
  _, exact = logits_lib.candidate_filter(flat * 200, jnp.int32(0), jnp.float32(0.9), 64)
  assert np.asarray(exact).all()
  # top_k above the bound (and below V): the top-k normaliser is unknown from K candidates.
  _, exact = logits_lib.candidate_filter(flat * 200, jnp.int32(100), jnp.float32(0.9), 64)
  assert not np.asarray(exact).any()


def _generate(model, tok, params, key, *, sort, max_candidates=logits_lib.DEFAULT_MAX_CANDIDATES,
              allowed=None, monkeypatch):
  """A fresh sampler's generate, with today's filter or the sort-based reference."""
  with monkeypatch.context() as m:
    if sort:
      m.setattr(logits_lib, "filter_logits",
                lambda logits, t, k, p, cands: _sort_filter_reference(logits, t, k, p))
    smp = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,),
                          max_candidates=max_candidates)
    return smp.generate([tok.encode(p) for p in PROMPTS], params, key, allowed=allowed)


@pytest.mark.filterwarnings("ignore:Sampler. top_k=40 > max_candidates=8")
@pytest.mark.parametrize("temperature,top_k,top_p,cands", [
    (0.0, 0, 1.0, 256),  # greedy: no filter
    (1.0, 20, 1.0, 256),  # top_k <= K: fast path every step
    (0.7, 20, 0.9, 256),  # both
    (0.3, 0, 0.9, 256),  # top_p only, nucleus within the candidates or not, per step
    (1.0, 0, 0.8, 512),  # K >= V (tiny vocab 512): fast path every step
    (1.0, 0, 0.95, 2),  # nucleus wider than K: the sort, step by step
    (1.0, 40, 1.0, 8),  # top_k > K: the sort
])
def test_generate_samples_the_sort_filters_tokens(model, tok, monkeypatch, temperature, top_k,
                                                  top_p, cands):
  params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                  max_new_tokens=16, ignore_eos=True)
  for seed in (0, 1):
    key = jax.random.key(seed)
    want = _generate(model, tok, params, key, sort=True, monkeypatch=monkeypatch)
    got = _generate(model, tok, params, key, sort=False, max_candidates=cands,
                    monkeypatch=monkeypatch)
    assert got.tokens == want.tokens
    for a, b in zip(got.logprobs, want.logprobs):
      np.testing.assert_array_equal(a, b)  # raw log-probs of the same tokens


def test_constrained_generate_samples_the_sort_filters_tokens(model, tok, monkeypatch):
  """Constraint masks (-inf before the filter) leave fewer allowed tokens than top_k."""
  allowed = [["go to cabinet 1", "open fridge 1", "take apple 1 from countertop 1"],
             ["look"], ["examine mug 1", "examine mug 10", "inventory"]]
  params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9, max_new_tokens=24)
  for seed in range(3):
    key = jax.random.key(seed)
    want = _generate(model, tok, params, key, sort=True, allowed=allowed, monkeypatch=monkeypatch)
    got = _generate(model, tok, params, key, sort=False, allowed=allowed, monkeypatch=monkeypatch)
    assert got.tokens == want.tokens and got.texts == want.texts
    assert got.stop_reason == ["constraint"] * 3


def test_bad_bounds_are_clear_errors(model, tok):
  for bad in (0, -3, 2.5, True):
    with pytest.raises(ValueError, match=r"^Sampler: max_candidates=.* must be an int >= 1"):
      sampler.Sampler(model, tok, max_candidates=bad)
  with pytest.raises(ValueError, match="max_candidates=0 must be >= 1"):
    logits_lib.filter_logits(jnp.zeros((1, 8)), 1.0, jnp.int32(2), jnp.float32(1.0), 0)


def test_top_k_above_the_bound_warns_once(model, tok):
  smp = sampler.Sampler(model, tok, prompt_buckets=(32,), batch_buckets=(4,), max_candidates=8)
  params = SamplingParams(temperature=1.0, top_k=40, max_new_tokens=2)
  prompts = [tok.encode(p) for p in PROMPTS]
  with pytest.warns(UserWarning, match="top_k=40 > max_candidates=8: every sampled token sorts"):
    smp.generate(prompts, params, jax.random.key(0))
  import warnings
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    smp.generate(prompts, params, jax.random.key(1))


def test_the_compiled_filter_sorts_only_in_its_fallback_branch():
  """XLA:CPU folds a slice of TopK's output into a slice of a full sort unless the top_k
  values pass an optimization barrier (logits_lib.candidate_filter): then every step sorted."""
  fn = jax.jit(lambda x, k, p: logits_lib.filter_logits(x, 0.7, k, p, 64))
  hlo = fn.lower(jnp.zeros((4, 1000)), jnp.int32(5), jnp.float32(0.9)).compile().as_text()
  computation, sorts_in, branches = None, set(), set()
  for line in hlo.splitlines():
    if line.rstrip().endswith("{") and "%" in line.split("(")[0]:
      computation = line.split("%")[1].split(" ")[0]
    if " sort(" in line:
      sorts_in.add(computation)
    if "conditional(" in line:
      branches |= {b.strip().lstrip("%") for b in
                   line.split("branch_computations={")[1].split("}")[0].split(",")}
  assert "TopK" in hlo or "topk" in hlo.lower()
  assert sorts_in and sorts_in <= branches, (sorts_in, branches)


def test_sharded_filtered_sampling_equals_unsharded(tok, monkeypatch):
  """The fallback's `lax.cond` takes a predicate over rows split across devices."""
  import fake_devices
  from hgpo_jax.models import sharding
  cfg = config.get_preset("tiny")
  plain = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  sharded = decoder.Decoder(cfg, rngs=nnx.Rngs(1))
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2, devices=fake_devices.take(8))
  sharding.shard_model(sharded, mesh)
  prompts = [tok.encode(p) for p in PROMPTS]
  for params, cands in ((SamplingParams(temperature=0.7, top_k=20, top_p=0.9,
                                                max_new_tokens=8), 256),
                        (SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=8), 4)):
    want = _generate(plain, tok, params, jax.random.key(4), sort=True, monkeypatch=monkeypatch)
    dist = sampler.Sampler(sharded, tok, prompt_buckets=(32,), batch_buckets=(4,), mesh=mesh,
                           max_candidates=cands)
    assert dist.generate(prompts, params, jax.random.key(4)).tokens == want.tokens
