"""The value model (critic): the decoder backbone plus scalar value heads.

Layout follows verl's critic (`AutoModelForTokenClassification`: the causal LM without
its output layer, plus a linear `score` head, initialised from the actor's checkpoint):
  values[b, l, h] = w_h . hidden[b, l - 1] + c_h
i.e. column l holds the value *of response token l* read from the position that predicts
it (the `train_batch` column convention; column 0 is 0). The value of the first response
token therefore sees the prompt only; the value after `</subgoal>` sees prompt, switch
and subgoal.

Heads: one for PPO (token values, docs/algorithms.md §7); three for HiPER
(low, high, term in the order of `hgpo_jax.models.value_heads.HEADS`, docs/algorithms.md §8). The published HiPER
scripts train a separate critic LLM of the actor's size (JonP07/HiPER-agent, three
heads); this module is that separate critic, with its own parameter tree.

HiPER read-out positions (`hiper_readout`), in response-token indices:
  V_high, V_term: the first response token of every turn (the estimator uses V_high on
    boundary turns only);
  V_low: the first token after `</subgoal>` (a token that straddles `</subgoal><action>`
    is the subgoal's, so V_low is read after it, as released); without a complete subgoal
    span (no subgoal tokens, or the subgoal runs to the end of a truncated response) the
    first token after `</switch>`; without that the first response token.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hgpo_jax.models import decoder
from hgpo_jax.models import lora
from hgpo_jax.models import value_heads
from hgpo_jax.models.config import ModelConfig

BACKBONE_KEYS = ("embed", "layers", "final_norm")
"""Parameters the critic copies from the policy (the output layer is not used)."""

VALUE_HEAD_STD = 0.02
"""N(0, 0.02^2) init of the head, zero bias: Hugging Face's `initializer_range` init of
the newly added token-classification `score` layer."""

LEVELS = value_heads.LEVELS


def backbone_config(cfg: ModelConfig) -> ModelConfig:
  """The policy architecture without an output layer (tied embeddings: no `lm_head`)."""
  return cfg.replace(tie_embeddings=True)


def head_dtype(cfg: ModelConfig):
  """The value heads' dtype: the parameters', or with LoRA (a frozen base in the compute
  dtype, `hgpo_jax.models.lora`) the trained adapters' float32: the heads stay full rank
  and are trained beside the adapters."""
  return lora.ADAPTER_DTYPE if cfg.lora.rank else cfg.weight_dtype


class Critic(nnx.Module):
  """Decoder backbone + `num_heads` scalar value heads.

  Parameters: backbone (a Decoder without lm_head); value_head [H, D] ("value_heads",
  "embed"); value_bias [H] ("value_heads",). "value_heads" has no sharding rule, so
  the head is replicated over that axis and split like any "embed" dimension.
  """

  def __init__(self, cfg: ModelConfig, num_heads: int, *, rngs: nnx.Rngs):
    if num_heads not in LEVELS:
      raise ValueError(f"Critic num_heads={num_heads}: use 1 (PPO) or 3 (HiPER low/high/term).")
    self.num_heads = num_heads
    self.backbone = decoder.Decoder(backbone_config(cfg), rngs=rngs)
    dt = head_dtype(cfg)
    head = VALUE_HEAD_STD * jax.random.normal(rngs.params(), (num_heads, cfg.hidden_dim), jnp.float32)
    self.value_head = nnx.Param(head.astype(dt), logical_axes=("value_heads", "embed"))
    self.value_bias = nnx.Param(jnp.zeros((num_heads,), dt), logical_axes=("value_heads",))

  @property
  def cfg(self) -> ModelConfig:
    return self.backbone.cfg

  def values(self, tokens_bl: jax.Array, positions_bl: jax.Array, input_mask_bl: jax.Array) -> jax.Array:
    """f32[B, L, H]: column l = value of token l from position l - 1; column 0 is 0.

    Args:
      tokens_bl: int32[B, L]; positions_bl: int32[B, L]; input_mask_bl: bool[B, L] (one
        segment per row, `Decoder.hidden`).
    """
    hidden_bld, _ = self.backbone.hidden(tokens_bl, positions_bl, input_mask_bl)
    values_blh = jnp.einsum("bld,hd->blh", hidden_bld[:, :-1].astype(jnp.float32),
                            self.value_head[...].astype(jnp.float32)) + self.value_bias[...].astype(jnp.float32)
    return jnp.pad(values_blh, ((0, 0), (1, 0), (0, 0)))


def abstract_critic(cfg: ModelConfig, num_heads: int) -> Critic:
  """The critic's structure (ShapeDtypeStructs with sharding metadata), no allocation."""
  return nnx.eval_shape(lambda: Critic(cfg, num_heads, rngs=nnx.Rngs(0)))


def params_from_policy(policy_params: Any, cfg: ModelConfig, num_heads: int, seed: int) -> dict:
  """Critic params (pure dict): the policy's backbone weights + a freshly initialised head.

  Args:
    policy_params: pure dict (or nnx.State) of the policy Decoder's Params.
    cfg: the policy's ModelConfig.
    num_heads: 1 or 3.
    seed: init seed of the value head.
  """
  if isinstance(policy_params, nnx.State):
    policy_params = nnx.to_pure_dict(policy_params)
  missing = [k for k in BACKBONE_KEYS if k not in policy_params]
  if missing:
    raise ValueError(f"policy params lack {missing}; pass the Decoder's nnx.Param state")
  key = jax.random.fold_in(jax.random.key(seed), num_heads)
  head = VALUE_HEAD_STD * jax.random.normal(key, (num_heads, cfg.hidden_dim), jnp.float32)
  dt = head_dtype(cfg)
  return {"backbone": {k: policy_params[k] for k in BACKBONE_KEYS},
          "value_head": np.asarray(head.astype(dt)), "value_bias": np.zeros((num_heads,), dt)}


# ---------------------------------------------------------------------------------------
# HiPER read-out positions
# ---------------------------------------------------------------------------------------
def hiper_readout(token_tags: Sequence[int] | np.ndarray) -> tuple[int, int, int]:
  """(low, high, term) response-token indices where a turn's three values are read.

  Args:
    token_tags: TAG_* codes of the turn's response tokens (`value_heads`),
      one per token, tag markup included in its span; multi-block codes (a "><" that
      straddles `</subgoal><action>`) count as members of each of their blocks.

  Returns:
    Indices into the response: high = term = 0; low = first token after the subgoal
    block, else after the switch block, else 0 (see the module docstring). One rule for
    the estimator and the trainer: this is `value_heads.value_readout` (released
    `compute_value_mask`), which tests block membership rather than comparing codes.
  """
  return value_heads.value_readout(token_tags)
