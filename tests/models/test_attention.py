"""The attention implementations against the readable `xla` reference: forward values and
gradients on padded, packed, grouped-query inputs of odd lengths; decode == full
attention; sharded == unsharded; the platform rule of 'auto'."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fake_devices
import model_fixtures
from hgpo_jax.models import attention, cudnn_check, decoder, init_cache, load_model, sharding
from hgpo_jax.models import config as model_config


_segments = cudnn_check.segments
_inputs = cudnn_check.inputs
_loss_and_grads = cudnn_check.loss_and_grads


def _assert_same(got, want, atol):
  out, grads = got
  want_out, want_grads = want
  np.testing.assert_allclose(np.asarray(out, np.float64), np.asarray(want_out, np.float64),
                             atol=atol)
  for g, h in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(h, np.float64), atol=atol)


def test_segment_mask_matches_loop_reference():
  seg = np.array([[0, 0, 1, 1, 1, 1], [1, 1, 2, 2, 2, 0]], np.int32)
  got = np.asarray(attention.segment_mask(jnp.asarray(seg), jnp.asarray(seg), True))
  want = np.zeros((2, 6, 6), bool)
  for b in range(2):
    for t in range(6):
      for s in range(6):
        want[b, t, s] = s <= t and seg[b, s] == seg[b, t]  # padding is a segment of its own
  np.testing.assert_array_equal(got, want)


def test_xla_equals_a_float64_loop_reference():
  """The reference itself, by rule (1): softmax over keys of the same segment, s <= t."""
  q, k, v, seg, _ = _inputs(11)
  got = np.asarray(attention.attention(q, k, v, seg, impl="xla"))
  qn, kn, vn, segn = (np.asarray(x, np.float64) for x in (q, k, v, seg))
  want = np.zeros_like(got, np.float64)
  for b in range(4):
    for h in range(4):
      for t in range(11):
        keys = [s for s in range(t + 1) if segn[b, s] == segn[b, t]]
        logits = np.array([qn[b, t, h] @ kn[b, s, h // 2] for s in keys]) / 4.0
        p = np.exp(logits - logits.max())
        want[b, t, h] = (p / p.sum()) @ vn[b, keys, h // 2]
  np.testing.assert_allclose(got, want, atol=2e-6)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("t,block", [(37, 8), (16, 16), (9, 512)])
def test_chunked_equals_xla(t, block, causal):
  """Several key blocks with a padded last one, one exact block, one block > T."""
  q, k, v, seg, w = _inputs(t)
  want = _loss_and_grads("xla", q, k, v, seg, w, causal)
  _assert_same(_loss_and_grads("chunked", q, k, v, seg, w, causal, block_kv=block), want, 2e-5)


def test_chunked_equals_xla_in_bfloat16():
  q, k, v, seg, w = _inputs(37, dtype=jnp.bfloat16)
  want = _loss_and_grads("xla", q, k, v, seg, w, True)
  got = _loss_and_grads("chunked", q, k, v, seg, w, True, block_kv=8)
  out, grads = got
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want[0], np.float32),
                             atol=3e-2)
  for g, h in zip(grads, want[1]):
    g, h = np.asarray(g, np.float32), np.asarray(h, np.float32)
    np.testing.assert_allclose(g, h, atol=3e-2 * np.max(np.abs(h)))


@pytest.mark.parametrize("t", [37, 128])
def test_splash_interpret_equals_xla(t):
  """The Pallas TPU kernel in interpret mode (CPU): T padded to 128, GQA, segments."""
  q, k, v, seg, w = _inputs(t)
  want = _loss_and_grads("xla", q, k, v, seg, w, True)
  _assert_same(_loss_and_grads("splash", q, k, v, seg, w, True), want, 2e-5)


def _mesh():
  return sharding.make_mesh(2, 2, 2, devices=fake_devices.take(8))


@pytest.mark.parametrize("impl", ["splash", "chunked"])
def test_sharded_equals_unsharded(impl):
  """Rows over (data, fsdp), heads over tensor: splash runs under shard_map over the
  `jax.set_mesh` mesh; chunked is partitioned by GSPMD."""
  q, k, v, seg, w = _inputs(37)
  want = _loss_and_grads(impl, q, k, v, seg, w, True)
  mesh = _mesh()
  assert attention.splash_specs(mesh, 4, 4, 2) == (("data", "fsdp"), "tensor")
  place = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
  qkv = P(("data", "fsdp"), None, "tensor", None)
  args = (place(q, qkv), place(k, qkv), place(v, qkv), place(seg, P(("data", "fsdp"))),
          place(w, qkv))
  with jax.set_mesh(mesh):
    got = _loss_and_grads(impl, *args, True)
  _assert_same(got, want, 1e-5)


def test_decode_attention_equals_full_attention():
  """A left-padded prefix in the cache (valid slots [start, index)) plus new tokens gives
  the full self-attention's rows for those tokens."""
  t, new = 13, 3
  q, k, v, _, _ = _inputs(t)
  pads = np.array([0, 4, 7, 2])
  seg = jnp.asarray((np.arange(t)[None] >= pads[:, None]).astype(np.int32))
  full = attention.attention(q, k, v, seg, impl="xla")
  cache_len, index = 20, t - new
  k_cache = jnp.zeros((4, 2, cache_len, 16)).at[:, :, :index].set(
      k[:, :index].transpose(0, 2, 1, 3))
  v_cache = jnp.zeros((4, 2, cache_len, 16)).at[:, :, :index].set(
      v[:, :index].transpose(0, 2, 1, 3))
  k_cache = k_cache.at[:, :, index:].set(7.0)  # stale slots must not be read
  got = attention.decode_attention(q[:, index:], k[:, index:], v[:, index:], seg[:, index:],
                                   k_cache, v_cache, cache_start_b=jnp.asarray(pads),
                                   cache_index=jnp.int32(index))
  np.testing.assert_allclose(np.asarray(got), np.asarray(full[:, index:]), atol=2e-6)


