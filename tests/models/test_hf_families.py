"""Hugging Face families (Llama with RoPE scaling, Qwen2, Qwen3) in both config formats:
config.json read against the allow-list and written back, tensors both ways, and logits
equal to transformers' on tiny random checkpoints (prefill and KV-cache decode)."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hgpo_jax.models import config as config_lib
from hgpo_jax.models import weights

# Released checkpoints' config.json as published (the keys that matter for the allow-list).
LLAMA_3_2_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
QWEN2_5_1_5B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 1536,
    "initializer_range": 0.02, "intermediate_size": 8960, "max_position_embeddings": 32768,
    "max_window_layers": 21, "model_type": "qwen2", "num_attention_heads": 12,
    "num_hidden_layers": 28, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.43.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936}
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
    "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_released_configs_read_as_their_presets():
  """Qwen2.5-1.5B and Qwen3-0.6B config.json (transformers 4 format) are their presets;
  Llama-3.2-1B's llama3 RoPE scaling is read, not refused."""
  assert config_lib.config_from_hf(QWEN2_5_1_5B) == config_lib.get_preset("qwen2.5-1.5b")
  assert config_lib.config_from_hf(QWEN3_0_6B) == config_lib.get_preset("qwen3-0.6b")
  llama = config_lib.config_from_hf(LLAMA_3_2_1B)
  assert llama.rope_theta == 500000.0 and llama.head_dim == 64 and llama.tie_embeddings
  assert llama.rope_scaling == (("factor", 32.0), ("high_freq_factor", 4.0),
                                ("low_freq_factor", 1.0),
                                ("original_max_position_embeddings", 8192),
                                ("rope_type", "llama3"))


def _as_transformers5(hf: dict) -> dict:
  """The same config as transformers 5 writes it: rope_theta and the scaling under
  rope_parameters."""
  hf = dict(hf)
  params = dict(hf.pop("rope_scaling", None) or {"rope_type": "default"})
  params["rope_theta"] = hf.pop("rope_theta")
  return {**hf, "rope_parameters": params}


@pytest.mark.parametrize("hf", [LLAMA_3_2_1B, QWEN2_5_1_5B, QWEN3_0_6B])
def test_both_config_formats_read_alike(hf):
  assert config_lib.config_from_hf(_as_transformers5(hf)) == config_lib.config_from_hf(hf)


@pytest.mark.parametrize("name", ["tiny", "qwen2.5-7b", "qwen3-8b", "qwen3-1.7b"])
@pytest.mark.parametrize("scaling", [
    (), (("factor", 4.0), ("rope_type", "linear")),
    (("attention_factor", 1.25), ("beta_fast", 16.0), ("factor", 4.0),
     ("original_max_position_embeddings", 256), ("rope_type", "yarn"), ("truncate", False))])
def test_hf_config_dict_reads_back(name, scaling):
  cfg = config_lib.get_preset(name).replace(rope_scaling=scaling)
  hf = config_lib.hf_config_dict(cfg)
  assert hf["model_type"] == {"tiny": "llama", "qwen2.5-7b": "qwen2"}.get(name, "qwen3")
  assert hf["rope_parameters"]["rope_type"] == (dict(scaling).get("rope_type", "default"))
  assert config_lib.config_from_hf(json.loads(json.dumps(hf))) == cfg


def test_hf_config_dict_is_what_transformers_reads():
  """transformers' own config class reads the written dict to the same RoPE parameters."""
  import transformers
  cfg = config_lib.get_preset("qwen3-0.6b").replace(
      rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 32768),
                    ("rope_type", "yarn")))
  ref = transformers.Qwen3Config(**config_lib.hf_config_dict(cfg))
  assert ref.rope_parameters == {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 32768}
  assert (ref.head_dim, ref.num_key_value_heads, ref.tie_word_embeddings) == (128, 8, True)


@pytest.mark.parametrize("change, named", [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_type='longrope'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "wavelength": 3}}, "rope_scaling.wavelength"),
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding_attention"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"quantization_config": {"bits": 4}}, "'quantization_config'"),
    ({"attention_bias": True}, "attention_bias=True"),
])
def test_not_implemented_keys_are_refused_by_name(change, named):
  base = QWEN3_0_6B if "layer_types" in change or "use_sliding_window" in change else LLAMA_3_2_1B
  with pytest.raises(ValueError, match="not implemented") as e:
    config_lib.config_from_hf({**base, **change})
  assert named in str(e.value) and "\n" not in str(e.value)


