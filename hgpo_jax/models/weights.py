"""Checkpoint tensors -> the Decoder's stacked parameters, and the Hugging Face reader.

Both checkpoint formats (HF safetensors here, GGUF in `hgpo_jax.models.gguf_file`) expose
tensors in the Hugging Face / PyTorch `nn.Linear` layout, weight [out, in]. They differ
only in names, so each reader supplies a `TensorSource` and `assemble_params` does the
shared work: shape checks (one-line errors naming file, tensor, expected vs found shape),
transposition into the Decoder's layout, and stacking of the L layers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import ml_dtypes
import numpy as np
import safetensors

from hgpo_jax.models.config import ModelConfig

# Canonical tensor kinds: per model, and per layer (the Decoder's DecoderLayers names).
MODEL_TENSORS = ("embed", "final_norm", "lm_head")
LAYER_TENSORS = ("attn_norm", "q", "k", "v", "o", "q_bias", "k_bias", "v_bias",
                 "q_norm", "k_norm", "mlp_norm", "gate", "up", "down")

HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "final_norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "attn_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj.weight",
    "k": "model.layers.{i}.self_attn.k_proj.weight",
    "v": "model.layers.{i}.self_attn.v_proj.weight",
    "o": "model.layers.{i}.self_attn.o_proj.weight",
    "q_bias": "model.layers.{i}.self_attn.q_proj.bias",
    "k_bias": "model.layers.{i}.self_attn.k_proj.bias",
    "v_bias": "model.layers.{i}.self_attn.v_proj.bias",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}


def checkpoint_shape(cfg: ModelConfig, kind: str) -> tuple[int, ...]:
  """Shape of one tensor of this kind in the checkpoint ([out, in] for projections)."""
  d, h, kv, dh, f, v = (cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.mlp_dim, cfg.vocab_size)
  return {"embed": (v, d), "lm_head": (v, d), "final_norm": (d,), "attn_norm": (d,),
          "mlp_norm": (d,), "q": (h * dh, d), "k": (kv * dh, d), "v": (kv * dh, d),
          "o": (d, h * dh), "q_bias": (h * dh,), "k_bias": (kv * dh,), "v_bias": (kv * dh,),
          "q_norm": (dh,), "k_norm": (dh,), "gate": (f, d), "up": (f, d), "down": (d, f)}[kind]


def to_decoder_layout(cfg: ModelConfig, kind: str, w: np.ndarray) -> np.ndarray:
  """One checkpoint tensor in the Decoder's layout (see DecoderLayers' docstring): the
  [out, in] order is kept, only the head axes are split out."""
  d, h, kv, dh = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  if kind == "q":
    return w.reshape(h, dh, d)
  if kind in ("k", "v"):
    return w.reshape(kv, dh, d)
  if kind == "o":
    return w.reshape(d, h, dh)
  if kind == "q_bias":
    return w.reshape(h, dh)
  if kind in ("k_bias", "v_bias"):
    return w.reshape(kv, dh)
  return w


def layer_kinds(cfg: ModelConfig) -> tuple[str, ...]:
  """The per-layer tensor kinds of this architecture: biases with cfg.qkv_bias, q/k norms
  with cfg.qk_norm."""
  return tuple(k for k in LAYER_TENSORS if (cfg.qkv_bias or not k.endswith("_bias"))
               and (cfg.qk_norm or k not in ("q_norm", "k_norm")))


def hf_tensors(cfg: ModelConfig, params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Decoder parameter path ("embed", "layers/q", ...) -> Hugging Face tensor name
  ("model.layers.{i}.self_attn.q_proj.weight", ...) in the checkpoint's [out, in] layout:
  the inverse of `assemble_params` (dtypes kept; no lm_head when tied). Raises ValueError
  for a missing or unexpected parameter or a shape that is not the config's."""
  expected = {"embed", "final_norm", *(() if cfg.tie_embeddings else ("lm_head",)),
              *(f"layers/{k}" for k in layer_kinds(cfg))}
  if set(params) != expected:
    raise ValueError(f"hf_tensors: parameters {sorted(set(params) - expected)} unexpected, "
                     f"{sorted(expected - set(params))} missing for this config.")
  out = {}
  for path, w in params.items():
    kind = path.removeprefix("layers/")
    stacked = kind != path
    shape = checkpoint_shape(cfg, kind)
    w = np.asarray(w)
    want = ((cfg.num_layers,) if stacked else ()) + (int(np.prod(shape)),)
    if (w.shape[0],) * stacked + (int(np.prod(w.shape[stacked:])),) != want:
      raise ValueError(f"hf_tensors: {path} has shape {w.shape}; this config's is "
                       f"{'[L] + ' if stacked else ''}{shape} (in the Decoder's layout).")
    if not stacked:
      out[HF_NAMES[kind]] = w.reshape(shape)
      continue
    for i in range(cfg.num_layers):
      out[HF_NAMES[kind].format(i=i)] = w[i].reshape(shape)
  return out


