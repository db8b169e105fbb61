"""LLM policies: the Llama/Qwen2 decoder in Flax NNX, weights, tokenizers, sharding.

Entry point: `load_model(name_or_path)` -> (Decoder, Tokenizer, ModelConfig).
"""

from hgpo_jax.models.config import ModelConfig, get_preset
from hgpo_jax.models.decoder import Decoder, KVCache, init_cache
from hgpo_jax.models.loading import load_model
from hgpo_jax.models.sharding import make_mesh, param_shardings, shard_model
from hgpo_jax.models.tokenizer import Tokenizer

__all__ = [
    "Decoder", "KVCache", "ModelConfig", "Tokenizer", "get_preset", "init_cache",
    "load_model", "make_mesh", "param_shardings", "shard_model",
]
