"""Cost accounting: what the programs cost in FLOPs, bytes, launches, memory and time.

  hlo              the compiled program's HLO read: FLOPs, memory traffic and launches
                   (loops weighted by trip count), XLA:TPU cycles, memory_analysis bytes
  hardware         the hardware table: peaks, HBM and bandwidth per device kind, the CPU's
                   detected peak, MFU, the one `GiB`
  analytic         textbook matmul FLOPs and parameter counts of the decoder
  targets          compile targets: a TPU slice's or GPU's devices on a host without them,
                   their usable HBM and seconds per XLA:TPU cycle

The package imports nothing from the rest of hgpo_jax (the bottom floor: the program
registry uses the targets; tests/test_import_graph.py: FLOORS). Its users above: one
decode step's traffic (`hgpo_jax.sampling.decode_traffic`), the compiled plans and the
trainer's FLOP metrics (`hgpo_jax.compiled`).
"""