def test_bf16_decode_attention_on_tpu_keeps_float32_probabilities(monkeypatch):
  """`attention.wide_probabilities`: TPU targets with bf16 activations only. Forced on
  here (a CPU host), the bf16 decode attention with float32 probabilities agrees with the
  float32 form to bf16 rounding, no worse than the bf16-probability form (the CPU and GPU
  one), and that form's outputs are the ones the flag off gives, bit for bit."""
  assert attention.wide_probabilities(jnp.bfloat16, [_Device("tpu")])
  assert not attention.wide_probabilities(jnp.float32, [_Device("tpu")])
  assert not attention.wide_probabilities(jnp.bfloat16, [_Device("gpu")])
  assert not attention.wide_probabilities(jnp.bfloat16, [_Device("cpu")])
  assert not attention.wide_probabilities(jnp.bfloat16)  # this host's CPUs
  t, new = 13, 3
  q, k, v, _, _ = _inputs(t)
  pads = np.array([0, 4, 7, 2])
  seg = jnp.asarray((np.arange(t)[None] >= pads[:, None]).astype(np.int32))
  index = t - new
  cache = lambda x: jnp.zeros((4, 2, 20, 16)).at[:, :, :index].set(
      x[:, :index].transpose(0, 2, 1, 3))

  def run(dtype):
    c = lambda x: x.astype(dtype)
    return np.asarray(attention.decode_attention(
        c(q[:, index:]), c(k[:, index:]), c(v[:, index:]), seg[:, index:], c(cache(k)),
        c(cache(v)), cache_start_b=jnp.asarray(pads), cache_index=jnp.int32(index)),
        np.float32)

  want = run(jnp.float32)
  narrow = run(jnp.bfloat16)
  monkeypatch.setattr(attention, "wide_probabilities", lambda dtype, target=None: True)
  wide = run(jnp.bfloat16)
  monkeypatch.undo()
  np.testing.assert_array_equal(run(jnp.bfloat16), narrow)
  assert not np.array_equal(wide, narrow)  # the flag reaches the product
  scale = np.abs(want).max()
  assert np.abs(wide - want).max() <= 2 ** -7 * scale
  assert np.abs(wide - want).max() <= np.abs(narrow - want).max()


