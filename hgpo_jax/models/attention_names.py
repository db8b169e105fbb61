"""Names of the attention implementations, readable without importing any kernel (the
model config validates against them; `hgpo_jax.models.attention` implements them)."""

IMPLEMENTATIONS = ("xla", "chunked", "splash", "cudnn")
"""Implementations of `attention.attention` (self-attention of T tokens)."""
CHOICES = ("auto",) + IMPLEMENTATIONS
"""Values of `ModelConfig.attention_impl` / `config.model.attention_impl`."""

DECODE_IMPLEMENTATIONS = ("xla", "pallas_gpu", "pallas_tpu")
"""Implementations of `attention.decode_attention` (new tokens over a KV cache): the keys
of `attention.DECODE_KERNELS`. A module adding a decode kernel adds its name here and
registers it with `attention.register_decode_kernel`."""
STACKED_DECODE_IMPLEMENTATIONS = ("pallas_gpu", "pallas_tpu")
"""Decode kernels that read one layer of the stacked [L, B, Hkv, S, Dh] cache in place
(`layer=`; `hgpo_jax.models.decode_kernels`): the decoder passes them the whole cache, not
a per-layer slice, which XLA would copy before the custom call in every layer and step."""
DECODE_CHOICES = ("auto",) + DECODE_IMPLEMENTATIONS
"""Values of `ModelConfig.decode_attention_impl`."""
