"""The jit estimators equal the readable float64 reference on random rollouts.

Hundreds of random batches (1-3 groups, 1-5 trajectories of 1-50 steps, few states
so revisits and shared prefixes are common, invalid steps, string and int ids,
shuffled rows), each run through every option set below. One capacity and one
context depth for all batches, so each option set compiles once.
"""

import numpy as np
import pytest

import advantage_cases
from hgpo_jax.advantages import build_row_batch
from hgpo_jax.advantages import reference
from hgpo_jax.advantages import registry

CAPACITY = 256
MAX_K = 5
NUM_BATCHES = 200

OPTION_SETS = [
    ("grpo", dict()),
    ("grpo", dict(stats="trajectories")),
    ("grpo", dict(norm="mean")),
    ("grpo", dict(stats="trajectories", norm="mean")),
    ("rloo", dict()),
    ("rloo", dict(stats="trajectories")),
    ("gigpo", dict()),
    ("gigpo", dict(norm="mean")),
    ("gigpo", dict(stats="trajectories", omega=0.5)),
    ("gigpo", dict(norm="mean", stats="trajectories", omega=2.0)),
    ("hgpo", dict(k=0)),
    ("hgpo", dict(k=1, norm="mean")),
    ("hgpo", dict(k=2)),
    ("hgpo", dict(k=2, weights="paper")),
    ("hgpo", dict(k=2, weights="paper", alpha=0.0)),
    ("hgpo", dict(k=3, norm="mean", weights="paper", alpha=0.5)),
    ("hgpo", dict(k=4, alpha=2.0)),
    ("hgpo", dict(k=5)),
    ("hgpo", dict(k=2, base_group=True)),
    ("hgpo", dict(k=4, base_group=True, norm="mean", stats="trajectories")),
    ("hgpo", dict(k=5, base_group=True, weights="paper")),
    ("hgpo", dict(k=2, weights="inverse_variance")),
    ("hgpo", dict(k=4, weights="inverse_variance", norm="mean", variance_prior=0.5)),
]


@pytest.fixture(scope="module")
def batches():
  rng = np.random.default_rng(20260301)
  out = []
  for _ in range(NUM_BATCHES):
    rows = advantage_cases.random_rows(rng, max_rows=CAPACITY)
    gamma = float(rng.choice([0.95, 0.9, 1.0]))
    penalty = float(rng.choice([0.1, 0.0, 0.5]))
    grouped = build_row_batch(rows, num_levels=MAX_K + 1, capacity=CAPACITY, gamma=gamma,
                              invalid_penalty=penalty)
    out.append((rows, gamma, penalty, grouped))
  return out


def test_batches_cover_hard_cases(batches):
  """The random rollouts do contain revisits, equal-return groups and long trajectories."""
  lengths = {}
  for b, (rows, *_) in enumerate(batches):
    for r in rows:
      lengths[b, r["traj"]] = max(lengths.get((b, r["traj"]), 0), r["step"] + 1)
  assert max(lengths.values()) == 50 and min(lengths.values()) == 1
  revisits = sum(len({(r["traj"], r["anchor_obs"]) for r in rows}) < len(rows)
                 for rows, *_ in batches)
  assert revisits > NUM_BATCHES // 2
  assert sum(not r["valid"] for rows, *_ in batches for r in rows) > 500


@pytest.mark.parametrize("name,options", OPTION_SETS,
                         ids=[f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items())}"
                              for n, o in OPTION_SETS])
def test_kernel_equals_reference(batches, name, options):
  est = registry.get(name)
  opts = est.options(**options)
  ref_fn = reference.ESTIMATORS[name]
  nonzero = 0
  for rows, gamma, penalty, grouped in batches:
    actual = grouped.to_input_order(np.asarray(est(grouped.batch, opts).advantage))
    expected = np.asarray(ref_fn(rows, opts, gamma=gamma, invalid_penalty=penalty))
    np.testing.assert_allclose(actual, expected, rtol=2e-4, atol=2e-4)
    nonzero += np.count_nonzero(expected)
  assert nonzero > 1000  # the comparison is not vacuous
