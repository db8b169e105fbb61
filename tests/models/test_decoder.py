"""Decoder invariants on the tiny preset: padding, KV cache == no cache, RoPE layouts."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model_fixtures
from hgpo_jax.models import Decoder, get_preset, init_cache, load_model
from hgpo_jax.models.rope import apply_rope, rope_angles, rope_rotation


@pytest.fixture(scope="module")
def tiny():
  model, tokenizer, cfg = load_model("tiny", seed=3)
  return model, tokenizer, cfg


_forward = jax.jit(lambda m, t, p, a: m(t, p, a)[0])


def test_left_padding_does_not_change_real_tokens(tiny):
  model, _, _ = tiny
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=1)
  padded = np.asarray(_forward(model, tokens, positions, jnp.asarray(mask)))
  for row in range(tokens.shape[0]):
    real = tokens[row][mask[row]][None]
    n = real.shape[1]
    alone = np.asarray(_forward(model, real, np.arange(n)[None], jnp.ones((1, n), bool)))
    np.testing.assert_allclose(padded[row][mask[row]], alone[0], atol=1e-5)


def test_kv_cache_decoding_equals_full_forward(tiny):
  model, _, cfg = tiny
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=2, length=12, pads=(0, 2, 5))
  full = np.asarray(_forward(model, tokens, positions, jnp.asarray(mask)))
  batch, length, cache_len, prefill = tokens.shape[0], tokens.shape[1], 16, 6
  # Slot s holds token s; a row's earlier real tokens are the slots [index - position, index).
  step = jax.jit(lambda m, toks, pos, seg, cache, index: m.decode(toks, pos, cache, index, seg))

  cache = init_cache(cfg, batch, cache_len)
  assert cache.k.shape == (2, batch, 2, cache_len, 16) and cache.k.dtype == jnp.float32
  logits, cache = step(model, tokens[:, :prefill], positions[:, :prefill], mask[:, :prefill],
                       cache, jnp.int32(0))
  outs = [np.asarray(logits)]
  for i in range(prefill, length):  # index is traced: one compilation for all steps
    logits, cache = step(model, tokens[:, i:i + 1], positions[:, i:i + 1], mask[:, i:i + 1],
                         cache, jnp.int32(i))
    outs.append(np.asarray(logits))
  cached = np.concatenate(outs, axis=1)
  np.testing.assert_allclose(cached[mask], full[mask], atol=1e-5)
  assert step._cache_size() == 2  # prefill shape + decode shape


def test_hidden_and_logits_compose(tiny):
  model, _, cfg = tiny
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=4)
  attn = jnp.asarray(mask)
  hidden, cache = model.hidden(jnp.asarray(tokens), jnp.asarray(positions), attn)
  assert hidden.shape == (3, 10, cfg.hidden_dim) and cache is None
  np.testing.assert_allclose(np.asarray(model.logits(hidden)),
                             np.asarray(_forward(model, tokens, positions, attn)), atol=1e-6)
  # Final RMSNorm with unit scale: every real hidden row has mean square 1.
  np.testing.assert_allclose(np.mean(np.asarray(hidden) ** 2, -1), 1.0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_by_a_product_keeps_every_bit(dtype):
  """`apply_rope(rotate_by_product=True)` (TPU targets, layout "half") takes each lane's
  partner from one full-precision product with the signed permutation `rope_rotation` and
  computes x cos + rot(x) sin over whole lanes: the same values as the halves' form, bit
  for bit on XLA:CPU, jitted and not, with magnitudes from 1e-30 to 1e30 (Qwen2.5's
  Dh = 128 and rope theta, positions up to 4095). The interleaved layout keeps its form."""
  rng = np.random.default_rng(4)
  x = rng.standard_normal((2, 6, 3, 128)) * 10.0 ** rng.integers(-30, 31, (2, 6, 3, 128))
  x = jnp.asarray(x, dtype)
  pos = jnp.array([[0, 1, 2, 3, 4, 5], [4090, 4091, 4092, 4093, 4094, 4095]])
  cos, sin = rope_angles(pos, 128, 1e6)
  lanes = np.arange(8, dtype=np.float32)
  np.testing.assert_array_equal(lanes @ rope_rotation(8), [-4, -5, -6, -7, 0, 1, 2, 3])
  for fn in (apply_rope, jax.jit(apply_rope, static_argnums=(3, 4))):
    want = np.asarray(fn(x, cos, sin, "half", False).astype(jnp.float32))
    got = np.asarray(fn(x, cos, sin, "half", True).astype(jnp.float32))
    np.testing.assert_array_equal(got, want)
  np.testing.assert_array_equal(apply_rope(x, cos, sin, "interleaved", True),
                                apply_rope(x, cos, sin, "interleaved", False))


def test_interleaved_rope_equals_half_rope_on_permuted_dims():
  """GGUF (interleaved) and HF (rotate-half) RoPE are one rotation up to a fixed permutation
  of the head dimension: half-layout dim j <-> interleaved dim 2j (j < Dh/2), 2(j-Dh/2)+1."""
  dh = 8
  x = jax.random.normal(jax.random.key(0), (2, 5, 3, dh))
  pos = jnp.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
  cos, sin = rope_angles(pos, dh, 10000.0)
  perm = np.concatenate([np.arange(0, dh, 2), np.arange(1, dh, 2)])  # interleaved -> half
  half = apply_rope(x[..., perm], cos, sin, "half")
  inter = apply_rope(x, cos, sin, "interleaved")
  np.testing.assert_allclose(np.asarray(inter[..., perm]), np.asarray(half), atol=1e-6)
  # Rotation: norms of pairs are preserved; position 0 is the identity.
  np.testing.assert_allclose(np.linalg.norm(inter, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(inter[0, 0]), np.asarray(x[0, 0]), atol=1e-6)


def test_init_is_seeded_and_params_carry_logical_axes():
  cfg = get_preset("tiny")
  a = Decoder(cfg, rngs=nnx.Rngs(params=7))
  b = Decoder(cfg, rngs=nnx.Rngs(params=7))
  np.testing.assert_array_equal(np.asarray(a.layers.q[...]), np.asarray(b.layers.q[...]))
  assert a.layers.q.get_metadata()["logical_axes"] == ("layers", "heads", "head_dim", "embed")
  assert a.embed.get_metadata()["logical_axes"] == ("vocab", "embed")
  n_params = sum(x.size for x in jax.tree.leaves(nnx.state(a, nnx.Param)))
  d, f, v, n = 64, 128, 512, 2
  assert n_params == v * d + d + n * (2 * d + d * 64 + 2 * d * 32 + 64 * d + 3 * d * f)


def test_remat_gives_same_loss_and_gradients(tiny):
  model, _, cfg = tiny
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=5)
  attn = jnp.asarray(mask)

  def loss(m):
    logits, _ = m(jnp.asarray(tokens), jnp.asarray(positions), attn)
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * mask[:, 1:]) / mask[:, 1:].sum()

  grad_fn = jax.jit(nnx.value_and_grad(loss))
  value, grads = grad_fn(model)
  remat_model = nnx.merge(*nnx.split(model))
  remat_model.cfg = cfg.replace(remat=True)
  remat_value, remat_grads = grad_fn(remat_model)
  np.testing.assert_allclose(float(remat_value), float(value), rtol=1e-6)
  assert 5.0 < float(value) < 7.5  # ~log(512) = 6.24 for a random init
  for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(remat_grads)):
    np.testing.assert_allclose(np.asarray(h), np.asarray(g), atol=1e-6)


def _nll_loss(tokens, mask, positions):
  """Mean NLL of the real tokens predicted from real positions of a padded batch (pad
  positions read padding only; their outputs are arbitrary), as a function of the model."""
  attn = jnp.asarray(mask)
  scored = mask[:, :-1] & mask[:, 1:]

  def loss(m):
    logits, _ = m(jnp.asarray(tokens), jnp.asarray(positions), attn)
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    nll = -jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * scored) / scored.sum()
  return loss


def _with_cfg(model, **changes):
  """The same parameters under another config (compute dtype, remat, chunking)."""
  other = nnx.merge(*nnx.split(model))
  other.cfg = model.cfg.replace(**changes)
  return other


@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_query_chunks_give_the_unchunked_values_and_gradients(tiny, chunk):
  """Causal block skipping (queries [s, s+c) read keys [0, s+c) only) is the same function:
  every skipped key was masked. Equal up to float reordering of the softmax sums, with
  left padding (pad queries read padding only) and chunks that do not divide T."""
  model, _, _ = tiny
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=6)
  assert tokens.shape[1] % 4 and tokens.shape[1] > 7
  loss = _nll_loss(tokens, mask, positions)
  grad_fn = jax.jit(nnx.value_and_grad(loss))
  value, grads = grad_fn(model)
  chunked_value, chunked_grads = grad_fn(_with_cfg(model, attn_query_chunk=chunk, remat=True))
  np.testing.assert_allclose(float(chunked_value), float(value), rtol=1e-6)
  for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(chunked_grads)):
    np.testing.assert_allclose(np.asarray(h), np.asarray(g), atol=2e-6)


def _attention_reference(q, k, v, mask, scale):
  """The plain attention in float64 numpy loops over heads (readable reference)."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  b, t, kv, g, d = q.shape
  out = np.zeros((b, kv, g, t, d))
  for bi in range(b):
    for h in range(kv):
      for gi in range(g):
        s = q[bi, :, h, gi] @ k[bi, h].T * scale
        s = np.where(mask[bi], s, -np.inf)
        s = s - np.max(np.where(np.isfinite(s), s, -1e300), axis=-1, keepdims=True)
        p = np.where(mask[bi], np.exp(s), 0.0)
        p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
        out[bi, h, gi] = p @ v[bi, h]
  return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_with_bf16_backward_equals_autodiff_of_the_reference(dtype):
  """`attention_bf16` (hand-written backward, products with bf16 operands) against
  float64 autodiff of the same softmax attention on the same (rounded) inputs: f32
  operands agree to f32 round-off, bf16 ones to a few bf16 ulps of the largest gradient."""
  from hgpo_jax.models.attention import attention_bf16, segment_mask
  rng = np.random.default_rng(0)
  b, t, kv, g, d = 2, 9, 2, 3, 8
  dt = jnp.dtype(dtype)
  q, k, v = (jnp.asarray(rng.standard_normal(s), dt) for s in
             ((b, t, kv, g, d), (b, kv, t, d), (b, kv, t, d)))
  input_mask = np.ones((b, t), bool)
  input_mask[0, :3] = False  # left padding: three pad queries see no key
  seg = jnp.asarray(input_mask, jnp.int32)
  mask = segment_mask(seg, seg, True) & jnp.asarray(input_mask)[:, None, :]
  w = rng.standard_normal((b, kv, g, t, d)) * input_mask[:, None, None, :, None]
  scale = d ** -0.5
  want = _attention_reference(q, k, v, np.asarray(mask), scale)
  got = jax.jit(attention_bf16, static_argnums=(4,))(q, k, v, mask, scale)
  real = input_mask[:, None, None, :, None]
  tol = dict(float32=2e-6, bfloat16=2e-2)[dtype]  # bf16: 2^-8 relative per operand rounding
  np.testing.assert_allclose(np.asarray(got, np.float64) * real, want * real, atol=tol)

  with jax.enable_x64():
    def reference_loss(q, k, v):
      s = jnp.einsum("btkgd,bksd->bkgts", q, k) * scale
      p = jax.nn.softmax(jnp.where(np.asarray(mask)[:, None, None], s, -1e30), axis=-1)
      return jnp.sum(jnp.einsum("bkgts,bksd->bkgtd", p, v) * w)
    want_grads = jax.grad(reference_loss, argnums=(0, 1, 2))(
        *(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)))
    want_grads = [np.asarray(x) for x in want_grads]
  loss = lambda q, k, v: jnp.sum(attention_bf16(q, k, v, mask, scale).astype(jnp.float32) * w)
  got_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
  for got_g, want_g in zip(got_grads, want_grads):
    assert got_g.dtype == dt
    scale_g = np.max(np.abs(want_g))
    np.testing.assert_allclose(np.asarray(got_g, np.float64), want_g, atol=tol * scale_g)


def test_bf16_compute_over_f32_weights_tracks_f32_and_keeps_f32_gradients(tiny):
  """Mixed precision (`compute_dtype` bfloat16, float32 parameters): the loss and its
  gradient follow the float32 model within bf16 rounding, and the gradient of the float32
  weights stays float32."""
  model, _, cfg = tiny
  assert cfg.param_dtype == "float32"
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=7)
  grad_fn = jax.jit(nnx.value_and_grad(_nll_loss(tokens, mask, positions)))
  value, grads = grad_fn(model)
  mixed = _with_cfg(model, dtype="bfloat16", remat=True, attn_query_chunk=4)
  mixed_value, mixed_grads = grad_fn(mixed)
  np.testing.assert_allclose(float(mixed_value), float(value), rtol=1e-2)
  flat, mixed_flat = jax.tree.leaves(grads), jax.tree.leaves(mixed_grads)
  for g, h in zip(flat, mixed_flat):
    assert h.dtype == jnp.float32
  g = np.concatenate([np.ravel(x) for x in flat])
  h = np.concatenate([np.ravel(x) for x in mixed_flat])
  cosine = float(g @ h / np.linalg.norm(g) / np.linalg.norm(h))
  assert cosine > 0.99, cosine
