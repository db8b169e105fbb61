"""The sharded critic update: value batch, value read-out, donated clipped-value-loss step.

The critic (`hgpo_jax.models.critic.Critic`) is trained like the actor
(`train_step.Learner`, which this class extends): its own TrainState (params + AdamW
moments, critic lr 1e-5 in the published PPO and HiPER scripts), the same logical-axis
shardings, row sharding over the data-parallel axes, donated state, mini-batches in row
order and micro-batch gradient accumulation where each micro-batch loss is divided by
the number of active micro-batches (verl's `loss / gradient_accumulation`).

Value entries: a `ValueBatch` carries per column l and head h a mask, the value target
R and the old value V_old (the critic's values before this iteration's updates, which
also fed the advantage estimator). PPO scores every response token with head 0 (verl
`compute_value_loss` over the response mask); HiPER scores one column per head and turn
(the read-out positions of `critic.hiper_readout`; the high head only on turns that
start a subgoal segment). The loss is the sum over heads of each head's token mean over
its scored entries (`losses.multi_head_value_loss`: HiPER-agent's dp_critic.py adds its
three heads' `compute_value_loss`), with no 0.5 factor (the released `compute_value_loss`
has none; `ValueLossConfig.loss_scale`). With a loss unit other than the micro-batch
(`UpdateConfig.loss_unit_rows`) each head's token mean is taken per unit
(`train_batch.unit_weights`, one channel per head).

Unlike the actor's, the critic's mini-batches keep their token rows (`ValueBatch`): the
value head reads every column, so there is no score-slot layout to gain.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import flax.struct
import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from hgpo_jax.models import attention
from hgpo_jax.training import losses
from hgpo_jax.training import train_batch as train_batch_lib
from hgpo_jax.training import train_step


@dataclasses.dataclass(frozen=True)
class ValueLossConfig:
  """Critic-loss options (published PPO / HiPER scripts)."""

  cliprange_value: float = 0.5
  """c of the clipped value loss (verl `critic.cliprange_value`)."""
  loss_scale: float = 1.0
  """Multiplier of the value loss: 1 in the released `compute_value_loss` (both repositories);
  0.5 reproduces the older verl's `0.5 * masked_mean`."""

  def __post_init__(self):
    if self.cliprange_value <= 0:
      raise ValueError(f"cliprange_value={self.cliprange_value} must be > 0 "
                       "(command line: --config.critic.cliprange_value)")


@flax.struct.dataclass
class ValueBatch:
  """Token rows of the critic update. `B` rows, `L` columns, `H` value heads."""

  tokens: jax.Array
  """int32[B, L] (as `TrainBatch.tokens`)."""
  positions: jax.Array
  """int32[B, L]."""
  input_mask: jax.Array
  """bool[B, L]."""
  response_mask: jax.Array
  """bool[B, L]: columns with at least one scored head (marks active micro-batches)."""
  value_mask: jax.Array
  """bool[B, L, H]: scored (column, head) entries."""
  returns: jax.Array
  """f32[B, L, H]: value targets R (0 where not scored)."""
  old_values: jax.Array
  """f32[B, L, H]: V_old, the clip anchor (0 where not scored)."""
  loss_weights: Optional[jax.Array] = None
  """f32[B, L, H] token weights (`train_batch.unit_weights`) when the loss unit is not the
  micro-batch; set by the update (`CriticLearner._layout`), None otherwise."""

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]


def value_batch(batch: train_batch_lib.TrainBatch, value_mask: np.ndarray, returns: np.ndarray,
                old_values: np.ndarray) -> ValueBatch:
  """The critic's host batch on the token layout of the actor's `batch`."""
  value_mask = np.asarray(value_mask, bool)
  return ValueBatch(
      tokens=np.asarray(batch.tokens), positions=np.asarray(batch.positions),
      input_mask=np.asarray(batch.input_mask), response_mask=value_mask.any(axis=-1),
      value_mask=value_mask, returns=np.where(value_mask, returns, 0.0).astype(np.float32),
      old_values=np.where(value_mask, old_values, 0.0).astype(np.float32))


