"""Decoder logits == Hugging Face transformers on tiny random Llama and Qwen2 checkpoints."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import model_fixtures
from hgpo_jax.models import load_model


def _forward(model, tokens, mask, positions):
  fwd = jax.jit(lambda m, t, p, a: m(t, p, a)[0])
  return np.asarray(fwd(model, jnp.asarray(tokens), jnp.asarray(positions),
                        jnp.asarray(mask)))


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_checkpoint(request, tmp_path_factory):
  arch = request.param
  directory = str(tmp_path_factory.mktemp(f"hf_{arch}"))
  # Qwen2 is saved sharded (index + several files) to cover that reader path.
  torch_model = model_fixtures.write_hf_dir(
      directory, arch, max_shard_size="100KB" if arch == "qwen2" else None)
  return arch, directory, torch_model


def test_logits_match_transformers_on_left_padded_batch(hf_checkpoint):
  arch, directory, torch_model = hf_checkpoint
  model, _, cfg = load_model(directory)
  assert cfg.tie_embeddings == (arch == "llama") and cfg.qkv_bias == (arch == "qwen2")
  tokens, mask, positions = model_fixtures.left_padded_batch()
  ours = _forward(model, tokens, mask, positions)
  ref = model_fixtures.torch_logits(torch_model, tokens, mask, positions)
  assert ours.dtype == np.float32 and ours.shape == ref.shape == (3, 10, 512)
  diff = np.abs(ours - ref)[mask]  # pad queries attend nothing: their output is arbitrary
  assert diff.max() < 1e-4, diff.max()
  assert np.abs(ref[mask]).max() > 0.1  # logits are not trivially zero


def test_bfloat16_close_to_float32(hf_checkpoint):
  _, directory, _ = hf_checkpoint
  tokens, mask, positions = model_fixtures.left_padded_batch()
  f32 = _forward(load_model(directory)[0], tokens, mask, positions)[mask]
  model_bf16, _, cfg = load_model(directory, dtype="bfloat16")
  assert model_bf16.layers.q[...].dtype == jnp.bfloat16 and cfg.dtype == "bfloat16"
  bf16 = _forward(model_bf16, tokens, mask, positions)[mask]
  assert bf16.dtype == np.float32  # logits stay f32
  rel = np.abs(bf16 - f32).max() / np.abs(f32).max()
  assert 0 < rel < 0.05, rel
