"""Top-k / top-p filtering of one decode step's logits, and the log-prob of the token a row
chose: pure functions of [B, V] arrays.

`filter_logits` takes the `max_candidates` largest logits of each row with
`jax.lax.top_k` instead of sorting the vocabulary, and decides the kept set on them
whenever that is exact (top_k <= max_candidates, or top_k off and the top_p nucleus inside
the candidates). A step where some row's nucleus is wider (or K < top_k < V) sorts the
vocabulary (`sort_filter`, under `lax.cond`), so the kept set, and the token a key
samples, do not differ from the sort's (up to the rounding of the probability sums, for a
token whose mass-before lies within float rounding of top_p). Timings of both paths:
docs/performance.md ("Top-k / top-p").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

DEFAULT_MAX_CANDIDATES = 256
"""Default `Sampler(max_candidates=...)`: the candidates `lax.top_k` takes per row and step
(`filter_logits`). Covers the usual top_k (20-100) and most top_p nuclei at a cost close
to a smaller K's (timings: docs/performance.md, "Figures cited by the code")."""


def sort_filter(scaled_bv: jax.Array, top_k, top_p) -> jax.Array:
  """The full-vocabulary sort filter (`filter_logits` on its fallback; module docstring)."""
  vocab = scaled_bv.shape[-1]
  sorted_bv = -jnp.sort(-scaled_bv, axis=-1)  # descending
  rank_v = jnp.arange(vocab)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k_bv = rank_v[None, :] < k
  probs_bv = jax.nn.softmax(jnp.where(in_top_k_bv, sorted_bv, -jnp.inf), axis=-1)
  mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
  # top_p >= 1 must keep everything even where the cumulative sum rounds up to 1.
  keep_bv = in_top_k_bv & ((mass_before_bv < top_p) | (top_p >= 1.0))
  num_kept_b = jnp.sum(keep_bv, axis=-1)  # >= 1: the first token has mass_before 0
  cutoff_b = jnp.take_along_axis(sorted_bv, (num_kept_b - 1)[:, None], axis=-1)
  return jnp.where(scaled_bv >= cutoff_b, scaled_bv, -jnp.inf)


def candidate_filter(scaled_bv: jax.Array, top_k, top_p, max_candidates: int
                     ) -> tuple[jax.Array, jax.Array]:
  """Top-k / top-p over the `max_candidates` largest logits only (`jax.lax.top_k`).

  Args:
    scaled_bv: f32[B, V] logits after temperature (may hold -inf).
    top_k: int32 scalar, 0 = off.
    top_p: f32 scalar in (0, 1], 1 = off.
    max_candidates: K (static), 1 <= K; K >= V takes all V.
  Returns:
    (f32[B, V] filtered logits, bool[B] exact): where `exact[b]`, row b equals the sort
    filter's row (`sort_filter`; up to the float rounding of the softmax normaliser and
    its cumulative sum, which only matters for a token whose mass-before lies within
    ~1e-7 of top_p). A row is exact when the kept set is decided inside the K candidates:
    top_k in [1, K] (the nucleus lies inside the top-k set), or top_k off (or >= V) and the
    K candidates hold at least top_p < 1 of the probability (the normaliser is then the
    full row's logsumexp, one pass over V). Otherwise (K < top_k < V, or a nucleus wider
    than K) the row is not exact and `filter_logits` falls back to the sort.
  """
  vocab = scaled_bv.shape[-1]
  cands = min(max_candidates, vocab)
  # The sorted prefix's values, descending. The barrier keeps XLA from folding the slices
  # below (top_bk[:, :1]) into a slice of the sort that TopK is decomposed into, which
  # stops it from rewriting that sort back into a TopK: XLA:CPU then sorted all V logits
  # (timings: docs/performance.md, "Figures cited by the code").
  top_bk = jax.lax.optimization_barrier(jax.lax.top_k(scaled_bv, cands)[0])
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k_bk = jnp.arange(cands)[None, :] < k
  # Softmax over the top-k set as the sort filter's (max = the first value): from the
  # candidates when k <= K, else (k = V) from the whole row.
  exp_bk = jnp.exp(jnp.where(in_top_k_bk, top_bk - top_bk[:, :1], -jnp.inf))
  total_b = jax.lax.cond(k <= cands, lambda: jnp.sum(exp_bk, axis=-1),
                         lambda: jnp.sum(jnp.exp(scaled_bv - top_bk[:, :1]), axis=-1))
  probs_bk = exp_bk / total_b[:, None]
  cum_bk = jnp.cumsum(probs_bk, axis=-1)
  mass_before_bk = cum_bk - probs_bk
  keep_bk = in_top_k_bk & ((mass_before_bk < top_p) | (top_p >= 1.0))
  num_kept_b = jnp.sum(keep_bk, axis=-1)  # >= 1: the first token has mass_before 0
  cutoff_b = jnp.take_along_axis(top_bk, (num_kept_b - 1)[:, None], axis=-1)
  # k > K: only exact if k = V and the nucleus closes inside the candidates (the candidate
  # past the last one would not be kept: its mass-before, cum[K-1], reaches top_p).
  exact_b = (k <= cands) | ((k == vocab) & (top_p < 1.0) & (cum_bk[:, -1] >= top_p))
  return jnp.where(scaled_bv >= cutoff_b, scaled_bv, -jnp.inf), exact_b


