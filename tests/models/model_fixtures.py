"""Shared helpers of the model tests: tiny random HF checkpoints and padded batches."""

import json
import os

import numpy as np

from hgpo_jax.models.tokenizer import tiny_tokenizer


def hf_config(arch: str):
  """A random-init-sized Llama, Qwen2 or Qwen3 transformers config on the tiny tokenizer's vocab."""
  import transformers
  common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                rms_norm_eps=1e-6, rope_theta=10000.0, eos_token_id=2, bos_token_id=None,
                pad_token_id=0)
  if arch == "llama":
    # head_dim * heads != hidden_size checks the o-projection layout; tied output.
    return transformers.LlamaConfig(head_dim=8, tie_word_embeddings=True, **common)
  if arch == "qwen2":
    return transformers.Qwen2Config(tie_word_embeddings=False, **common)
  if arch == "qwen3":  # q/k norms; head_dim * heads != hidden_size; untied output
    return transformers.Qwen3Config(head_dim=24, tie_word_embeddings=False, **common)
  raise ValueError(arch)


def write_hf_dir(directory: str, arch: str, *, seed: int = 0, max_shard_size=None):
  """Saves a random HF model (norm scales and biases randomised too) + tiny tokenizer.

  Returns the torch model (eval mode, eager attention) for reference logits.
  """
  return write_hf_model(directory, hf_config(arch), seed=seed, max_shard_size=max_shard_size)


def write_hf_model(directory: str, cfg, *, seed: int = 0, max_shard_size=None,
                   qk_scale: float = 1.0):
  """`write_hf_dir` of a given transformers config (LlamaConfig, Qwen2Config, Qwen3Config);
  `qk_scale` multiplies the q and k projections (sharper attention, so that position
  encodings change the logits more)."""
  import torch
  import transformers
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.copy_(0.5 * torch.randn_like(p))
      elif name.endswith(("q_proj.weight", "k_proj.weight")):
        p.mul_(qk_scale)
  model.config._attn_implementation = "eager"
  kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
  model.save_pretrained(directory, safe_serialization=True, **kwargs)
  tiny_tokenizer().backend.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
  return model


def left_padded_batch(seed: int = 0, batch: int = 3, length: int = 10, pads=(0, 3, 7), vocab=512):
  """(tokens int32[B, T], input_mask bool[B, T], positions int32[B, T]) with left padding."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, vocab, size=(batch, length)).astype(np.int32)
  mask = np.ones((batch, length), bool)
  for row, n in enumerate(pads[:batch]):
    mask[row, :n] = False
    tokens[row, :n] = 0
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def torch_logits(model, tokens, mask, positions) -> np.ndarray:
  """f32[B, T, V] logits of the transformers reference model."""
  import torch
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                attention_mask=torch.tensor(mask, dtype=torch.long),
                position_ids=torch.tensor(positions, dtype=torch.long))
  return out.logits.float().numpy()
