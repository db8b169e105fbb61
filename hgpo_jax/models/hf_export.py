"""Writing a Hugging Face model directory: the inverse of `loading.load_hf_dir`.

A directory written here holds what `transformers.AutoModelForCausalLM.from_pretrained`
and `AutoTokenizer.from_pretrained` read, and what this project's own loader reads back:
  config.json                  `config.hf_config_dict` (llama, qwen2 or qwen3; the "dtype"
                               field names the tensors' dtype);
  model.safetensors            `weights.hf_tensors` (HF names, [out, in] layout), or shards
                               `model-0000i-of-0000n.safetensors` plus
                               `model.safetensors.index.json` above `max_shard_bytes`, split
                               as `huggingface_hub.split_torch_state_dict_into_shards` splits
                               (tensors in order; a new shard when the next tensor would pass
                               the limit; a tensor above it alone);
  generation_config.json       the source model's, else bos/eos/pad ids of the tokenizer;
  tokenizer files              copied from the source HF directory, else `tokenizer.json`
                               from the `tokenizers` object in use plus a
                               `tokenizer_config.json` with its chat template and special
                               tokens (the GGUF and tiny tokenizers).

The value model (critic) is written by `write_critic_dir` (docs/architecture.md, "Ways
out"): its backbone as a model directory of the same family with tied embeddings, plus
`value_heads.safetensors` and `value_heads.json`.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import safetensors.numpy

from hgpo_jax.models.config import ModelConfig, hf_config_dict
from hgpo_jax.models.tokenizer import Tokenizer
from hgpo_jax.models.weights import hf_tensors

SAFETENSORS_METADATA = {"format": "pt"}
"""transformers reads `format` to pick the framework of a safetensors file."""
DEFAULT_MAX_SHARD_SIZE = "5GB"
"""huggingface_hub's default shard limit (transformers 4's `save_pretrained`; 5 raised its
own to 50GB): shards a hub upload takes without large-file handling."""
NUMPY_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt",
                   "tokenizer.model")
"""Files of a Hugging Face tokenizer, copied as they are when the source directory has them."""
VALUE_HEADS_FILE = "value_heads.safetensors"
VALUE_HEADS_JSON = "value_heads.json"

_UNITS = {"GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "GB": 10**9, "MB": 10**6, "KB": 10**3, "B": 1}


def parse_size(text: str | int) -> int:
  """Bytes of a size such as "5GB" (10^9 units) or "2MiB" (2^20 units), as transformers'
  `convert_file_size_to_int` reads `max_shard_size`; a bare integer is bytes."""
  if isinstance(text, int):
    size = text
  else:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]I?B|B)?\s*", str(text), flags=re.IGNORECASE)
    if not m:
      raise ValueError(f"size {text!r}: write an integer and a unit, e.g. 5GB, 500MB, 2MiB or 1024")
    size = int(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]
  if size < 1:
    raise ValueError(f"size {text!r} must be at least 1 byte")
  return size


def shard_names(tensors: dict[str, np.ndarray], max_shard_bytes: int) -> list[list[str]]:
  """Tensor names per shard file, in order (huggingface_hub's split rule)."""
  shards, current, size = [], [], 0
  for name, w in tensors.items():
    if w.nbytes > max_shard_bytes:
      shards.append([name])
      continue
    if current and size + w.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = [], 0
    current.append(name)
    size += w.nbytes
  if current:
    shards.append(current)
  return shards


def write_safetensors(directory: str, tensors: dict[str, np.ndarray], max_shard_bytes: int,
                      stem: str = "model") -> list[str]:
  """`<stem>.safetensors`, or shards and `<stem>.safetensors.index.json`; returns the file
  names written. Shards are written one at a time (no second copy of the model)."""
  shards = shard_names(tensors, max_shard_bytes)
  if len(shards) == 1:
    name = f"{stem}.safetensors"
    safetensors.numpy.save_file({n: np.ascontiguousarray(tensors[n]) for n in shards[0]},
                                os.path.join(directory, name), metadata=SAFETENSORS_METADATA)
    return [name]
  weight_map, files = {}, []
  for i, names in enumerate(shards):
    name = f"{stem}-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    safetensors.numpy.save_file({n: np.ascontiguousarray(tensors[n]) for n in names},
                                os.path.join(directory, name), metadata=SAFETENSORS_METADATA)
    weight_map.update({n: name for n in names})
    files.append(name)
  index = {"metadata": {"total_size": int(sum(w.nbytes for w in tensors.values()))},
           "weight_map": weight_map}
  index_name = f"{stem}.safetensors.index.json"
  _write_json(os.path.join(directory, index_name), index)
  return files + [index_name]


