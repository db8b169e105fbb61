"""LoRA adapters (hgpo_jax/models/lora.py): the adapted forward equals transformers + peft,
PEFT's files round-trip, fresh adapters leave the base's forward bit for bit, the merged
weights compute the same forward, and bad settings are one-line errors."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import model_fixtures
from hgpo_jax.models import decoder, kv_cache, loading, lora

ALL = list(lora.TARGETS)
SUBSET = ["q_proj", "o_proj", "up_proj"]


def _peft_model(tmp_path, arch, targets, *, rank=4, alpha=8.0, rslora=False, seed=0,
                layers=None):
  """(HF directory, PEFT adapter directory, peft model) with random non-zero A and B
  (on the layers `layers` only when given: PEFT's `layers_to_transform`)."""
  import peft
  import torch
  hf_dir = str(tmp_path / arch)
  base = model_fixtures.write_hf_dir(hf_dir, arch, seed=seed)
  model = peft.get_peft_model(base, peft.LoraConfig(
      r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, use_rslora=rslora,
      layers_to_transform=layers))
  torch.manual_seed(seed + 1)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "lora_" in name:
        p.copy_(0.3 * torch.randn_like(p))
  model.eval()
  adapter_dir = str(tmp_path / f"{arch}_adapter")
  model.save_pretrained(adapter_dir)
  return hf_dir, adapter_dir, model


def _logits(model, tokens, mask, positions):
  return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask))[0])


@pytest.mark.parametrize("arch,targets,rslora,layers", [
    ("qwen2", ALL, False, None), ("llama", ALL, True, None), ("qwen2", SUBSET, False, None),
    ("llama", SUBSET, False, [1])])
def test_adapted_forward_equals_peft(tmp_path, arch, targets, rslora, layers):
  hf_dir, adapter_dir, reference = _peft_model(tmp_path, arch, targets, rslora=rslora,
                                               layers=layers)
  model, _, cfg = loading.load_hf_dir(hf_dir, lora_path=adapter_dir)
  assert cfg.lora.rank == 4 and set(cfg.lora.targets) == set(targets)
  assert cfg.lora.top_layers == (len(layers) if layers else 0)
  assert model.layers.q_lora_a[...].shape[0] == (len(layers) if layers else cfg.num_layers)
  assert cfg.lora.scale == (8.0 / 2.0 if rslora else 8.0 / 4)
  tokens, mask, positions = model_fixtures.left_padded_batch()
  want = model_fixtures.torch_logits(reference, tokens, mask, positions)
  got = _logits(model, tokens, mask, positions)
  base, _, _ = loading.load_hf_dir(hf_dir)
  without = _logits(base, tokens, mask, positions)
  # the adapters move the logits far more than the tolerance
  assert np.max(np.abs(want - without)[mask]) > 0.5
  np.testing.assert_allclose(got[mask], want[mask], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("top_layers", [0, 1])
def test_peft_files_round_trip(tmp_path, top_layers):
  import json
  import peft
  import transformers
  hf_dir = str(tmp_path / "hf")
  model_fixtures.write_hf_dir(hf_dir, "qwen2")
  base, _, _ = loading.load_hf_dir(hf_dir)
  model = loading.with_lora(base, lora.LoraConfig(rank=3, alpha=5.0, targets=tuple(SUBSET),
                                                  top_layers=top_layers), seed=1)
  # B = 0 from the init; make them non-zero so the files carry a real update
  state = nnx.state(model, nnx.LoRAParam)
  rng = np.random.default_rng(0)
  nnx.update(model, jax.tree.map(lambda x: jnp.asarray(
      rng.normal(0, 0.2, x.shape), x.dtype), state))
  out = str(tmp_path / "adapter")
  lora.write_peft_adapter(out, model.cfg.lora,
                          nnx.to_pure_dict(nnx.state(model, nnx.Param))["layers"],
                          num_layers=model.cfg.num_layers, base_model=hf_dir)
  assert sorted(os.listdir(out)) == [lora.CONFIG_FILE, lora.WEIGHTS_FILE]
  with open(os.path.join(out, lora.CONFIG_FILE)) as f:
    assert json.load(f)["layers_to_transform"] == ([1] if top_layers else None)
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=3)
  ours = _logits(model, tokens, mask, positions)
  hf = transformers.Qwen2ForCausalLM.from_pretrained(hf_dir).eval()
  hf.config._attn_implementation = "eager"
  loaded = peft.PeftModel.from_pretrained(hf, out).eval()
  want = model_fixtures.torch_logits(loaded, tokens, mask, positions)
  np.testing.assert_allclose(ours[mask], want[mask], atol=2e-4, rtol=1e-4)
  back, _, _ = loading.load_hf_dir(hf_dir, lora_path=out)
  for name, x in nnx.to_pure_dict(nnx.state(model, nnx.LoRAParam))["layers"].items():
    np.testing.assert_array_equal(np.asarray(back.layers.__getattribute__(name)[...]),
                                  np.asarray(x))
  np.testing.assert_array_equal(_logits(back, tokens, mask, positions), ours)