class CriticLearner(train_step.Learner):
  """The critic's update on one mesh: state init (from `Learner`), values, jitted update.

  Args:
    model: a `Critic` (or its `critic.abstract_critic` structure).
    mesh: the training mesh.
    config: UpdateConfig of the critic (its lr, mini/micro-batch sizes, grad clip);
      `config.loss` (the actor's) is unused.
    value_config: ValueLossConfig.
    rules: logical-axis rules.
  """

  PHASE = "critic update"  # the name `train_iteration` reports to the progress line

  def __init__(self, model: nnx.Module, mesh: jax.sharding.Mesh, config: train_step.UpdateConfig,
               value_config: ValueLossConfig = ValueLossConfig(), rules: Optional[Sequence] = None):
    self.value_config = value_config
    super().__init__(model, mesh, config, rules)
    self.compute_values = jax.jit(attention.traced_on(mesh, self._compute_values),
                                  in_shardings=(self.param_shardings, self.row_sharding),
                                  out_shardings=self.row_sharding)

  def _compute_values(self, params: Any, batch: ValueBatch) -> jax.Array:
    """f32[M, L, H] values of every column, micro-batch by micro-batch."""
    model = self._model(params)
    micro = self._micro(batch)
    values_kmlh = jax.lax.map(lambda x: model.values(x.tokens, x.positions, x.input_mask), micro)
    return values_kmlh.reshape(batch.num_rows, *values_kmlh.shape[2:])

  @property
  def weighted_loss(self) -> bool:
    """Token weights only for a loss unit other than the micro-batch; else the update
    averages the micro-batches' own value losses (verl)."""
    return self.config.unit_weighted

  def _layout(self, batch: ValueBatch) -> ValueBatch:
    """The token rows, with their unit weights when the loss unit is not the micro-batch."""
    if not self.weighted_loss:
      return batch
    return batch.replace(loss_weights=train_batch_lib.unit_weights(batch.value_mask,
                                                                   self.config.loss_unit))

  def _loss_mask(self, x: ValueBatch) -> jax.Array:
    """bool[B, L, H]: one token mean per value head (`losses.multi_head_value_loss`)."""
    return x.value_mask

  def _loss(self, params, x: ValueBatch, on_policy: bool = False):
    del on_policy  # the value loss has no behaviour policy
    values_blh = self._model(params).values(x.tokens, x.positions, x.input_mask)
    vf_loss, clipfrac = losses.multi_head_value_loss(
        values_blh, x.old_values, x.returns, x.value_mask, self.value_config.cliprange_value,
        self.value_config.loss_scale, weights_blh=x.loss_weights)
    return vf_loss, {"value_loss": vf_loss, "value_clipfrac": clipfrac}


def compute_values(learner: CriticLearner, params: Any, batch: ValueBatch) -> np.ndarray:
  """f32[B, L, H] host values of a host batch, one compiled [mini_batch, L] shape."""
  out = []
  for chunk in train_batch_lib.row_chunks(batch, learner.config.mini_batch_rows):
    out.append(_to_host(learner.compute_values(params, learner.put_batch(chunk))))
  return np.concatenate(out)


def _to_host(x: jax.Array) -> np.ndarray:
  """A fully addressable (or replicated-across-processes) array as numpy."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def token_layout_batch(batch: train_batch_lib.TrainBatch, num_heads: int) -> ValueBatch:
  """A ValueBatch with nothing scored, for computing values before targets exist."""
  shape = batch.tokens.shape + (num_heads,)
  zeros = np.zeros(shape, np.float32)
  return value_batch(batch, np.zeros(shape, bool), zeros, zeros)


def explained_variance(values: np.ndarray, returns: np.ndarray, mask: np.ndarray) -> float:
  """1 - Var(R - V) / (Var(R) + 1e-5) over the masked entries, unbiased variances in
  float64 (verl `critic/vf_explained_var`); 0 with fewer than two entries."""
  v = np.asarray(values, np.float64)[np.asarray(mask, bool)]
  r = np.asarray(returns, np.float64)[np.asarray(mask, bool)]
  if r.size < 2:
    return 0.0
  return float(1.0 - np.var(r - v, ddof=1) / (np.var(r, ddof=1) + 1e-5))