def test_decode_attention_dispatches_by_name(monkeypatch):
  """`decode_attention(impl=)` runs the kernel registered under the name ("auto" is "xla"
  on CPU, bit-identical to calling the xla kernel); unknown names are clear errors."""
  t, new = 9, 2
  q, k, v, _, _ = _inputs(t)
  seg = jnp.ones((4, new), jnp.int32)
  index = t - new
  k_cache = jnp.zeros((4, 2, 12, 16)).at[:, :, :index].set(k[:, :index].transpose(0, 2, 1, 3))
  v_cache = jnp.zeros((4, 2, 12, 16)).at[:, :, :index].set(v[:, :index].transpose(0, 2, 1, 3))
  args = (q[:, index:], k[:, index:], v[:, index:], seg, k_cache, v_cache)
  kw = dict(cache_start_b=jnp.zeros((4,), jnp.int32), cache_index=jnp.int32(index))
  direct = np.asarray(attention.DECODE_KERNELS["xla"](*args, **kw))
  for impl in ("xla", "auto"):
    np.testing.assert_array_equal(np.asarray(attention.decode_attention(*args, impl=impl, **kw)),
                                  direct)
  calls = []
  monkeypatch.setitem(attention.DECODE_KERNELS, "xla",
                      lambda *a, **k: calls.append(k["cache_index"]) or jnp.zeros(()))
  attention.decode_attention(*args, impl="xla", **kw)
  assert len(calls) == 1 and int(calls[0]) == index
  with pytest.raises(ValueError, match="decode_attention_impl='pallas'"):
    attention.decode_attention(*args, impl="pallas", **kw)
  with pytest.raises(ValueError, match="is not one of attention_names.DECODE_IMPLEMENTATIONS"):
    attention.register_decode_kernel("pallas", lambda *a, **k: None)
  with pytest.raises(ValueError, match="decode_attention_impl='pallas'"):
    model_config.get_preset("tiny").replace(decode_attention_impl="pallas")


def test_cudnn_refuses_float32_with_a_clear_error():
  q, k, v, seg, _ = _inputs(8)
  with pytest.raises(ValueError, match="needs bfloat16"):
    attention.attention(q, k, v, seg, impl="cudnn")


@pytest.mark.parametrize("impl,length", [("cudnn", 38), ("splash", 128)])
@pytest.mark.parametrize("causal", [True, False])
def test_padding_to_the_kernels_length_is_exact(causal, impl, length):
  # what the cudnn (odd T) and splash (T not a multiple of 128) paths do, and the decoder's
  # layer stack once for all layers, run through the reference
  q, k, v, seg, w = _inputs(37)
  assert attention.padded_length(impl, 37) == length
  assert attention.padded_length(impl, length) == length
  assert attention.padded_length("xla", 37) == 37
  padded = attention.pad_to_length(length, seg, q, k, v)
  assert [x.shape[1] for x in padded] == [length] * 4
  assert (padded[0][:, 37:] == attention.PAD_SEGMENT).all()
  assert all(x is y for x, y in zip(attention.pad_to_length(37, seg, q), (seg, q)))
  with pytest.raises(ValueError, match="shorter"):
    attention.pad_to_length(36, seg, q)

  def padded_xla(q, k, v):
    s, q, k, v = attention.pad_to_length(length, seg, q, k, v)
    return attention.attention(q, k, v, s, causal=causal, impl="xla")[:, :37]

  want = _loss_and_grads("xla", q, k, v, seg, w, causal)
  out = jax.jit(padded_xla)(q, k, v)
  grads = jax.jit(jax.grad(lambda q, k, v: jnp.sum(padded_xla(q, k, v) * w),
                           argnums=(0, 1, 2)))(q, k, v)
  _assert_same((out, grads), want, atol=1e-5)