def test_fresh_adapters_are_peft_init_and_leave_the_forward_bitwise():
  base = decoder.Decoder(loading.get_preset("tiny"), rngs=nnx.Rngs(params=0))
  model = loading.with_lora(base, lora.LoraConfig(rank=8), seed=0)
  a = np.asarray(model.layers.q_lora_a[...])
  d = model.cfg.hidden_dim
  assert a.shape == (2, d, 8) and model.layers.q_lora_b[...].shape == (2, 8, 4, 16)
  assert model.layers.o_lora_a[...].shape == (2, 4, 16, 8)
  # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in)); B zeros
  assert np.abs(a).max() <= d ** -0.5 and np.abs(a).max() > 0.9 * d ** -0.5
  assert abs(a.std() - d ** -0.5 / np.sqrt(3)) < 0.01
  assert not np.any(np.asarray(model.layers.down_lora_b[...]))
  assert model.layers.q_lora_a.get_metadata()["logical_axes"] == ("layers", "embed",
                                                                   "lora_rank")
  assert model.layers.q_lora_b.get_metadata()["logical_axes"] == (
      "layers", "lora_rank", "heads", "head_dim")
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=5)
  np.testing.assert_array_equal(_logits(model, tokens, mask, positions),
                                _logits(base, tokens, mask, positions))


def test_merged_weights_compute_the_adapted_forward():
  base = decoder.Decoder(loading.get_preset("tiny"), rngs=nnx.Rngs(params=0))
  model = loading.with_lora(base, lora.LoraConfig(rank=4, alpha=12.0), seed=0)
  rng = np.random.default_rng(1)
  nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype),
                                 nnx.state(model, nnx.LoRAParam)))
  merged = model.merged()
  assert merged.cfg.lora.rank == 0 and not hasattr(merged.layers, "q_lora_a")
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=2)
  got, want = _logits(merged, tokens, mask, positions), _logits(model, tokens, mask, positions)
  assert np.max(np.abs(want - _logits(base, tokens, mask, positions))[mask]) > 0.1
  np.testing.assert_allclose(got[mask], want[mask], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(rank=-1), "model.lora.rank=-1 must be >= 0"),
    (dict(rank=4, alpha=0.0), "model.lora.alpha=0.0 must be > 0"),
    (dict(rank=4, targets=("qkv",)), "names no module"),
    (dict(rank=4, targets=()), "names no module"),
])
def test_bad_settings_are_one_line_errors(kwargs, message):
  with pytest.raises(ValueError, match=message) as e:
    lora.LoraConfig(**kwargs)
  assert "\n" not in str(e.value)


def test_top_layer_adapters_are_every_layer_adapters_with_the_lower_ones_off():
  """`top_layers=1` on the 2-layer tiny model equals adapters on both layers whose layer-0
  B is zero: the same logits, and the same gradient of the top adapters although no
  gradient flows below them (the split layer scan's stop_gradient)."""
  cfg = loading.get_preset("tiny")
  base = decoder.Decoder(cfg, rngs=nnx.Rngs(params=0))
  every = loading.with_lora(base, lora.LoraConfig(rank=4, alpha=8.0), seed=0)
  top = loading.with_lora(base, lora.LoraConfig(rank=4, alpha=8.0, top_layers=1), seed=0)
  assert top.layers.q_lora_a[...].shape[0] == 1 and top.cfg.lora.first_layer(2) == 1
  rng = np.random.default_rng(3)
  state = jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype),
                       nnx.state(every, nnx.LoRAParam))
  state = jax.tree_util.tree_map_with_path(
      lambda path, x: x.at[0].set(0.0) if "lora_b" in jax.tree_util.keystr(path) else x, state)
  nnx.update(every, state)
  nnx.update(top, jax.tree.map(lambda x: x[1:], state))
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=8)
  weights = jnp.asarray(rng.normal(size=(*tokens.shape, cfg.vocab_size)), jnp.float32)

  def grads(model):
    graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(a):
      logits = nnx.merge(graphdef, a, rest)(jnp.asarray(tokens), jnp.asarray(positions),
                                            jnp.asarray(mask))[0]
      return jnp.sum(jnp.where(jnp.asarray(mask)[..., None], logits * weights, 0.0))
    return loss(adapters), nnx.to_pure_dict(jax.grad(loss)(adapters))["layers"]
  (loss_every, g_every), (loss_top, g_top) = grads(every), grads(top)
  np.testing.assert_allclose(float(loss_top), float(loss_every), rtol=1e-6)
  for name, g in g_top.items():
    assert np.any(np.asarray(g) != 0), name
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(g_every[name][1]), rtol=2e-4,
                               atol=1e-5, err_msg=name)
  merged = top.merged()
  np.testing.assert_allclose(_logits(merged, tokens, mask, positions)[mask],
                             _logits(top, tokens, mask, positions)[mask], atol=1e-4)