def test_llama_biases_and_qwen2_unknown_keys_are_refused():
  for key in ("attention_bias", "mlp_bias"):
    with pytest.raises(ValueError, match=f"{key}=True is not implemented"):
      config_lib.config_from_hf({**LLAMA_3_2_1B, key: True})
  with pytest.raises(ValueError, match="key 'attention_bias' of a qwen2 config"):
    config_lib.config_from_hf({**QWEN2_5_1_5B, "attention_bias": False})
  with pytest.raises(ValueError, match="model_type='mistral'"):
    config_lib.config_from_hf({**LLAMA_3_2_1B, "model_type": "mistral"})


def _random_params(cfg, seed=0):
  """Random Decoder parameters of `cfg` in the Decoder's layout (weights.to_decoder_layout)."""
  rng = np.random.default_rng(seed)
  params = {}
  for kind in ("embed", "final_norm", *(() if cfg.tie_embeddings else ("lm_head",))):
    params[kind] = rng.normal(size=weights.checkpoint_shape(cfg, kind)).astype(np.float32)
  for kind in weights.layer_kinds(cfg):
    params[f"layers/{kind}"] = np.stack([
        weights.to_decoder_layout(cfg, kind, rng.normal(
            size=weights.checkpoint_shape(cfg, kind)).astype(np.float32))
        for _ in range(cfg.num_layers)])
  return params


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_hf_tensors_inverts_assemble_params(family):
  cfg = config_lib.get_preset("tiny").replace(
      qkv_bias=family == "qwen2", qk_norm=family == "qwen3", tie_embeddings=family != "qwen2",
      head_dim=8)
  params = _random_params(cfg)
  tensors = weights.hf_tensors(cfg, params)
  assert ("model.layers.1.self_attn.k_norm.weight" in tensors) == (family == "qwen3")
  assert ("model.layers.0.self_attn.q_proj.bias" in tensors) == (family == "qwen2")
  assert ("lm_head.weight" in tensors) == (family == "qwen2")
  assert tensors["model.layers.1.self_attn.o_proj.weight"].shape == (64, 32)
  np.testing.assert_array_equal(tensors["model.layers.1.self_attn.q_proj.weight"],
                                params["layers/q"][1].reshape(32, 64))
  back = weights.assemble_params(
      cfg, lambda kind, i: (tensors[weights.HF_NAMES[kind].format(i=i)], kind))
  assert back.keys() == params.keys()
  for name in params:
    np.testing.assert_array_equal(back[name], params[name])
  with pytest.raises(ValueError, match="layers/q has shape"):
    weights.hf_tensors(cfg, {**params, "layers/q": params["layers/q"][:1]})
  with pytest.raises(ValueError, match="unexpected"):
    weights.hf_tensors(cfg, {**params, "layers/extra": params["layers/q"]})


@pytest.mark.parametrize("params", [
    {"rope_type": "linear", "factor": 2.5},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
     "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
     "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 2048,
     "attention_factor": 0.9},
])
@pytest.mark.parametrize("head_dim, theta", [(128, 1e6), (64, 500000.0), (16, 10000.0)])
def test_inverse_frequencies_equal_transformers(params, head_dim, theta):
  """`rope.inverse_frequencies` of a config read from `rope_parameters` equals transformers'
  `ROPE_INIT_FUNCTIONS[rope_type]` (inverse frequencies and attention factor)."""
  import transformers
  from transformers import modeling_rope_utils

  from hgpo_jax.models import rope
  hf = transformers.LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                                max_position_embeddings=131072,
                                rope_parameters={**params, "rope_theta": theta})
  want_inv, want_factor = modeling_rope_utils.ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
  cfg = config_lib.config_from_hf(hf.to_dict())
  got_inv, got_factor = rope.inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
  assert got_inv.dtype == np.float32 and got_inv.shape == (head_dim // 2,)
  np.testing.assert_allclose(got_inv, want_inv.numpy(), rtol=2e-6)
  assert got_factor == pytest.approx(want_factor, rel=1e-6)
  plain, one = rope.inverse_frequencies(cfg.head_dim, cfg.rope_theta)
  assert one == 1.0 and np.abs(plain / got_inv - 1).max() > 0.1  # the scaling changes them


def test_written_config_json_loads_in_read_hf_config(tmp_path):
  cfg = config_lib.get_preset("qwen3-4b")
  with open(os.path.join(tmp_path, "config.json"), "w") as f:
    json.dump(config_lib.hf_config_dict(cfg), f)
  assert config_lib.read_hf_config(str(tmp_path)) == cfg


# ------------------------------------------------------- logits against transformers
_COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
               eos_token_id=2, bos_token_id=None, pad_token_id=0)
