"""What a config's compiled programs cost on a mesh, read from the compiled programs.

  plan             compiled plans of a config's programs on a mesh: memory, FLOPs, time;
                   recommendations and searches over meshes, micro-batches, rollout rows
  trainer_metrics  the trainer's `perf/*` FLOP metrics per iteration and its profiler window

Both compile the training programs (`hgpo_jax.training.programs`), so they sit above
training (tests/test_import_graph.py: FLOORS); they read the compiled HLO with
`hgpo_jax.cost`. Command-line formatting is in launch/plan.py.
"""
