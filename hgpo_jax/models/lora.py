"""LoRA adapters over a frozen decoder (Hu et al., arXiv:2106.09685, eq. 3) and PEFT's files.

A target projection W [out, in] (stored [L, out..., in...] in `DecoderLayers`) computes
  y = x Wᵀ + s · (x A) B,   A [in, r], B [r, out],   s = alpha / r (rsLoRA: alpha / √r,
Kalajdzievski, arXiv:2312.03732)
as PEFT's `peft/tuners/lora/layer.py` `Linear.forward` does (`lora_B(lora_A(x)) * scaling`,
dropout 0). A is initialised as PEFT's `reset_lora_parameters` does (torch's Kaiming-uniform
with a = √5 on lora_A's [r, in] weight: U(-1/√in, 1/√in)) and B with zeros, so a fresh
adapter leaves the base policy exactly as it was. Adapters are `nnx.LoRAParam`s named
`<projection>_lora_a` / `_lora_b` beside their base weight, stacked over the layers:
A [L, in..., r] and B [L, r, out...] (with `top_layers`: over the last layers only), whose
in / out axes keep the base weight's logical axis names (so they shard as its input and
output do) and whose rank axis ("lora_rank", no rule) is replicated. Adapters are float32 (PEFT's `autocast_adapter_dtype`); with LoRA
the frozen base is stored in the compute dtype (`hgpo_jax.training.experiment.model_settings`).

PEFT's files (`save_pretrained`): `adapter_config.json` and `adapter_model.safetensors`
with `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` [r, in] and
`... .lora_B.weight` [out, r] (torch `nn.Linear` layout), read by `read_peft_adapter` and
written by `write_peft_adapter`.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hgpo_jax.models.config import DECODER_NAMES, TARGETS, LoraConfig
from hgpo_jax.models.weights import SafetensorsFile

_HF_MODULES = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
               "v_proj": "self_attn.v_proj", "o_proj": "self_attn.o_proj",
               "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
               "down_proj": "mlp.down_proj"}

_OUT_AXES = {"q": 2, "k": 2, "v": 2, "o": 1, "gate": 1, "up": 1, "down": 1}
"""How many of a stacked base weight's axes after the layer axis are its output axes
(q [L, H, Dh, D]: out (H, Dh), in D; o [L, D, H, Dh]: out D, in (H, Dh))."""

SUFFIXES = ("_lora_a", "_lora_b")
PARAM_NAMES = tuple(n + s for n in DECODER_NAMES.values() for s in SUFFIXES)
"""Every adapter attribute a `DecoderLayers` may hold."""

ADAPTER_DTYPE = jnp.float32
RANK_AXIS = "lora_rank"  # no sharding rule: replicated

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def from_settings(rank: int, alpha: float, targets: str | tuple, rslora: bool,
                  top_layers: int = 0) -> LoraConfig:
  """A LoraConfig from the command line's values (targets comma-separated)."""
  if isinstance(targets, str):
    targets = tuple(t.strip() for t in targets.split(",") if t.strip())
  return LoraConfig(rank=int(rank), alpha=float(alpha), targets=tuple(targets),
                    rslora=bool(rslora), top_layers=int(top_layers))


def adapter_params(base: nnx.Param, name: str, rank: int, key: jax.Array,
                   first_layer: int = 0):
  """(A, B) `nnx.LoRAParam`s for the stacked base weight `base` [L, out..., in...] from
  layer `first_layer` on (n = L - first_layer layers):
  A [n, in..., r] ~ U(-1/√in, 1/√in) (PEFT's Kaiming-uniform, a = √5), B [n, r, out...] = 0,
  float32, with the base's logical axes on their in / out axes."""
  shape = (base.shape[0] - first_layer, *base.shape[1:])
  base_axes = base.get_metadata().get("logical_axes") or (None,) * len(shape)
  n_out = _OUT_AXES[name]
  out_shape, in_shape = shape[1:1 + n_out], shape[1 + n_out:]
  out_axes, in_axes = base_axes[1:1 + n_out], base_axes[1 + n_out:]
  fan_in = int(np.prod(in_shape))
  bound = 1.0 / math.sqrt(fan_in)
  a = jax.random.uniform(key, (shape[0], *in_shape, rank), ADAPTER_DTYPE, -bound, bound)
  b = jnp.zeros((shape[0], rank, *out_shape), ADAPTER_DTYPE)
  return (nnx.LoRAParam(a, logical_axes=(base_axes[0], *in_axes, RANK_AXIS)),
          nnx.LoRAParam(b, logical_axes=(base_axes[0], RANK_AXIS, *out_axes)))


