"""CPU numerics: how this machine's XLA:CPU rounds, and what pinning it costs.

  python -m launch.cpu_numerics witness [--numerics default] [--out F] [--compare F]
  python -m launch.cpu_numerics probe [--settings default host_math ...]
  python -m launch.cpu_numerics cost [--baseline host_math] [--candidate default]

`witness` (witness.py): SHA-256 digests of single operations and of a training
iteration's phases under one setting of `hgpo_jax.runtime.CPU_NUMERICS`; diff two
machines' outputs to find the first operation that rounds differently. `probe`
(probe.py): which XLA:CPU flags change how a float32 matmul rounds. `cost` (cost.py): one
setting against another in time, on the tiny policy's programs.
"""