_LLAMA_SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
             "beta_fast": 16.0},
}
# name -> (transformers config class name, kwargs): GQA everywhere; head_dim != hidden/heads
# on every Qwen3 and on the Llamas (16 = 64/4 there, 24 on the Qwen3s).
_CHECKPOINTS = {
    "qwen3_tied": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=True,
                                       max_position_embeddings=2048, rope_theta=1e6)),
    "qwen3_untied": ("Qwen3Config", dict(head_dim=24, tie_word_embeddings=False,
                                         max_position_embeddings=2048, rope_theta=1e6)),
    # max_position_embeddings = factor x 256 for yarn, as transformers expects of it
    **{f"llama_{kind}": ("LlamaConfig", dict(head_dim=16, tie_word_embeddings=kind != "linear",
                                             max_position_embeddings=1024, rope_theta=10000.0,
                                             rope_parameters={**params, "rope_theta": 10000.0}))
       for kind, params in _LLAMA_SCALINGS.items()},
}


def _to_transformers4_format(directory: str):
  """Rewrites config.json as transformers 4 wrote it: top-level rope_theta, the scaling
  under rope_scaling (null without one; yarn with the legacy `type` key)."""
  path = os.path.join(directory, "config.json")
  with open(path) as f:
    hf = json.load(f)
  params = hf.pop("rope_parameters")
  hf["rope_theta"] = params.pop("rope_theta")
  if params["rope_type"] == "default":
    hf["rope_scaling"] = None
  else:
    if params["rope_type"] == "yarn":
      params["type"] = params.pop("rope_type")
    hf["rope_scaling"] = params
  with open(path, "w") as f:
    json.dump(hf, f)


@pytest.fixture(scope="module", params=sorted(_CHECKPOINTS))
def checkpoint(request, tmp_path_factory):
  """(name, transformers 5 directory, transformers 4 directory, torch model)."""
  import shutil

  import transformers
  import model_fixtures
  name = request.param
  cls, kwargs = _CHECKPOINTS[name]
  new = str(tmp_path_factory.mktemp(f"{name}_v5"))
  torch_model = model_fixtures.write_hf_model(new, getattr(transformers, cls)(**_COMMON, **kwargs),
                                              qk_scale=8.0)
  old = str(tmp_path_factory.mktemp(f"{name}_v4"))
  shutil.copytree(new, old, dirs_exist_ok=True)
  _to_transformers4_format(old)
  return name, new, old, torch_model


def test_checkpoint_configs_read_in_both_formats(checkpoint):
  name, new, old, _ = checkpoint
  with open(os.path.join(new, "config.json")) as f:
    assert "rope_parameters" in json.load(f)  # what transformers 5.23 writes
  cfg = config_lib.read_hf_config(new)
  assert config_lib.read_hf_config(old) == cfg
  assert cfg.qk_norm == name.startswith("qwen3") and not cfg.qkv_bias
  assert cfg.rope_type == name.split("_")[1] if name.startswith("llama") else "default"
  assert cfg.head_dim == (24 if cfg.qk_norm else 16)


def _positions(name: str, length: int):
  """Positions of the compared tokens: past the 256 original positions for the scaled
  Llamas (1000, 1001, ...); from 0 for the Qwen3s."""
  return np.arange(length, dtype=np.int32) + (1000 if name.startswith("llama") else 0)