# A TensorSource returns (array in checkpoint layout, "file: tensor name" for messages),
# or (None, description) when the checkpoint lacks the tensor.
TensorSource = Callable[[str, int | None], tuple[np.ndarray | None, str]]


def assemble_params(cfg: ModelConfig, source: TensorSource) -> dict[str, np.ndarray]:
  """Decoder parameter path ("embed", "layers/q", ...) -> numpy array in cfg.param_dtype."""
  dtype = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(np.float32)

  def fetch(kind, layer=None):
    w, where = source(kind, layer)
    if w is None:
      raise ValueError(f"{where}: tensor missing; the {kind} weight of shape "
                       f"{checkpoint_shape(cfg, kind)} is required by this config.")
    expected = checkpoint_shape(cfg, kind)
    if tuple(w.shape) != expected:
      raise ValueError(f"{where}: shape {tuple(w.shape)} does not match the expected {expected} "
                       "(config and weights disagree).")
    return to_decoder_layout(cfg, kind, np.asarray(w)).astype(dtype)

  params = {"embed": fetch("embed"), "final_norm": fetch("final_norm")}
  if not cfg.tie_embeddings:
    params["lm_head"] = fetch("lm_head")
  for kind in layer_kinds(cfg):
    first = fetch(kind, 0)
    # Filled in place: stacking a list would hold every layer twice.
    stacked = np.empty((cfg.num_layers,) + first.shape, dtype)
    stacked[0] = first
    for i in range(1, cfg.num_layers):
      stacked[i] = fetch(kind, i)
    params[f"layers/{kind}"] = stacked
  return params


# --------------------------------------------------------------- safetensors reader
class SafetensorsFile:
  """One .safetensors file read with `safetensors.safe_open(framework="numpy")`.

  numpy has no bfloat16; importing ml_dtypes (above) registers it, so BF16 tensors come
  back as ml_dtypes.bfloat16 arrays. A truncated or corrupt file is a one-line ValueError.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      self._file = safetensors.safe_open(path, framework="numpy")
    except (safetensors.SafetensorError, OSError) as e:
      raise ValueError(f"{path}: not a readable safetensors file ({e}); download it again.") from None
    self.names = frozenset(self._file.keys())

  def get(self, name: str) -> np.ndarray:
    """The tensor `name` as a numpy array."""
    try:
      return self._file.get_tensor(name)
    except (safetensors.SafetensorError, TypeError, ValueError) as e:
      raise ValueError(f"{self.path}: tensor {name} cannot be read ({e}); "
                       "download the file again.") from None


def hf_tensor_source(directory: str) -> TensorSource:
  """A TensorSource over a HF directory: model.safetensors, or shards listed in
  model.safetensors.index.json."""
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    files = {}
    for shard in sorted(set(weight_map.values())):
      shard_path = os.path.join(directory, shard)
      if not os.path.isfile(shard_path):
        raise FileNotFoundError(f"{shard_path} not found but listed in {index_path}; "
                                "download the missing shard.")
      files[shard] = SafetensorsFile(shard_path)
    locate = lambda name: files[weight_map[name]] if name in weight_map else None
    missing_where = index_path
  else:
    single = os.path.join(directory, "model.safetensors")
    if not os.path.isfile(single):
      raise FileNotFoundError(f"{directory}: neither model.safetensors nor "
                              "model.safetensors.index.json found; save the model with "
                              "save_pretrained(safe_serialization=True).")
    st = SafetensorsFile(single)
    locate = lambda name: st if name in st.names else None
    missing_where = single

  def source(kind, layer):
    name = HF_NAMES[kind].format(i=layer)
    st = locate(name)
    if st is None:
      return None, f"{missing_where}: {name}"
    return st.get(name), f"{st.path}: {name}"

  return source
