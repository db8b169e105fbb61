"""Names of the attention implementations, readable without importing any kernel (the
model config validates against them; `hgpo_jax.models.attention` implements them)."""

IMPLEMENTATIONS = ("xla", "chunked", "splash", "cudnn")
"""Implementations of `attention.attention` (self-attention of T tokens)."""
CHOICES = ("auto",) + IMPLEMENTATIONS
"""Values of `ModelConfig.attention_impl` / `config.model.attention_impl`."""

DECODE_IMPLEMENTATIONS = ("xla",)
"""Implementations of `attention.decode_attention` (new tokens over a KV cache): the keys
of `attention.DECODE_KERNELS`. A module adding a decode kernel adds its name here and
registers it with `attention.register_decode_kernel`."""
DECODE_CHOICES = ("auto",) + DECODE_IMPLEMENTATIONS
"""Values of `ModelConfig.decode_attention_impl`."""