def test_logits_equal_transformers(checkpoint):
  """Both formats load to logits equal to transformers' on a left-padded batch (Qwen3) or
  at positions 1000-1015, beyond the original 256 (the RoPE scalings)."""
  import model_fixtures
  from hgpo_jax.models import load_model
  name, new, old, torch_model = checkpoint
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=5, length=16, pads=(0, 3, 7))
  if name.startswith("llama"):
    mask[:] = True
    positions = np.broadcast_to(_positions(name, 16), tokens.shape).copy()
  ref = model_fixtures.torch_logits(torch_model, tokens, mask, positions)
  fwd = jax.jit(lambda m, t, p, a: m(t, p, a)[0])
  for directory in (new, old):
    model, _, _ = load_model(directory)
    ours = np.asarray(fwd(model, tokens, positions, mask))
    scale = np.abs(ref[mask]).max()
    assert scale > 0.1
    assert np.abs(ours - ref)[mask].max() < 1e-4 * max(scale, 1.0), name
  if name.startswith("llama"):  # the scaling matters at these positions
    model.cfg = model.cfg.replace(rope_scaling=())
    plain = np.asarray(fwd(model, tokens, positions, mask))
    assert np.abs(plain - ref)[mask].max() > 1e-2 * scale, (name, np.abs(plain - ref).max())


def test_kv_cache_decode_equals_full_forward(checkpoint):
  """A prefill of 1004 tokens and 12 one-token decode steps give the full forward's logits
  of positions 1004-1015 (past the original 256 positions of the scaled Llamas), and the
  full forward equals transformers' on all 1016."""
  import model_fixtures
  from hgpo_jax.models import init_cache, load_model
  name, new, _, torch_model = checkpoint
  model, _, cfg = load_model(new)
  length, prefill = 1016, 1004
  tokens = np.random.default_rng(6).integers(3, 512, size=(2, length)).astype(np.int32)
  positions = np.broadcast_to(np.arange(length, dtype=np.int32), tokens.shape)
  mask = np.ones(tokens.shape, bool)
  full = np.asarray(jax.jit(lambda m, t, p, a: m(t, p, a)[0])(model, tokens, positions, mask))
  ref = model_fixtures.torch_logits(torch_model, tokens, mask, positions)
  assert np.abs(full - ref).max() < 1e-4 * max(np.abs(ref).max(), 1.0), name
  step = jax.jit(lambda m, toks, pos, cache, index: m.decode(toks, pos, cache, index))
  cache = init_cache(cfg, 2, 1024)
  _, cache = step(model, tokens[:, :prefill], positions[:, :prefill], cache, jnp.int32(0))
  outs = []
  for i in range(prefill, length):
    logits, cache = step(model, tokens[:, i:i + 1], positions[:, i:i + 1], cache, jnp.int32(i))
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(outs, axis=1), full[:, prefill:], atol=1e-4)


def _qwen3_tiny():
  return config_lib.get_preset("tiny").replace(qk_norm=True, head_dim=24)


def test_qwen3_per_layer_decode_weights_and_sharding(monkeypatch):
  """Qwen3's q/k norm scales [L, Dh] carry ("layers", "head_dim") (replicated on every mesh)
  and travel with `for_decoding`'s per-layer weights (GPU and TPU targets, forced here):
  the decode step's logits and cache equal the stacked model's."""
  import fake_devices
  from flax import nnx

  from hgpo_jax.models import decoder, sharding
  cfg = _qwen3_tiny()
  model = decoder.Decoder(cfg, rngs=nnx.Rngs(2))
  model.layers.q_norm[...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(3), (2, 24))
  assert model.layers.k_norm.get_metadata()["logical_axes"] == ("layers", "head_dim")
  mesh = sharding.make_mesh(data=1, fsdp=2, tensor=2, devices=fake_devices.take(4))
  shardings = sharding.param_shardings(model, mesh)
  assert shardings["layers"]["q_norm"].get_value().spec == jax.sharding.PartitionSpec(None, None)
  cache = decoder.init_cache(cfg, 2, 8, jnp.float32)
  cache = decoder.KVCache(k=jax.random.normal(jax.random.key(0), cache.k.shape),
                          v=jax.random.normal(jax.random.key(1), cache.v.shape))
  tokens, positions = jnp.array([[3], [7]]), jnp.array([[4], [2]])
  want = jax.jit(lambda m, c: m.for_decoding().decode(tokens, positions, c, 4))(model, cache)
  monkeypatch.setattr(decoder, "per_layer_decode_weights", lambda cfg, target: True)
  view = model.for_decoding()
  names = set(view.layers.unstacked()[0])
  assert {"q_norm", "k_norm", "qkv"} <= names, names
  np.testing.assert_array_equal(np.asarray(view.layers.stacked()["q_norm"]),
                                np.asarray(model.layers.q_norm[...]))
  got = jax.jit(lambda m, c: m.for_decoding().decode(tokens, positions, c, 4))(model, cache)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1].k), np.asarray(want[1].k), rtol=1e-6, atol=1e-6)
  # The norms matter: unit scales give other logits.
  model.layers.q_norm[...] = jnp.ones((2, 24))
  other = jax.jit(lambda m, c: m.for_decoding().decode(tokens, positions, c, 4))(model, cache)
  assert np.abs(np.asarray(other[0]) - np.asarray(want[0])).max() > 1e-3