def write_tokenizer(directory: str, tokenizer: Tokenizer, source_dir: str | None = None) -> list[str]:
  """The tokenizer files: copied from `source_dir` (a HF model directory) when it has a
  `tokenizer.json`; else written from `tokenizer` (its `tokenizers` object, special tokens
  and chat template), which transformers' `AutoTokenizer` loads as a fast tokenizer."""
  if source_dir and os.path.isfile(os.path.join(source_dir, "tokenizer.json")):
    names = [n for n in TOKENIZER_FILES if os.path.isfile(os.path.join(source_dir, n))]
    for name in names:
      shutil.copyfile(os.path.join(source_dir, name), os.path.join(directory, name))
    return names
  tokenizer.backend.save(os.path.join(directory, "tokenizer.json"))
  token = lambda i: None if i is None else tokenizer.backend.id_to_token(i)
  config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "bos_token": token(tokenizer.bos_id), "eos_token": token(tokenizer.eos_ids[0]),
            "pad_token": token(tokenizer.pad_id), "add_bos_token": False, "add_eos_token": False}
  if tokenizer.chat_template:
    config["chat_template"] = tokenizer.chat_template
  _write_json(os.path.join(directory, "tokenizer_config.json"), config)
  return ["tokenizer.json", "tokenizer_config.json"]


def write_generation_config(directory: str, tokenizer: Tokenizer,
                            source_dir: str | None = None) -> list[str]:
  """generation_config.json: the source directory's (its sampling defaults), else the
  tokenizer's bos, eos (every id that ends a generation) and pad ids."""
  name = "generation_config.json"
  source = os.path.join(source_dir, name) if source_dir else ""
  if source and os.path.isfile(source):
    shutil.copyfile(source, os.path.join(directory, name))
    return [name]
  eos = list(tokenizer.eos_ids)
  config = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": tokenizer.pad_id}
  if tokenizer.bos_id is not None:
    config["bos_token_id"] = tokenizer.bos_id
  _write_json(os.path.join(directory, name), config)
  return [name]


def to_half_rope(cfg: ModelConfig, params: dict[str, np.ndarray]):
  """(cfg, params) in the "half" RoPE layout of Hugging Face checkpoints.

  GGUF Llama weights (SmolLM2) keep llama.cpp's row order, whose RoPE pairs adjacent lanes
  (2i, 2i + 1) of each head (`rope_layout="interleaved"`); transformers pairs (i, i + Dh/2).
  Both rotate pair i by the same frequency, so taking each q/k head's even lanes, then its
  odd ones, gives the same attention scores (the inverse of the permutation llama.cpp's
  `convert_hf_to_gguf.py` applies to q_proj/k_proj). Other params pass through.
  """
  if cfg.rope_layout == "half":
    return cfg, params
  lanes = np.concatenate([np.arange(0, cfg.head_dim, 2), np.arange(1, cfg.head_dim, 2)])
  # The head_dim axis of each per-head tensor (the Decoder's layout, layers first).
  axis = {"layers/q": 2, "layers/k": 2, "layers/q_bias": 2, "layers/k_bias": 2,
          "layers/q_norm": 1, "layers/k_norm": 1}
  out = {n: (np.take(w, lanes, axis=axis[n]) if n in axis else w) for n, w in params.items()}
  return cfg.replace(rope_layout="half"), out


