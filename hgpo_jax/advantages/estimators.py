"""Imports every estimator module so that their @register decorators run.

`registry.get` and `registry.names` import this module on first use; an estimator
module that fails to import is an error (it propagates), never a silently missing
estimator.
"""

from __future__ import annotations

from hgpo_jax.advantages import episode  # noqa: F401  grpo, rloo
from hgpo_jax.advantages import gae  # noqa: F401
from hgpo_jax.advantages import gigpo  # noqa: F401
from hgpo_jax.advantages import hae  # noqa: F401
from hgpo_jax.advantages import hgpo  # noqa: F401