def test_unmerged_top_layer_adapters_decode_over_the_kv_cache_as_the_forward_computes():
  """Decode steps of an unmerged top-layer model (zero adapters put below the adapted
  layers for the one layer loop) give the logits of its full forward."""
  cfg = loading.get_preset("tiny")
  base = decoder.Decoder(cfg, rngs=nnx.Rngs(params=0))
  model = loading.with_lora(base, lora.LoraConfig(rank=4, alpha=8.0, top_layers=1), seed=0)
  rng = np.random.default_rng(5)
  nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype),
                                 nnx.state(model, nnx.LoRAParam)))
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=2, length=12, pads=(0, 2, 5))
  full = _logits(model, tokens, mask, positions)
  assert np.max(np.abs(full - _logits(base, tokens, mask, positions))[mask]) > 0.1
  cache = kv_cache.init_cache(cfg, tokens.shape[0], 16)
  logits, cache = model.decode(jnp.asarray(tokens[:, :6]), jnp.asarray(positions[:, :6]), cache,
                               jnp.int32(0), jnp.asarray(mask[:, :6]))
  outs = [np.asarray(logits)]
  for i in range(6, tokens.shape[1]):
    logits, cache = model.decode(jnp.asarray(tokens[:, i:i + 1]),
                                 jnp.asarray(positions[:, i:i + 1]), cache, jnp.int32(i),
                                 jnp.asarray(mask[:, i:i + 1]))
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(outs, axis=1)[mask], full[mask], atol=1e-4)


def test_top_layers_that_do_not_fit_are_one_line_errors(tmp_path):
  base = decoder.Decoder(loading.get_preset("tiny"), rngs=nnx.Rngs(params=0))
  with pytest.raises(ValueError, match="top_layers=3 exceeds the model's 2 layers"):
    loading.with_lora(base, lora.LoraConfig(rank=4, top_layers=3))
  with pytest.raises(ValueError, match="top_layers=-1 must be >= 0"):
    lora.LoraConfig(rank=4, top_layers=-1)
  _, adapter_dir, _ = _peft_model(tmp_path, "llama", SUBSET, layers=[0])
  with pytest.raises(ValueError, match=r"layers_to_transform=\[0\] is not the last layers") as e:
    lora.read_peft_config(adapter_dir, 2)
  assert "\n" not in str(e.value)
  _, top_dir, _ = _peft_model(tmp_path / "top", "llama", SUBSET, layers=[1])
  hf_base, _, _ = loading.load_hf_dir(str(tmp_path / "top" / "llama"))
  with pytest.raises(ValueError, match="set model.lora.top_layers=1"):
    loading.with_lora(hf_base, lora.LoraConfig(rank=4), adapter_dir=top_dir)


def test_adapter_of_another_base_is_refused(tmp_path):
  _, adapter_dir, _ = _peft_model(tmp_path, "qwen2", SUBSET)
  other = decoder.Decoder(loading.get_preset("tiny"), rngs=nnx.Rngs(params=0))  # hidden 64,
  with pytest.raises(ValueError, match="base model differs") as e:  # other head layout
    loading.with_lora(other, adapter_dir=adapter_dir)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("top_layers", [0, 1])