def test_launch_plan_lowers_every_program_of_a_qwen3_preset(capsys):
  """`launch.plan --no-compile` of a Qwen3 preset lowers the run's programs (update,
  log-probs, advantages, both generates) and counts its persistent bytes: float32
  parameters, AdamW's two moments and the KL reference, 4 x the parameters' bytes (q/k
  norm scales included) on each device of a data-parallel mesh."""
  from flax import nnx

  from hgpo_jax.models import decoder
  from launch import plan as plan_cli
  if jax.device_count() != 8:
    pytest.skip("the CLI is run in-process with the suite's 8 fake devices")
  cfg = config_lib.get_preset("qwen3-0.6b")
  abstract = nnx.eval_shape(lambda: decoder.Decoder(cfg, rngs=nnx.Rngs(0)))
  params = sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert params == 596049920  # Qwen3-0.6B, tied (28 x 2 x 128 of them q/k norm scales)
  rc = plan_cli.main(["--config=configs/alfworld.py:algo=hgpo,model=qwen3-0.6b", "--devices",
                      "8", "--no-compile"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "update, logprobs, advantages, generate, generate_shared" in out
  assert f"persistent {4 * 4 * params / 2 ** 30:.2f} GiB per device" in out, out


def test_a_qwen3_critic_reads_the_policy_backbone_with_its_q_k_norms():
  """The value model of a Qwen3 policy copies its q/k norm scales with the backbone, and its
  values are the head on the policy's hidden states of the previous positions."""
  from flax import nnx

  from hgpo_jax.models import critic, decoder
  cfg = _qwen3_tiny().replace(num_layers=1, vocab_size=64, tie_embeddings=False)
  policy = decoder.Decoder(cfg, rngs=nnx.Rngs(0))
  policy.layers.k_norm[...] = 1.0 + 0.3 * jax.random.normal(jax.random.key(4), (1, 24))
  params = critic.params_from_policy(nnx.state(policy, nnx.Param), cfg, 1, seed=1)
  np.testing.assert_array_equal(params["backbone"]["layers"]["k_norm"],
                                np.asarray(policy.layers.k_norm[...]))
  graphdef, _ = nnx.split(critic.abstract_critic(cfg, 1), nnx.Param)
  model = nnx.merge(graphdef, params)
  tokens = np.array([[5, 6, 7, 8, 9]], np.int32)
  positions, mask = np.arange(5, dtype=np.int32)[None], np.ones((1, 5), bool)
  values = np.asarray(model.values(tokens, positions, mask))[0, :, 0]
  hidden = np.asarray(policy.hidden(tokens, positions, mask)[0], np.float64)[0]
  want = hidden @ np.asarray(params["value_head"], np.float64)[0]
  np.testing.assert_allclose(values[1:], want[:-1], rtol=1e-5, atol=1e-6)


def test_rope_scaling_field_and_hf_config_dict_refuse_what_they_cannot_express():
  tiny = config_lib.get_preset("tiny")
  with pytest.raises(ValueError, match="rope_type='dynamic'"):
    tiny.replace(rope_scaling=(("factor", 2.0), ("rope_type", "dynamic")))
  with pytest.raises(ValueError, match="'beta_fast' is not a field of rope_type 'llama3'"):
    tiny.replace(rope_scaling=(("beta_fast", 2.0), ("factor", 2.0), ("high_freq_factor", 4.0),
                               ("low_freq_factor", 1.0),
                               ("original_max_position_embeddings", 64), ("rope_type", "llama3")))
  with pytest.raises(ValueError, match="rope_type 'yarn' needs 'original_max_position_embeddings'"):
    tiny.replace(rope_scaling=(("factor", 2.0), ("rope_type", "yarn")))
  with pytest.raises(ValueError, match="sorted"):
    tiny.replace(rope_scaling=(("rope_type", "linear"), ("factor", 2.0)))
  with pytest.raises(ValueError, match="rope_layout='interleaved' has no Hugging Face form"):
    config_lib.hf_config_dict(config_lib.get_preset("smollm2-135m"))
