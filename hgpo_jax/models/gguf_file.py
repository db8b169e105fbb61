"""A GGUF file (llama.cpp format): its architecture, tokenizer and dequantized tensors.

Supported architectures: "llama" (SmolLM2, Llama), "qwen2" and "qwen3". llama.cpp's
converter permutes the q/k rows of Llama checkpoints so that GGML's adjacent-pair RoPE is
right, hence rope_layout "interleaved" for "llama"; it leaves Qwen2 and Qwen3 unpermuted
(GGML NeoX RoPE), hence "half". A missing `output.weight` means the output layer is tied to
`token_embd`; `attn_q_norm`/`attn_k_norm` tensors are Qwen3's q/k norms. RoPE scaling is
refused (llama.cpp writes Llama 3's as a `rope_freqs` tensor and `rope.scaling.*` keys;
load such models from their Hugging Face directory).
Quantized tensors are dequantized to float32 with `gguf.quants.dequantize`.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import Keys, MODEL_TENSOR

from hgpo_jax.models.config import ModelConfig
from hgpo_jax.models.tokenizer import Tokenizer, tokenizer_from_gguf_vocab
from hgpo_jax.models.weights import TensorSource

# Canonical tensor kind -> (gguf's tensor enum, suffix); the names are gguf's own table
# (`gguf.TENSOR_NAMES`, e.g. "blk.{bid}.attn_q"), so they follow llama.cpp's converter.
_GGUF_TENSORS = {
    "embed": (MODEL_TENSOR.TOKEN_EMBD, "weight"),
    "final_norm": (MODEL_TENSOR.OUTPUT_NORM, "weight"),
    "lm_head": (MODEL_TENSOR.OUTPUT, "weight"),
    "attn_norm": (MODEL_TENSOR.ATTN_NORM, "weight"),
    "q": (MODEL_TENSOR.ATTN_Q, "weight"),
    "k": (MODEL_TENSOR.ATTN_K, "weight"),
    "v": (MODEL_TENSOR.ATTN_V, "weight"),
    "o": (MODEL_TENSOR.ATTN_OUT, "weight"),
    "q_bias": (MODEL_TENSOR.ATTN_Q, "bias"),
    "k_bias": (MODEL_TENSOR.ATTN_K, "bias"),
    "v_bias": (MODEL_TENSOR.ATTN_V, "bias"),
    "q_norm": (MODEL_TENSOR.ATTN_Q_NORM, "weight"),
    "k_norm": (MODEL_TENSOR.ATTN_K_NORM, "weight"),
    "mlp_norm": (MODEL_TENSOR.FFN_NORM, "weight"),
    "gate": (MODEL_TENSOR.FFN_GATE, "weight"),
    "up": (MODEL_TENSOR.FFN_UP, "weight"),
    "down": (MODEL_TENSOR.FFN_DOWN, "weight"),
}
GGUF_NAMES = {kind: gguf.TENSOR_NAMES[tensor].replace("{bid}", "{i}") + "." + suffix
              for kind, (tensor, suffix) in _GGUF_TENSORS.items()}
_ROPE_LAYOUT = {gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA]: "interleaved",
                gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2]: "half",
                gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3]: "half"}


class GGUFFile:
  """Memory-mapped GGUF file with typed access to metadata and tensors."""

  def __init__(self, path: str):
    self.path = path
    try:
      self.reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as e:  # IndexError: a truncated file
      raise ValueError(f"{path}: not a readable GGUF file ({e}).") from None
    self.tensors = {t.name: t for t in self.reader.tensors}

  def field(self, key: str, default=None):
    """Metadata value (str, number or list), or `default` when absent."""
    f = self.reader.fields.get(key)
    return default if f is None else f.contents()

  def require(self, key: str):
    value = self.field(key)
    if value is None:
      raise ValueError(f"{self.path}: metadata key {key!r} missing.")
    return value

  @property
  def architecture(self) -> str:
    arch = self.require(Keys.General.ARCHITECTURE)
    if arch not in _ROPE_LAYOUT:
      raise ValueError(f"{self.path}: GGUF architecture {arch!r} is not supported "
                       f"(supported: {tuple(_ROPE_LAYOUT)}).")
    return arch

  def model_config(self) -> ModelConfig:
    """The ModelConfig implied by the `<arch>.*` metadata and the tensors present."""
    arch = self.architecture
    key = lambda k: k.format(arch=arch)  # gguf's per-architecture keys: "{arch}.block_count"
    llm, attention = Keys.LLM, Keys.Attention
    num_heads = int(self.require(key(attention.HEAD_COUNT)))
    hidden = int(self.require(key(llm.EMBEDDING_LENGTH)))
    vocab = self.field(key(llm.VOCAB_SIZE))
    scaling = self.field(key(Keys.Rope.SCALING_TYPE), "none")
    if scaling != "none" or gguf.TENSOR_NAMES[MODEL_TENSOR.ROPE_FREQS] + ".weight" in self.tensors:
      raise ValueError(f"{self.path}: RoPE scaling ({key(Keys.Rope.SCALING_TYPE)}={scaling!r}, "
                       "or a rope_freqs tensor) is not implemented for GGUF files; load the "
                       "model's Hugging Face directory instead.")
    if vocab is None:
      vocab = len(self.require(Keys.Tokenizer.LIST))
    return ModelConfig(
        vocab_size=int(vocab), hidden_dim=hidden, num_layers=int(self.require(key(llm.BLOCK_COUNT))),
        num_heads=num_heads,
        num_kv_heads=int(self.field(key(attention.HEAD_COUNT_KV), num_heads)),
        head_dim=int(self.field(key(attention.KEY_LENGTH), hidden // num_heads)),
        mlp_dim=int(self.require(key(llm.FEED_FORWARD_LENGTH))),
        rope_theta=float(self.field(key(Keys.Rope.FREQ_BASE), 10000.0)),
        rms_eps=float(self.require(key(attention.LAYERNORM_RMS_EPS))),
        qkv_bias=GGUF_NAMES["q_bias"].format(i=0) in self.tensors,
        tie_embeddings=GGUF_NAMES["lm_head"] not in self.tensors,
        rope_layout=_ROPE_LAYOUT[arch], qk_norm=GGUF_NAMES["q_norm"].format(i=0) in self.tensors,
        max_seq_len=int(self.field(key(llm.CONTEXT_LENGTH), 4096)))

  def tensor(self, name: str) -> np.ndarray:
    """float32 tensor in numpy order ([out, in]: GGML lists dimensions innermost first)."""
    t = self.tensors[name]
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(w, np.float32).reshape([int(n) for n in reversed(t.shape)])

  def tensor_source(self) -> TensorSource:
    def source(kind, layer):
      name = GGUF_NAMES[kind].format(i=layer)
      if name not in self.tensors:
        return None, f"{self.path}: {name}"
      return self.tensor(name), f"{self.path}: {name}"
    return source

  def tokenizer(self) -> Tokenizer:
    """The tokenizer rebuilt from `tokenizer.ggml.*` (byte-level BPE vocabularies only)."""
    tk = Keys.Tokenizer
    return tokenizer_from_gguf_vocab(
        self.require(tk.LIST), self.require(tk.MERGES), self.require(tk.TOKEN_TYPE),
        model=self.require(tk.MODEL), pre=self.field(tk.PRE, "default"),
        bos_id=self.field(tk.BOS_ID), eos_id=self.field(tk.EOS_ID), pad_id=self.field(tk.PAD_ID),
        chat_template=self.field(tk.CHAT_TEMPLATE, ""))