def merged_weight(w, a, b, scale: float, dtype):
  """W + s · (A B)ᵀ in W's layout, in `dtype`: one stacked base weight w [L, out..., in...]
  with its adapters a [n, in..., r], b [n, r, out...] of its last n layers (the products
  summed in float32; the layers below them cast only)."""
  n, r = a.shape[0], a.shape[-1]
  a_lir = a.reshape(n, -1, r).astype(dtype)
  b_lro = b.reshape(n, r, -1).astype(dtype)
  delta_loi = jnp.einsum("lir,lro->loi", a_lir, b_lro, preferred_element_type=jnp.float32)
  top = w[w.shape[0] - n:]
  top = (top.astype(jnp.float32) + scale * delta_loi.reshape(top.shape)).astype(dtype)
  if n == w.shape[0]:
    return top
  return jnp.concatenate([w[:w.shape[0] - n].astype(dtype), top])


def is_adapter(name: str) -> bool:
  """Whether a parameter's name is an adapter's (`<projection>_lora_a` / `_lora_b`)."""
  return str(name).endswith(SUFFIXES)


def has_adapters(params: Any) -> bool:
  """Whether a pure param dict (of arrays, shapes or shardings) holds adapters."""
  return isinstance(params, dict) and any(
      is_adapter(k) or has_adapters(v) for k, v in params.items())


def _trained(name) -> bool:
  return is_adapter(name) or str(name).startswith("value_")


def trainable_params(params: Any) -> Any:
  """The leaves of a pure param dict the optimizer trains: all of them without adapters;
  with them the adapters and any value head (`value_*`, the critic's full-rank heads), as
  a dict pruned of the frozen base (so optimizer state, gradients and checkpoints hold
  only these)."""
  if not has_adapters(params):
    return params

  def prune(tree: dict) -> dict:
    out = {}
    for k, v in tree.items():
      if isinstance(v, dict):
        if sub := prune(v):
          out[k] = sub
      elif _trained(k):
        out[k] = v
    return out
  return prune(params)


def with_frozen(trained: Any, params: Any) -> Any:
  """`params` with the leaves of `trained` (a `trainable_params` dict) in their places."""
  if not has_adapters(params):
    return trained
  return {k: (with_frozen(trained[k], v) if isinstance(v, dict) and k in trained
              else trained.get(k, v)) for k, v in params.items()}


def without_adapters(params: dict) -> dict:
  """A pure param dict with every adapter removed (the base's own tree)."""
  if not isinstance(params, dict):
    return params
  return {k: without_adapters(v) for k, v in params.items() if not is_adapter(k)}


def merge_into_base(params: dict, lora: LoraConfig, dtype) -> dict:
  """A decoder's pure params with each adapted weight merged (`merged_weight`, in `dtype`)
  and the adapters dropped: the params of the same decoder without LoRA."""
  layers = dict(params["layers"])
  for name in lora.names:
    layers[name] = merged_weight(layers[name], layers[f"{name}_lora_a"],
                                 layers[f"{name}_lora_b"], lora.scale, dtype)
  return dict(without_adapters(params), layers=without_adapters(layers))


# ------------------------------------------------------------------------ PEFT files
def peft_key(target: str, layer: int, which: str) -> str:
  """PEFT's saved name of lora_A / lora_B (`which` "A" / "B") of `target` in `layer`."""
  return f"base_model.model.model.layers.{layer}.{_HF_MODULES[target]}.lora_{which}.weight"


def write_peft_adapter(directory: str, lora: LoraConfig, layers: dict, *, num_layers: int,
                       base_model: str = "") -> None:
  """Writes `adapter_config.json` and `adapter_model.safetensors` (float32, PEFT's key
  names) of the adapters in `layers` (the decoder's pure "layers" dict) to `directory`."""
  from safetensors.numpy import save_file  # noqa: PLC0415  (only the writer needs it)
  os.makedirs(directory, exist_ok=True)
  tensors = {}
  first = lora.first_layer(num_layers)
  for target in lora.targets:
    name = DECODER_NAMES[target]
    a = np.asarray(layers[f"{name}_lora_a"], np.float32)
    b = np.asarray(layers[f"{name}_lora_b"], np.float32)
    for i in range(first, num_layers):
      j = i - first
      tensors[peft_key(target, i, "A")] = np.ascontiguousarray(a[j].reshape(-1, lora.rank).T)
      tensors[peft_key(target, i, "B")] = np.ascontiguousarray(b[j].reshape(lora.rank, -1).T)
  save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
  config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "use_rslora": lora.rslora, "lora_dropout": 0.0,
            "target_modules": sorted(lora.targets), "bias": "none", "fan_in_fan_out": False,
            "base_model_name_or_path": base_model, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, "use_dora": False,
            "layers_to_transform": list(range(first, num_layers)) if first else None}
  with open(os.path.join(directory, CONFIG_FILE), "w") as f:
    json.dump(config, f, indent=2)


