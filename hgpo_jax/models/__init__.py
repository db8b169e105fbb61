"""LLM policies: the Llama/Qwen2/Qwen3 decoder in Flax NNX, weights, tokenizers, sharding.

Entry point: `load_model(name_or_path)` -> (Decoder, Tokenizer, ModelConfig).
The names below load their module on first use, so importing one light module of the
package (`hgpo_jax.models.config`) does not import the decoder and its Pallas kernels.
"""

import importlib

_EXPORTS = {
    "Decoder": "decoder", "KVCache": "kv_cache", "ModelConfig": "config",
    "Tokenizer": "tokenizer", "get_preset": "config", "init_cache": "kv_cache",
    "load_model": "loading", "make_mesh": "sharding", "param_shardings": "sharding",
    "shard_model": "sharding",
}
# No `__all__`: these names resolve lazily (`__getattr__`), and the API reference documents
# them in their modules.


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'hgpo_jax.models' has no attribute {name!r}")
  return getattr(importlib.import_module(f"hgpo_jax.models.{_EXPORTS[name]}"), name)
