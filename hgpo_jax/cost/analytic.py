"""Analytic matmul FLOPs and parameter counts of the decoder.

The textbook count, 2 x params x tokens for a forward pass plus the dense attention term
(masked keys are still multiplied, as implemented), x3 for forward + backward (+1 forward
with remat). With LoRA adapters (`hgpo_jax.models.lora`) the learner's forward also
multiplies each token by the adapters' A and B, and its backward skips the frozen base's
weight gradients; the sampler multiplies by the merged weights (`Decoder.merged`), so its
count is the base's. It cross-checks the compiled count (`hgpo_jax.cost.hlo.compiled_flops`,
tests/compiled/test_flops.py) and sizes the benchmarks' expectations.
"""

from __future__ import annotations

import dataclasses


def layer_matmul_params(cfg) -> int:
  """Weights of one decoder block that take part in matmuls (q, k, v, o, gate, up, down)."""
  d, h, kv, dh, f = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  return d * (h + 2 * kv) * dh + h * dh * d + 3 * d * f


def layer_adapter_params(cfg) -> int:
  """LoRA weights of one decoder block: A [in, r] and B [r, out] per adapted projection
  (`cfg.lora.names`; 0 without adapters), all of them multiplied in the learner's forward."""
  d, h, kv, dh, f = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  in_out = {"q": (d, h * dh), "k": (d, kv * dh), "v": (d, kv * dh), "o": (h * dh, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}
  return sum(cfg.lora.rank * sum(in_out[name]) for name in cfg.lora.names)


def adapted_layers(cfg) -> int:
  """How many decoder layers carry adapters (the last `cfg.lora.top_layers`, or all)."""
  return cfg.num_layers - cfg.lora.first_layer(cfg.num_layers)


def analytic_forward_flops(cfg, *, rows: int, tokens: int, keys: int, scored: int) -> float:
  """Matmul FLOPs of one forward pass: `rows` x `tokens` new positions, each attending
  over `keys` positions (dense: masked keys are still multiplied), and the output layer
  on `scored` positions per row (with LoRA: the adapters' products too)."""
  per_token = 2 * (cfg.num_layers * layer_matmul_params(cfg)
                   + adapted_layers(cfg) * layer_adapter_params(cfg))
  attention = cfg.num_layers * 2 * 2 * keys * cfg.num_heads * cfg.head_dim  # QK^T and PV
  head = 2 * cfg.hidden_dim * cfg.vocab_size
  return float(rows * tokens * (per_token + attention) + rows * scored * head)


def analytic_update_flops(cfg, *, rows: int, seq: int, scored: int, remat: bool) -> float:
  """Forward + backward of the actor update on [rows, seq]: 3x forward (+1x the
  layers' forward with remat: the output layer is outside the rematerialised scan). With
  LoRA: the forward, then the output layer's input gradient (1x its forward) and the
  adapted layers' backward (2x their forward) without the frozen base's weight gradients
  (1x its matmuls there); the layers below the adapted ones (`top_layers`) have no
  backward, nor a rematerialised forward. Exact for XLA's compiled update while the
  adapted layers are a loop of two or more iterations; with one adapted layer XLA inlines
  the loop and also drops that layer's gradients into its frozen input (the q, k, v input
  products and those parts of the attention's backward that feed no adapter), so the count
  is then an upper bound (6 % above the compiled count on the tiny model)."""
  fwd = analytic_forward_flops(cfg, rows=rows, tokens=seq, keys=seq, scored=scored)
  if not cfg.lora.rank:
    layers = analytic_forward_flops(cfg, rows=rows, tokens=seq, keys=seq, scored=0)
    return 3 * fwd + (layers if remat else 0.0)
  n = adapted_layers(cfg)
  top_cfg = cfg.replace(num_layers=n, lora=dataclasses.replace(cfg.lora, top_layers=0))
  top = analytic_forward_flops(top_cfg, rows=rows, tokens=seq, keys=seq, scored=0)
  head = float(rows * scored * 2 * cfg.hidden_dim * cfg.vocab_size)
  frozen = float(rows * seq * 2 * n * layer_matmul_params(cfg))
  return fwd + head + 2 * top - frozen + (top if remat else 0.0)


def analytic_sampler_flops(cfg, *, batch: int, prompt: int, new_tokens: int) -> dict[str, float]:
  """Prefill (P-1 positions) and one decode step (1 position + output layer), as the
  sampler computes them (hgpo_jax.models.decoder): the prefill fills an empty cache, its
  positions score each other only; a decode step scores the whole cache of
  P + new_tokens - 1 slots (dense) plus its own new key. LoRA adapters are merged into
  the weights before sampling: no adapter products."""
  cfg = dataclasses.replace(cfg, lora=dataclasses.replace(cfg.lora, rank=0))
  cache = prompt + new_tokens - 1
  return dict(
      prefill=analytic_forward_flops(cfg, rows=batch, tokens=prompt - 1, keys=prompt - 1,
                                     scored=0),
      decode_step=analytic_forward_flops(cfg, rows=batch, tokens=1, keys=cache + 1, scored=1))


def param_count(cfg) -> int:
  """Parameters of the decoder: embedding, blocks with their norms, biases (qkv_bias),
  q/k norm scales (qk_norm: 2 x head_dim per block) and LoRA adapters, final norm, head;
  as many as transformers' (and PEFT's) model of the same config holds."""
  d, h, kv, dh = cfg.hidden_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  per_layer = (layer_matmul_params(cfg) + 2 * d
               + ((h + 2 * kv) * dh if cfg.qkv_bias else 0) + (2 * dh if cfg.qk_norm else 0))
  head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
  return (cfg.vocab_size * d + cfg.num_layers * per_layer
          + adapted_layers(cfg) * layer_adapter_params(cfg) + d + head)
