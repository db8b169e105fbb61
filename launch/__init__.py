"""Command-line tools: `python -m launch.<tool>` (the trainer, evaluation, sweeps, plans,
benchmarks, studies, pod launchers).

Importing the package picks the JAX platforms before any tool imports JAX
(`hgpo_jax.runtime.select_platforms`): on a host without TPU chips, the libtpu wheel the
venv holds for topology compiles does not start up and print its errors.
"""

from hgpo_jax import runtime as _runtime

_runtime.select_platforms()
