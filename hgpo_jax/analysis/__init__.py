"""Exact analysis of the step-advantage estimators (host side, numpy).

  testbed      deterministic gridworld with revisits, cue cells, traps and optional
               observation aliasing; history-dependent policy families; the exact
               oracle (Q, V, A* and the policy gradient) by dynamic programming over
               history-augmented states.
  sampling     groups of trajectories drawn with common random numbers, turned into
               RowBatches by the project's host grouping and scored by the registry.
  metrics      bias^2 / variance / MSE against A*, sign agreement, context-inconsistency
               index per level, batch-gradient cosine, paired differences.
  consistency  context inconsistency of real rollouts, from a rollout dump.

The study that uses them is `python -m launch.experiments.studies.bias` (docs/algorithms.md).
"""
