"""Jit KV-cache sampling: bucketed batched generation, stop strings, top-k/top-p, tries.

The public names: `Sampler` (prompts in, responses out), `SamplingParams` (how to sample)
and `SampleOutput` (what comes back); the modules hold the parts (docs/architecture.md,
"Sampler").
"""

from hgpo_jax.sampling.sampler import Sampler
from hgpo_jax.sampling.types import SampleOutput, SamplingParams

__all__ = ["Sampler", "SampleOutput", "SamplingParams"]