def read_peft_config(directory: str, num_layers: int) -> LoraConfig:
  """The LoraConfig of a PEFT adapter directory for a `num_layers`-layer base; one-line
  errors for what is not LoRA as implemented here (DoRA, per-module ranks, biases, layer
  subsets other than the last layers, extra trained modules)."""
  path = os.path.join(directory, CONFIG_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: a PEFT adapter directory holds {CONFIG_FILE} "
                            f"and {WEIGHTS_FILE} (peft save_pretrained).")
  with open(path) as f:
    hf = json.load(f)
  if hf.get("peft_type", "LORA") != "LORA":
    raise ValueError(f"{path}: peft_type={hf.get('peft_type')!r}; only LORA adapters load.")
  unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save",
                             "fan_in_fan_out", "lora_bias", "trainable_token_indices",
                             "target_parameters") if hf.get(k)]
  if hf.get("bias", "none") != "none":
    unsupported.append("bias")
  if unsupported:
    raise ValueError(f"{path}: {', '.join(unsupported)} set; not implemented here.")
  targets = hf.get("target_modules") or []
  if isinstance(targets, str):  # a regex in PEFT
    raise ValueError(f"{path}: target_modules={targets!r} is a pattern; list module names of "
                     f"{','.join(TARGETS)}.")
  layers = hf.get("layers_to_transform")
  if isinstance(layers, int):
    layers = [layers]
  top = 0
  if layers:
    if sorted(layers) != list(range(num_layers - len(layers), num_layers)):
      raise ValueError(f"{path}: layers_to_transform={layers} is not the last layers of this "
                       f"{num_layers}-layer model; only a top block of layers is implemented.")
    top = len(layers) if len(layers) < num_layers else 0
  try:
    return LoraConfig(rank=int(hf["r"]), alpha=float(hf["lora_alpha"]),
                      targets=tuple(t for t in TARGETS if t in targets) or tuple(targets),
                      rslora=bool(hf.get("use_rslora", False)), top_layers=top)
  except (KeyError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from None


def read_peft_adapter(directory: str, layers: dict, num_layers: int) -> tuple[LoraConfig, dict]:
  """(LoraConfig, {"layers/<name>_lora_a": A [L, in..., r], ...}) of a PEFT adapter
  directory, shaped for base weights `layers` (name -> array or ShapeDtypeStruct
  [L, out..., in...]); a shape that disagrees with the base is a one-line ValueError."""
  lora = read_peft_config(directory, num_layers)
  path = os.path.join(directory, WEIGHTS_FILE)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found (peft save_pretrained writes it).")
  st = SafetensorsFile(path)
  out = {}
  first = lora.first_layer(num_layers)
  for target in lora.targets:
    name = DECODER_NAMES[target]
    shape = tuple(layers[name].shape)
    n_out = _OUT_AXES[name]
    out_shape, in_shape = shape[1:1 + n_out], shape[1 + n_out:]
    want = {"A": (lora.rank, int(np.prod(in_shape))), "B": (int(np.prod(out_shape)), lora.rank)}
    a = np.empty((num_layers - first, *in_shape, lora.rank), np.float32)
    b = np.empty((num_layers - first, lora.rank, *out_shape), np.float32)
    for i in range(first, num_layers):
      for which in "AB":
        key = peft_key(target, i, which)
        if key not in st.names:
          raise ValueError(f"{path}: tensor {key} missing; the adapter does not match this "
                           f"{num_layers}-layer model.")
        w = st.get(key)
        if tuple(w.shape) != want[which]:
          raise ValueError(f"{path}: {key} has shape {tuple(w.shape)}, the model needs "
                           f"{want[which]}: the adapter's base model differs from this one.")
        w = np.asarray(w, np.float32)
        if which == "A":
          a[i - first] = w.T.reshape(*in_shape, lora.rank)
        else:
          b[i - first] = w.T.reshape(lora.rank, *out_shape)
    out[f"layers/{name}_lora_a"], out[f"layers/{name}_lora_b"] = a, b
  return lora, out