def write_model_dir(directory: str, cfg: ModelConfig, params: dict[str, np.ndarray], *,
                    tokenizer: Tokenizer, tokenizer_dir: str | None = None,
                    dtype: str | None = None,
                    max_shard_bytes: int = parse_size(DEFAULT_MAX_SHARD_SIZE)) -> list[str]:
  """A Hugging Face causal-LM directory of the Decoder `params` ("embed", "layers/q", ...,
  numpy); returns the file names written.

  Args:
    directory: an existing directory (the caller decides about files already there).
    cfg: the architecture the params belong to.
    params: flat Decoder parameter paths -> arrays (any float dtype).
    tokenizer: the model's tokenizer; `tokenizer_dir` a HF directory to copy its files
      (and generation_config.json) from instead.
    dtype: "float32" or "bfloat16" for the tensors (round to nearest even); default the
      params' own dtype.
    max_shard_bytes: the largest shard file (`parse_size`).
  """
  cfg, params = to_half_rope(cfg, params)
  tensors = hf_tensors(cfg, params)
  if dtype is not None:
    tensors = {n: w.astype(NUMPY_DTYPES[dtype]) for n, w in tensors.items()}
  stored = {str(w.dtype) for w in tensors.values()}
  if len(stored) != 1 or next(iter(stored)) not in NUMPY_DTYPES:
    raise ValueError(f"write_model_dir: tensors in {sorted(stored)}; pass dtype= one of "
                     f"{tuple(NUMPY_DTYPES)}")
  config = hf_config_dict(cfg)
  config["dtype"] = next(iter(stored))
  _write_json(os.path.join(directory, "config.json"), config)
  files = ["config.json"]
  files += write_generation_config(directory, tokenizer, tokenizer_dir)
  files += write_safetensors(directory, tensors, max_shard_bytes)
  files += write_tokenizer(directory, tokenizer, tokenizer_dir)
  return files


def write_critic_dir(directory: str, cfg: ModelConfig, backbone: dict[str, np.ndarray],
                     value_head_hd: np.ndarray, value_bias_h: np.ndarray, heads: tuple[str, ...],
                     **model_dir_kwargs) -> list[str]:
  """The value model (`models.critic.Critic`) as a model directory plus its heads.

  The backbone (`critic.backbone_config(cfg)`: tied embeddings, so no output layer of its
  own) is a causal-LM directory (`write_model_dir`); the heads go to
  `value_heads.safetensors` ("value_head" [H, D], "value_bias" [H]) and `value_heads.json`
  names them in order. With transformers: `values[b, t, h] = value_head[h] .
  model.model(ids).last_hidden_state[b, t] + value_bias[h]`, the value of token t + 1
  (the Critic's column t + 1).
  """
  from hgpo_jax.models import critic as critic_lib
  if value_head_hd.shape != (len(heads), cfg.hidden_dim) or value_bias_h.shape != (len(heads),):
    raise ValueError(f"write_critic_dir: value_head {value_head_hd.shape} / value_bias "
                     f"{value_bias_h.shape} do not match {len(heads)} heads of width {cfg.hidden_dim}")
  files = write_model_dir(directory, critic_lib.backbone_config(cfg), backbone, **model_dir_kwargs)
  dtype = model_dir_kwargs.get("dtype")
  cast = (lambda w: w.astype(NUMPY_DTYPES[dtype])) if dtype else (lambda w: w)
  safetensors.numpy.save_file(
      {"value_head": np.ascontiguousarray(cast(value_head_hd)),
       "value_bias": np.ascontiguousarray(cast(value_bias_h))},
      os.path.join(directory, VALUE_HEADS_FILE), metadata=SAFETENSORS_METADATA)
  _write_json(os.path.join(directory, VALUE_HEADS_JSON), {
      "heads": list(heads), "hidden_size": cfg.hidden_dim, "tensors": VALUE_HEADS_FILE,
      "value": "value_head[h] . last_hidden_state[t] + value_bias[h] = the value of token t + 1"})
  return files + [VALUE_HEADS_FILE, VALUE_HEADS_JSON]


def _write_json(path: str, obj: dict) -> None:
  with open(path, "w", encoding="utf-8") as f:
    json.dump(obj, f, indent=2, ensure_ascii=False)
    f.write("\n")