@pytest.mark.skipif(not cudnn_check.has_gpu(),
                    reason="cudnn attention needs a GPU (this process has none)")
@pytest.mark.parametrize("t", cudnn_check.LENGTHS)
def test_cudnn_equals_xla_on_gpu(t):
  # cuDNN's fused kernel is no further from the float32 reference than XLA's own bf16
  # attention on the same inputs (up to 2x, plus half a bf16 ulp of the values' scale),
  # for the output and for every gradient. The accelerator benchmarks run the same check
  # first (cudnn_check.check_if_gpu).
  for name, (cudnn, xla) in cudnn_check.errors(t).items():
    assert cudnn_check.within_bound(cudnn, xla), (name, t, cudnn, xla)
  assert cudnn_check.check((t,)).startswith("cuDNN attention check")


def test_cudnn_check_reports_a_mismatch_in_one_line(monkeypatch):
  """The bound and the error of the GPU check, run on CPU with planted error values."""
  assert cudnn_check.within_bound(0.0139, 0.005) and not cudnn_check.within_bound(0.0141, 0.005)
  fake = {"out": (1e-3, 1e-3), "dq": (0.02, 1e-3), "dk": (1e-3, 1e-3), "dv": (1e-3, 1e-3)}
  monkeypatch.setattr(cudnn_check, "has_gpu", lambda devices=None: True)
  monkeypatch.setattr(cudnn_check, "errors", lambda t: fake)
  with pytest.raises(cudnn_check.CudnnMismatch,
                     match=r"^cuDNN attention disagrees .*: dq at T=37: cuDNN error 0.02 > "
                           r"2 x XLA bf16 error 0.001 \+ 4e-3; dq at T=512"):
    cudnn_check.check()
  with pytest.raises(SystemExit, match="dq at T=37"):
    cudnn_check.check_if_gpu()
  fake["dq"] = (1e-3, 1e-3)
  assert "largest error / bound 0.17" in cudnn_check.check_if_gpu()


def test_cudnn_check_is_a_no_op_without_a_gpu():
  if cudnn_check.has_gpu():
    pytest.skip("this process has a GPU")
  assert cudnn_check.check_if_gpu() is None
  with pytest.raises(RuntimeError, match="needs a GPU"):
    cudnn_check.check()


@dataclasses.dataclass
class _Device:
  platform: str


def test_auto_resolves_by_the_target_devices_platform():
  assert attention.resolve_impl("auto", _mesh()) == "auto"  # CPU: the call's length decides
  assert attention.resolve_impl("auto", [_Device("tpu")]) == "splash"
  assert attention.resolve_impl("auto", [_Device("gpu")]) == "cudnn"
  # cuDNN's fused kernel is bf16/fp16 only: float32 activations on a GPU get the reference.
  assert attention.resolve_impl("auto", [_Device("gpu")], "bfloat16") == "cudnn"
  assert attention.resolve_impl("auto", [_Device("gpu")], "float32") == "xla"
  assert attention.resolve_impl("auto", [_Device("tpu")], "float32") == "splash"
  # CPU: by length (chunked for memory from CPU_CHUNKED_MIN_LENGTH), "auto" without one
  n = attention.CPU_CHUNKED_MIN_LENGTH
  assert attention.resolve_impl("auto", _mesh(), length=n - 1) == "xla"
  assert attention.resolve_impl("auto", _mesh(), length=n) == "chunked"
  assert attention.resolve_impl("auto", [_Device("tpu")], length=n) == "splash"
  assert attention.resolve_impl("chunked", [_Device("tpu")]) == "chunked"
  with jax.set_mesh(_mesh()):
    assert attention.resolve_impl("auto", attention.context_target(), length=8) == "xla"
  with pytest.raises(ValueError, match="attention_impl='flash'"):
    attention.resolve_impl("flash", _mesh())
  with pytest.raises(ValueError, match="attention_impl"):
    model_config.get_preset("tiny").replace(attention_impl="flash")