def filter_logits(logits_bv: jax.Array, temperature, top_k, top_p,
                  max_candidates: int = DEFAULT_MAX_CANDIDATES) -> jax.Array:
  """Temperature, then top-k, then top-p (the Hugging Face order); removed tokens -> -inf.

  The kept set is decided on the `max_candidates` largest logits (`jax.lax.top_k`, no sort
  of the vocabulary) when that is exact for every row of the batch (`candidate_filter`:
  top_k <= max_candidates, or top_k off and the nucleus inside the candidates); otherwise
  the step sorts the whole vocabulary (`lax.cond`: exact, at the cost of a sort).
  Either way the result is the sort filter's, so the same keys sample the same tokens.

  Args:
    logits_bv: f32[B, V] (may already hold -inf for masked tokens).
    temperature: f32 scalar > 0.
    top_k: int32 scalar, 0 = off.
    top_p: f32 scalar in (0, 1], 1 = off.
    max_candidates: static bound K of the candidates (>= 1).
  Returns:
    f32[B, V] scaled logits with the removed tokens at -inf. Ties with the cut-off
    logit are kept (all of them, even past top_k or past the K candidates).
  """
  if max_candidates < 1:
    raise ValueError(f"filter_logits: max_candidates={max_candidates} must be >= 1.")
  scaled_bv = logits_bv / temperature
  filtered_bv, exact_b = candidate_filter(scaled_bv, top_k, top_p, max_candidates)
  return jax.lax.cond(jnp.all(exact_b), lambda: filtered_bv,
                      lambda: sort_filter(scaled_bv, top_k, top_p))


def token_logprob(logits_bv: jax.Array, token_b: jax.Array) -> jax.Array:
  """f32[B]: log_softmax(logits_bv)[b, token_b[b]], without the [B, V] array of every
  token's log-prob (one f32 write and read of the vocabulary per row and step fewer).
  (x - max) - logsumexp(x - max) at one index is `jax.nn.log_softmax`'s own arithmetic,
  so the bits are its."""
  max_b1 = jnp.max(logits_bv, axis=-1, keepdims=True)
  lse_b1 = jnp.log(jnp.sum(jnp.exp(logits_bv - max_b1), axis=-1, keepdims=True))
  return ((jnp.take_along_axis(logits_bv, token_b[:, None], axis=-1) - max_b1) - lse_b1)[:, 0]
