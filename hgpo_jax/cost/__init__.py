"""Cost accounting: what the programs cost in FLOPs, bytes, launches, memory and time.

  hlo              the compiled program's HLO read: FLOPs, memory traffic and launches
                   (loops weighted by trip count), XLA:TPU cycles, memory_analysis bytes
  hardware         the hardware table: peaks, HBM and bandwidth per device kind, the CPU's
                   detected peak, MFU, the one `GiB`
  analytic         textbook matmul FLOPs and parameter counts of the decoder
  targets          compile targets: a TPU slice's or GPU's devices on a host without them,
                   their usable HBM and seconds per XLA:TPU cycle
  decode_traffic   one decode step's traffic against the bytes it must move (the decode
                   kernels declare what they read: `models.decode_kernels.CACHE_READS_BLOCK`)
  plan             compiled plans of a config's programs on a mesh: memory, FLOPs, time;
                   recommendations and searches over meshes, micro-batches, rollout rows
  trainer_metrics  the trainer's `perf/*` FLOP metrics per iteration and its profiler window

The first four import nothing from the rest of hgpo_jax (the program registry uses the
targets); `plan` and `trainer_metrics` compile the training programs
(tests/test_import_graph.py: FLOORS). Command-line formatting is in launch/plan.py.
"""