def test_cpu_auto_runs_chunked_from_the_length_threshold(monkeypatch):
  """The decoder's 'auto' on CPU gives chunked's exact values from CPU_CHUNKED_MIN_LENGTH
  tokens (threshold lowered to 16 here) and xla's below it."""
  model = decoder.Decoder(model_config.get_preset("tiny"), rngs=nnx.Rngs(0))
  monkeypatch.setattr(attention, "CPU_CHUNKED_MIN_LENGTH", 16)

  def hidden(impl, length):
    model.cfg = model.cfg.replace(attention_impl=impl)
    tokens = jax.random.randint(jax.random.key(length), (2, length), 0, 512)
    positions = jnp.broadcast_to(jnp.arange(length), tokens.shape)
    out, _ = jax.jit(lambda t, p: model.hidden(t, p, jnp.ones_like(t)))(tokens, positions)
    return np.asarray(out)
  np.testing.assert_array_equal(hidden("auto", 24), hidden("chunked", 24))
  np.testing.assert_array_equal(hidden("auto", 12), hidden("xla", 12))
  assert not np.array_equal(hidden("chunked", 24), hidden("xla", 24))  # the choice shows


def _nll(tokens, seg, positions):
  scored = (seg[:, :-1] > 0) & (seg[:, 1:] == seg[:, :-1])

  def loss(m):
    logits, _ = m(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(seg))
    logp = jax.nn.log_softmax(logits[:, :-1])
    nll = -jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
    return jnp.sum(nll * scored) / scored.sum()
  return loss


@pytest.mark.parametrize("impl", ["chunked", "splash"])
def test_decoder_loss_and_gradients_equal_xla(impl):
  """The tiny model end to end on left-padded and packed rows: same loss and gradients."""
  model = load_model("tiny", seed=3)[0]
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=8, length=11)
  seg = mask.astype(np.int32)
  seg[0, 6:] = 2  # row 0 packs two sequences; the second restarts its positions at 0
  positions[0, 6:] = np.arange(5)
  loss = _nll(tokens, seg, positions)
  grad_fn = jax.jit(nnx.value_and_grad(loss))
  value, grads = grad_fn(model)
  other = nnx.merge(*nnx.split(model))
  other.cfg = model.cfg.replace(attention_impl=impl)
  other_value, other_grads = grad_fn(other)
  np.testing.assert_allclose(float(other_value), float(value), rtol=1e-6)
  for g, h in zip(jax.tree.leaves(grads), jax.tree.leaves(other_grads)):
    np.testing.assert_allclose(np.asarray(h), np.asarray(g), atol=2e-6)


def test_a_splash_prefill_pads_the_layer_stack_once_and_equals_xla():
  """Prefill of 11 tokens into a cache of exactly 11 slots (as the sampler makes it): the
  splash stack runs on 128 positions, padded once before the layers (no pad in the layer
  loop), and writes the xla prefill's hidden states and keys/values."""
  model = load_model("tiny", seed=3)[0]
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=9, batch=4, length=11,
                                                             pads=(0, 3, 7, 1))
  cache = init_cache(model.cfg, 4, 11)
  prefill = jax.jit(lambda m, t, p, s, c: m.prefill(t, p, s, c))
  want_hidden, want_cache = prefill(model, tokens, positions, mask, cache)
  splash = nnx.merge(*nnx.split(model))
  splash.cfg = model.cfg.replace(attention_impl="splash")
  jaxpr = jax.make_jaxpr(lambda t, p, s, c: splash.prefill(t, p, s, c))(
      tokens, positions, mask, cache)
  scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
  assert len(scans) == 1
  assert "pad" not in str(scans[0].params["jaxpr"])  # the layers take 128 positions as they are
  assert "128" in str(scans[0].params["jaxpr"].in_avals)
  hidden, got_cache = prefill(splash, tokens, positions, mask, cache)
  assert hidden.shape == want_hidden.shape and got_cache.k.shape == cache.k.shape
  np.testing.assert_allclose(np.asarray(hidden)[mask], np.asarray(want_hidden)[mask], atol=2e-5)
  for got, want in ((got_cache.k, want_cache.k), (got_cache.v, want_cache.v)):
    real = np.broadcast_to(mask[None, :, None, :, None], got.shape)
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