def test_export_of_a_lora_run_as_peft_adapter_and_merged_model(tmp_path, top_layers):
  """`launch.export` of a LoRA checkpoint: --lora-adapter writes what peft loads onto the HF
  base with the run's logits (and the project loads back), the default the merged model;
  also with adapters on the top layer only (`top_layers`)."""
  import peft
  import transformers
  from launch import export
  from hgpo_jax.models import sharding
  from hgpo_jax.training import checkpoint, train_step
  hf_dir = str(tmp_path / "hf")
  model_fixtures.write_hf_dir(hf_dir, "qwen2")
  base, _, _ = loading.load_hf_dir(hf_dir)
  model = loading.with_lora(base, lora.LoraConfig(rank=3, alpha=5.0, targets=tuple(SUBSET),
                                                  top_layers=top_layers))
  rng = np.random.default_rng(4)
  nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.2, x.shape), x.dtype),
                                 nnx.state(model, nnx.LoRAParam)))
  learner = train_step.Learner(model, sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]),
                               train_step.UpdateConfig(mini_batch_rows=8, micro_batch_rows=8))
  state = learner.init_state(nnx.state(model, nnx.Param))
  config = {"seed": 0, "model": {"name": "custom", "path": hf_dir, "lora": {
      "rank": 3, "alpha": 5.0, "targets": ",".join(SUBSET), "rslora": False, "path": "",
      "top_layers": top_layers}}}
  with checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(1, state.to_checkpoint(), cursor={"iteration": 1}, config=config)
  tokens, mask, positions = model_fixtures.left_padded_batch(seed=6)
  ours = _logits(model, tokens, mask, positions)
  adapter_dir, merged_dir = str(tmp_path / "adapter"), str(tmp_path / "merged")
  assert export.main(["--workdir", str(tmp_path / "run"), "--out", adapter_dir,
                      "--lora-adapter"]) == 0
  hf = transformers.Qwen2ForCausalLM.from_pretrained(hf_dir).eval()
  hf.config._attn_implementation = "eager"
  adapted = peft.PeftModel.from_pretrained(hf, adapter_dir).eval()
  np.testing.assert_allclose(model_fixtures.torch_logits(adapted, tokens, mask, positions)[mask],
                             ours[mask], atol=2e-4, rtol=1e-4)
  back, _, _ = loading.load_hf_dir(hf_dir, lora_path=adapter_dir)
  np.testing.assert_array_equal(_logits(back, tokens, mask, positions), ours)
  assert export.main(["--workdir", str(tmp_path / "run"), "--out", merged_dir]) == 0
  full = transformers.Qwen2ForCausalLM.from_pretrained(merged_dir).eval()
  full.config._attn_implementation = "eager"
  np.testing.assert_allclose(model_fixtures.torch_logits(full, tokens, mask, positions)[mask],
                             ours[mask], atol=2e-4, rtol=1e-4)


def _teacher_forced(model, prompt, response):
  """log p of each response token under the unmerged forward, and its greedy choices."""
  seq = np.asarray([list(prompt) + list(response)], np.int32)
  positions = np.arange(seq.shape[1], dtype=np.int32)[None]
  logits = model(jnp.asarray(seq), jnp.asarray(positions), jnp.ones(seq.shape, bool))[0]
  logp = np.asarray(jax.nn.log_softmax(logits[0], axis=-1))
  cols = np.arange(len(prompt) - 1, seq.shape[1] - 1)
  return logp[cols, np.asarray(response)], logp[cols].argmax(-1)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_merged_sampler_samples_what_the_unmerged_forward_computes(temperature):
  from hgpo_jax.models.tokenizer import tiny_tokenizer
  from hgpo_jax.sampling import SamplingParams, sampler
  base = decoder.Decoder(loading.get_preset("tiny"), rngs=nnx.Rngs(params=0))
  model = loading.with_lora(base, lora.LoraConfig(rank=4, alpha=8.0), seed=0)
  rng = np.random.default_rng(7)
  nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype),
                                 nnx.state(model, nnx.LoRAParam)))
  tok = tiny_tokenizer()
  prompts = [tok.encode(p) for p in ("go to cabinet 1", "put a clean apple in the fridge")]
  smp = sampler.Sampler(model, tok, prompt_buckets=(16,), batch_buckets=(2,))
  out = smp.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=10),
                     jax.random.key(1))
  moved = 0
  for prompt, tokens, logprobs in zip(prompts, out.tokens, out.logprobs):
    want, greedy = _teacher_forced(model, prompt, tokens)
    np.testing.assert_allclose(logprobs, want, atol=1e-4)
    if temperature == 0.0:
      assert list(greedy) == list(tokens)
    moved += np.sum(np.abs(want - _teacher_forced(base, prompt, tokens)[0]) > 0.05)
  assert moved > 0  # the adapters change the sampled tokens' log-probs
