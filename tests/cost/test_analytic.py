"""Analytic parameter counts against transformers, PEFT and the built Decoder; the LoRA
terms of the analytic FLOP counts against the compiled ones."""

import dataclasses
import jax
import numpy as np
import pytest
from flax import nnx

from hgpo_jax.cost import analytic
from hgpo_jax.compiled import trainer_metrics
from hgpo_jax.models import config as model_config
from hgpo_jax.models import decoder
from hgpo_jax.models import lora
from hgpo_jax.models import sharding
from hgpo_jax.training import train_batch
from hgpo_jax.training import train_step


def _tiny(family: str, tied: bool, rank: int = 0, targets=lora.TARGETS):
  """A 2-layer config of `family` (llama, qwen2: q/k/v biases, qwen3: q/k norms) whose
  head_dim 24 x 4 heads differs from hidden 64 (the o projection's in != out)."""
  return model_config.get_preset("tiny").replace(
      vocab_size=512, hidden_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=24,
      mlp_dim=96, rope_layout="half", tie_embeddings=tied, qkv_bias=family == "qwen2",
      qk_norm=family == "qwen3", lora=lora.LoraConfig(rank=rank, targets=tuple(targets)))


def _built(cfg) -> int:
  """Parameters (base and `nnx.LoRAParam` adapters) of the project's Decoder of `cfg`."""
  model = decoder.Decoder(cfg, rngs=nnx.Rngs(0))
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _hf_model(cfg):
  """transformers' model of `cfg` (random init), from the config.json the project writes."""
  import transformers
  hf = model_config.hf_config_dict(cfg)
  return transformers.AutoModelForCausalLM.from_config(
      transformers.AutoConfig.for_model(**hf))


@pytest.mark.parametrize("family,tied", [("qwen3", False), ("qwen3", True), ("qwen2", False),
                                         ("llama", True)])
def test_param_count_equals_transformers_and_the_decoder(family, tied):
  cfg = _tiny(family, tied)
  hf = _hf_model(cfg)
  assert type(hf).__name__.lower().startswith(family)
  want = sum(p.numel() for p in hf.parameters())
  assert analytic.param_count(cfg) == want == _built(cfg)


@pytest.mark.parametrize("targets", [lora.TARGETS, ("q_proj", "v_proj"), ("o_proj", "down_proj")])
def test_param_count_with_lora_equals_peft_and_the_decoder(targets):
  """PEFT's model (base + lora_A [r, in] + lora_B [out, r] per adapted module) holds as
  many parameters as the analytic count and the Decoder with adapters."""
  import peft
  cfg = _tiny("qwen3", False, rank=4, targets=targets)
  model = peft.get_peft_model(_hf_model(cfg), peft.LoraConfig(
      r=4, lora_alpha=8.0, target_modules=list(targets), lora_dropout=0.0))
  want = sum(p.numel() for p in model.parameters())
  assert analytic.param_count(cfg) == want == _built(cfg)
  base = analytic.param_count(cfg.replace(lora=lora.LoraConfig()))
  assert want - base == sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)


def test_param_count_of_the_qwen3_presets_is_their_published_total():
  """Qwen3-0.6B holds 596,049,920 parameters (transformers' count, the tied embedding
  once), of which 28 x 2 x 128 = 7,168 are the q/k norm scales; the model cards' sizes
  without the embedding(s): 0.44B, 1.4B, 6.95B."""
  cfg = model_config.get_preset("qwen3-0.6b")
  assert analytic.param_count(cfg) == 596_049_920
  assert analytic.param_count(cfg) - analytic.param_count(cfg.replace(qk_norm=False)) == 7_168
  for name, total, body in (("qwen3-0.6b", 0.6e9, 0.44e9), ("qwen3-1.7b", 1.7e9, 1.4e9),
                            ("qwen3-8b", 8.2e9, 6.95e9)):
    cfg = model_config.get_preset(name)
    embeddings = cfg.vocab_size * cfg.hidden_dim * (1 if cfg.tie_embeddings else 2)
    assert analytic.param_count(cfg) == pytest.approx(total, rel=0.02)
    assert analytic.param_count(cfg) - embeddings == pytest.approx(body, rel=0.01)


def test_sampler_flops_of_a_lora_config_are_its_merged_base_ones():
  """The sampler multiplies by the merged weights: a LoRA config's prefill and decode step
  cost what its base's do, while the learner's forward also multiplies by A and B."""
  cfg = _tiny("qwen3", False, rank=4)
  base = cfg.replace(lora=lora.LoraConfig())
  kw = dict(batch=4, prompt=32, new_tokens=8)
  assert analytic.analytic_sampler_flops(cfg, **kw) == analytic.analytic_sampler_flops(base, **kw)
  fwd = lambda c: analytic.analytic_forward_flops(c, rows=4, tokens=16, keys=16, scored=15)  # noqa: E731
  assert fwd(cfg) - fwd(base) == 4 * 16 * 2 * cfg.num_layers * analytic.layer_adapter_params(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("remat,top_layers", [(False, 0), (True, 0), (False, 2), (True, 2)])
def test_compiled_lora_update_flops_equal_the_analytic_count(remat, top_layers):
  """A LoRA learner's compiled update: forward with the adapters' products, backward with
  input gradients of every matmul and weight gradients of the adapters only (with
  `top_layers`: no backward below the adapted layers). Without remat the counts agree
  exactly (rel 1e-9 = float rounding); with remat the analytic count's extra forward of
  the layers is an upper bound (XLA keeps some products: within 5%)."""
  cfg = model_config.get_preset("tiny").replace(
      num_layers=3, remat=remat, lora=lora.LoraConfig(
          rank=4, targets=("q_proj", "v_proj", "down_proj"), top_layers=top_layers))
  model = decoder.Decoder(cfg, rngs=nnx.Rngs(0))
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  learner = train_step.Learner(model, mesh, train_step.UpdateConfig(
      mini_batch_rows=8, micro_batch_rows=4))
  rng = np.random.default_rng(0)
  batch, _ = train_batch.build_train_batch(
      [rng.integers(1, 500, 30).tolist() for _ in range(8)],
      [rng.integers(1, 500, 30).tolist() for _ in range(8)], np.ones(8, np.float32),
      prompt_buckets=[32], response_buckets=[32], row_multiple=8)
  seq = batch.seq_len
  got = trainer_metrics.LearnerFlops(learner).per_call(batch)["update"]
  upd = analytic.analytic_update_flops(cfg, rows=8, seq=seq, scored=seq - 1, remat=remat)
  full = analytic.analytic_update_flops(cfg.replace(lora=lora.LoraConfig()), rows=8, seq=seq,
                                        scored=seq - 1, remat=remat)
  assert upd < full
  if top_layers:
    every = analytic.analytic_update_flops(
        cfg.replace(lora=dataclasses.replace(cfg.lora, top_layers=0)), rows=8, seq=seq,
        scored=seq - 1, remat=remat)
    assert upd < every
  if remat:
    assert 0.95 * upd <= got <= upd
  else:
    assert got == pytest.approx(upd, rel=1e-9)