@pytest.mark.tpu_compile
def test_decoder_lowers_to_the_splash_kernel_for_tpu_devices_from_a_cpu_host():
  """'auto' on a mesh of TPU topology devices (libtpu, no TPU) picks splash; under
  `jax.set_mesh` the kernel is a Mosaic TPU custom call inside a shard_map, not interpret
  mode; the model is built under nnx.eval_shape and lowered from ShapeDtypeStructs."""
  from hgpo_jax.cost import targets
  reason = targets.libtpu_available()
  if reason is not None:
    pytest.skip(reason)
  mesh = sharding.make_mesh(2, 2, 2, devices=targets.devices(targets.resolve("v5e-8")))
  impl = attention.resolve_impl("auto", mesh)
  assert impl == "splash"
  cfg = model_config.get_preset("tiny").replace(dtype="bfloat16", remat=True, attention_impl=impl)
  with jax.set_mesh(mesh):
    graphdef, state = nnx.split(nnx.eval_shape(lambda: decoder.Decoder(cfg, rngs=nnx.Rngs(0))))
  shardings = sharding.param_shardings(state, mesh)
  state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                       state, shardings)
  rows = jax.ShapeDtypeStruct((8, 200), jnp.int32,
                              sharding=NamedSharding(mesh, P(("data", "fsdp"), None)))

  def loss(state, tokens, segment_ids):
    hidden, _ = nnx.merge(graphdef, state).hidden(tokens, tokens, segment_ids)
    return jnp.mean(jnp.square(hidden.astype(jnp.float32)))
  with jax.set_mesh(mesh):
    text = jax.jit(jax.grad(loss)).lower(state, rows, rows).as_text()
  assert "tpu_custom_call" in text  # the Mosaic kernel, compiled for the TPU
  assert "manual_computation" in text  # inside the shard_map over the mesh


def test_traced_on_a_mesh_the_decoder_shard_maps_splash_and_equals_xla():
  """`attention.traced_on(mesh, f)` (the Learner's, critic's and sampler's jits) puts the
  mesh in context inside the trace: the decoder's splash kernel runs under shard_map on
  rows split over 8 fake devices and gives the unsharded xla hidden states."""
  model = load_model("tiny", seed=3)[0]
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=9, batch=4, length=11,
                                                             pads=(0, 3, 7, 1))
  hidden = lambda m, t, p, s: m.hidden(t, p, s)[0]
  want = jax.jit(hidden)(model, tokens, positions, mask)
  mesh = _mesh()
  splash = nnx.merge(*nnx.split(model))
  splash.cfg = model.cfg.replace(attention_impl="splash")
  rows = NamedSharding(mesh, P(("data", "fsdp"), None))
  args = [jax.device_put(x, rows) for x in (tokens, positions, mask)]
  fn = jax.jit(attention.traced_on(mesh, hidden))
  assert "manual_computation" in fn.lower(splash, *args).as_text()
  got = fn(splash, *args)
  np.testing.assert_allclose(np.asarray(got)[mask], np.asarray(want)[mask], atol=2e-5)
