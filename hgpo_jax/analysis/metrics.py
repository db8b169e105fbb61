"""Estimator quality against the exact oracle (numpy, host side).

Per-step error (`step_errors`): an estimator's advantage is first scaled by one
factor c (standardised and mean-only estimators live on different scales; the policy
gradient only sees the direction). c is the least-squares fit of the estimator's
*conditional mean* mu_key = E[A_hat | key] to A*, over exact keys (task, t, context,
action): c = sum n mu A* / (sum n mu^2 - sum s^2), the s^2 term removing the noise that
sample means carry (a fit to the raw A_hat would shrink c toward 0 as noise grows and
book that shrinkage as bias: the Monte Carlo estimator G_t - V(h_t) would look biased).
Then e = c A_hat - A* is split over the keys:
  MSE = mean e^2,  bias^2 = mean over rows of (E[e | key])^2,  variance = MSE - bias^2,
with the small-sample correction E[mean_k^2] = mu_k^2 + s_k^2 / n_k (keys seen once are
left out). All three are divided by Var(A*) over the rows.

Context-inconsistency index (`inconsistency`): CI_k = pooled within-group variance of
the exact context value V(h_t) inside level-k groups of the RowBatch (groups of >= 2
rows) divided by Var(A*); 0 means every level-k group holds one context value.

Batch-gradient cosine (`gradient_cosines`): for each batch b,
g_b = sum_rows A_hat grad log pi(a | m) with tabular softmax logits
(grad = onehot(a) - pi(.|m)), compared with the exact gradient g*.
"""

from __future__ import annotations

import numpy as np


def step_errors(adv: np.ndarray, a_star: np.ndarray, key: np.ndarray) -> dict[str, float]:
  """Scaled per-step bias^2 / variance / MSE (in units of Var(A*)), sign agreement, scale."""
  adv = np.asarray(adv, np.float64)
  _, inv, counts = np.unique(key, return_inverse=True, return_counts=True)
  inv = inv.reshape(-1)
  multi = counts >= 2
  n = counts[multi].astype(np.float64)
  mu = (np.bincount(inv, weights=adv) / counts)[multi]
  a_key = (np.bincount(inv, weights=a_star) / counts)[multi]
  ss_adv = (np.bincount(inv, weights=adv * adv))[multi] - n * mu**2
  denom = float(np.sum(n * mu**2) - np.sum(np.maximum(ss_adv, 0.0) / (n - 1)))
  scale = float(np.sum(n * mu * a_key)) / denom if denom > 0 else 0.0
  err = scale * adv - a_star
  total = np.bincount(inv, weights=err)
  total_sq = np.bincount(inv, weights=err * err)
  mean = total[multi] / n
  ss = total_sq[multi] - n * mean**2
  s2 = np.maximum(ss, 0.0) / (n - 1)
  rows = n.sum()
  var_a = float(np.var(a_star))
  bias2 = float(np.sum(n * mean**2 - s2)) / rows
  mse = float(total_sq[multi].sum()) / rows
  nonzero = np.abs(a_star) > 1e-9
  sign = float(np.mean(np.sign(adv[nonzero]) == np.sign(a_star[nonzero])))
  return dict(bias2=bias2 / var_a, var=(mse - bias2) / var_a, mse=mse / var_a, sign=sign,
              scale=scale)


def inconsistency(context_group: np.ndarray, value: np.ndarray, var_a: float
                  ) -> tuple[np.ndarray, np.ndarray]:
  """(CI_k, share of rows without a usable level-k group) for each level k.

  Args:
    context_group: int[K1, n] level ids of the real rows (RowBatch order, -1 = absent).
    value: f64[n] exact context value V(h_t) of the same rows.
    var_a: Var(A*) over the rows (the unit).
  """
  num_levels, n = context_group.shape
  ci = np.zeros(num_levels)
  alone = np.zeros(num_levels)
  for k in range(num_levels):
    ids = context_group[k]
    present = ids >= 0
    counts = np.bincount(ids[present], minlength=1)
    size = np.zeros(n, np.int64)
    size[present] = counts[ids[present]]
    usable = size >= 2
    alone[k] = 1.0 - usable.mean()
    if not usable.any():
      continue
    g = ids[usable]
    mean = np.bincount(g, weights=value[usable]) / np.maximum(np.bincount(g), 1)
    ci[k] = np.mean((value[usable] - mean[g])**2) / var_a
  return ci, alone


def gradient_cosines(adv: np.ndarray, batch: np.ndarray, ctx: np.ndarray, action: np.ndarray,
                     probs: np.ndarray, g_star: np.ndarray, num_batches: int) -> np.ndarray:
  """f64[num_batches]: cosine between each batch's policy gradient and g* (0 if g_b = 0)."""
  adv = np.asarray(adv, np.float64)
  num_actions = probs.shape[1]
  baseline = np.sum(probs * g_star, axis=1)  # pi(.|m) . g*[m]
  dot = np.bincount(batch, weights=adv * (g_star[ctx, action] - baseline[ctx]),
                    minlength=num_batches)
  key = batch.astype(np.int64) * len(probs) + ctx
  uniq, inv = np.unique(key, return_inverse=True)
  inv = inv.reshape(-1)
  acc = np.zeros((len(uniq), num_actions))
  score = -probs[ctx] * adv[:, None]
  score[np.arange(len(adv)), action] += adv
  for a in range(num_actions):
    acc[:, a] = np.bincount(inv, weights=score[:, a], minlength=len(uniq))
  norm2 = np.bincount(uniq // len(probs), weights=np.sum(acc * acc, axis=1),
                      minlength=num_batches)
  denom = np.sqrt(norm2) * np.linalg.norm(g_star)
  return np.where(denom > 0, dot / np.where(denom > 0, denom, 1.0), 0.0)


def paired(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
  """Mean of x - y over paired samples and its standard error."""
  d = np.asarray(x, np.float64) - np.asarray(y, np.float64)
  return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")
