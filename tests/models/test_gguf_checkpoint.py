"""A tiny model written both as a HF directory and as GGUF loads to the same tokenizer and
logits: covers llama.cpp's q/k permutation (interleaved RoPE), tied/untied output, biases, Qwen3's
q/k norms; RoPE scaling in a GGUF is refused."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

import model_fixtures
from hgpo_jax.models import load_model
from hgpo_jax.models.tokenizer import tiny_tokenizer

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
  """Rows of each head from rotate-half order (i, i + Dh/2) to adjacent pairs (2i, 2i+1)."""
  rows = w.shape[0]
  return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: str, hf_dir: str, arch: str, rope_freqs: bool = False):
  import gguf
  with open(os.path.join(hf_dir, "config.json")) as f:
    hf = json.load(f)
  tensors = {}
  for name in os.listdir(hf_dir):
    if name.endswith(".safetensors"):
      tensors.update(load_file(os.path.join(hf_dir, name)))
  writer = gguf.GGUFWriter(path, arch)
  writer.add_block_count(hf["num_hidden_layers"])
  writer.add_context_length(hf["max_position_embeddings"])
  writer.add_embedding_length(hf["hidden_size"])
  writer.add_feed_forward_length(hf["intermediate_size"])
  writer.add_head_count(hf["num_attention_heads"])
  writer.add_head_count_kv(hf["num_key_value_heads"])
  head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_freq_base(10000.0)
  writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
  tok = tiny_tokenizer()
  backend = json.loads(tok.backend.to_str())
  vocab = sorted(backend["model"]["vocab"], key=backend["model"]["vocab"].get)
  merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
  writer.add_tokenizer_model("gpt2")
  writer.add_tokenizer_pre("smollm")
  writer.add_token_list(vocab)
  writer.add_token_merges(merges)
  writer.add_token_types([3 if t.startswith("<|") else 1 for t in vocab])
  writer.add_eos_token_id(2)
  writer.add_pad_token_id(0)
  for hf_name, w in tensors.items():
    if hf_name == "lm_head.weight" and hf.get("tie_word_embeddings"):
      continue
    parts = hf_name.split(".")
    if parts[1] == "layers":
      name = f"blk.{parts[2]}." + _HF_TO_GGUF[".".join(parts[3:])]
    else:
      name = _HF_TO_GGUF[hf_name]
    if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
      heads = hf["num_attention_heads"] if "attn_q" in name else hf["num_key_value_heads"]
      w = _llama_cpp_permute(w, heads)
    writer.add_tensor(name, np.ascontiguousarray(w, np.float32))
  if rope_freqs:  # llama.cpp's form of Llama 3's RoPE scaling: per-frequency divisors
    writer.add_tensor("rope_freqs.weight", np.ones(head_dim // 2, np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_and_hf_directory_agree(arch, tmp_path):
  hf_dir = str(tmp_path / "hf")
  model_fixtures.write_hf_dir(hf_dir, arch, seed=5)
  gguf_path = str(tmp_path / "tiny.gguf")
  _write_gguf(gguf_path, hf_dir, arch)

  hf_model, hf_tok, hf_cfg = load_model(hf_dir)
  gguf_model, gguf_tok, gguf_cfg = load_model(gguf_path)
  assert gguf_cfg.rope_layout == ("interleaved" if arch == "llama" else "half")
  assert hf_cfg.rope_layout == "half"
  assert gguf_cfg.qk_norm == (arch == "qwen3")
  for field in ("num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "qkv_bias",
                "qk_norm", "tie_embeddings", "vocab_size"):
    assert getattr(gguf_cfg, field) == getattr(hf_cfg, field), field

  text = "<|im_start|>user\nOpen the fridge 1, café 東京 1234 🙂<|im_end|>\n"
  assert gguf_tok.encode(text) == hf_tok.encode(text) == tiny_tokenizer().encode(text)
  assert gguf_tok.eos_ids[0] == hf_tok.eos_ids[0] == 2 and gguf_tok.pad_id == 0

  tokens, mask, positions = model_fixtures.left_padded_batch(seed=6)
  fwd = jax.jit(lambda m, t, p, a: m(t, p, a)[0])
  args = (jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))
  want = np.asarray(fwd(hf_model, *args))
  got = np.asarray(fwd(gguf_model, *args))
  np.testing.assert_allclose(got[mask], want[mask], atol=1e-5)



def test_gguf_rope_scaling_is_refused(tmp_path):
  """llama.cpp writes Llama 3's RoPE scaling as a rope_freqs tensor (and rope.scaling.* keys):
  refused in one line rather than loaded with plain RoPE."""
  hf_dir = str(tmp_path / "hf")
  model_fixtures.write_hf_dir(hf_dir, "llama", seed=5)
  path = str(tmp_path / "scaled.gguf")
  _write_gguf(path, hf_dir, "llama", rope_freqs=True)
  with pytest.raises(ValueError, match=r"RoPE scaling .*rope_freqs tensor\) is not implemented"):
    load_model(path)
