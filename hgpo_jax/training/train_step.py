"""The sharded PPO actor update: train state, old/reference log-probs, donated jitted step.

Flow of one iteration (docs/algorithms.md §9):
  1. `fill_logprobs`: log pi_old (current params) and log pi_ref (frozen initial params)
     of every scored token, computed in micro-batches, before any update.
  2. For each PPO epoch and each mini-batch (in order: verl `shuffle=False`), `update`:
     the mini-batch [M, L] is split into k = M / m contiguous micro-batches; a
     `lax.scan` accumulates gradients of `loss_i / k_active` (verl divides each
     micro-batch loss by the accumulation count, so the optimiser sees the *mean of
     micro-batch losses*, e.g. the mean of micro-batch token means under `token-mean`,
     not a global token mean); then global-norm clipping and AdamW.

Micro-batches are *global*: a micro-batch of m rows is sharded over the data-parallel
axes (`data` x `fsdp`), and its token-mean is taken over all m rows. The result is
therefore the same on any mesh (1 device or 8), and equals verl's arithmetic with one
GPU; verl with G GPUs averages G per-GPU token means instead.

k_active: micro-batches with no scored token (all-padding, see `train_batch`) add
nothing and are not counted; without padding k_active = k exactly as in verl.

Laid-out mini-batches (`training.packing`) carry per-token loss weights that make their
loss this same mean of micro-batch means however the steps are arranged: a packed
mini-batch (one row length) goes through the same `lax.scan`; a length-grouped one (a
tuple of micro-batches, each with its own row length) goes through
`update_micro_batches`: one compiled gradient program per micro-batch shape adding to
a donated f32 gradient sum, then one compiled optimizer step (`apply_gradients`, shared
with `update`).

Memory: the state holds params + 2 AdamW moments (3x params, f32), sharded by the
model's logical rules. The reference policy is a fourth copy of the params with the
same shardings, kept on the mesh (verl offloads it to host memory): for SmolLM2-135M
that is 0.54 GB extra in f32; with FSDP it is divided over the fsdp devices.

State creation follows big_vision: `eval_shape(init)` -> shardings ->
`jit(init, out_shardings=...)`, so the optimizer state is born sharded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hgpo_jax.models import attention
from hgpo_jax.models import sharding as sharding_lib
from hgpo_jax.training import checkpoint
from hgpo_jax.training import losses
from hgpo_jax.training import packing
from hgpo_jax.training import progress
from hgpo_jax.training import train_batch as train_batch_lib

@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """Optimizer, batching and loss options of the actor update (defaults: docs/algorithms.md §9)."""

  lr: float = 1e-6
  """Peak (and, after warmup, constant) learning rate of AdamW."""
  warmup_steps: int = 0
  """Linear warmup from 0 over this many optimizer steps; 0: constant from the start."""
  weight_decay: float = 0.01
  """Decoupled AdamW weight decay (applied to every parameter, as torch AdamW does)."""
  b1: float = 0.9
  """AdamW beta1 (torch default)."""
  b2: float = 0.999
  """AdamW beta2 (torch default)."""
  eps: float = 1e-8
  """AdamW epsilon (torch default)."""
  grad_clip: float = 1.0
  """Global-norm gradient clipping threshold; a non-finite norm skips the step (verl)."""
  mini_batch_rows: int = 256
  """Rows per optimizer step (verl `ppo_mini_batch_size`, counted in step rows)."""
  micro_batch_rows: int = 16
  """Rows per forward/backward pass, global over the data-parallel devices."""
  ppo_epochs: int = 1
  """Passes over the iteration's rows."""
  loss: losses.LossConfig = losses.LossConfig()
  """Actor-loss options."""
  scored_tail: Optional[int] = None
  """If set, only the last `scored_tail` token columns are scored (the response bucket):
  the output layer is skipped on prompt positions. None: every column."""
  reuse_on_policy_logprobs: bool = True
  """When an iteration is one optimizer step (`on_policy`), take log pi_old from the
  update's own forward pass (detached) instead of a separate pass before it: the same
  numbers in exact arithmetic (pi_old is the current policy), one forward pass fewer.
  False: always the separate pass (verl's `compute_log_prob`)."""
  pack_rows: bool = False
  """The trainer packs each mini-batch's steps end to end into fewer rows before the
  log-prob passes and the update (`training.packing`: segment-masked attention, the same
  token-mean loss); needs `loss.loss_agg == "token-mean"`."""
  group_by_length: bool = False
  """The trainer sorts each mini-batch's steps by length into micro-batches of their own
  row length (`packing.group_mini_batch`; the same token-mean loss) and the update runs
  them one by one (`Learner.update_micro_batches`); needs `loss.loss_agg == "token-mean"`."""
  length_multiple: int = 128
  """With `group_by_length`: micro-batch row lengths are rounded up to a multiple of this
  (fewer distinct lengths, fewer compiled programs; more padding)."""
  loss_unit_rows: int = 0
  """Rows per loss unit: the mini-batch loss is the mean over its units (of consecutive
  rows) that score a token of each unit's own aggregate, whatever the micro-batches are
  (verl: a unit is a per-GPU micro-batch, averaged over gradient accumulation and GPUs).
  0: `micro_batch_rows` (the unit is the global micro-batch). A unit other than the
  micro-batch needs `token-mean` (`unit_weights`)."""

  def __post_init__(self):
    for name in ("pack_rows", "group_by_length"):
      if getattr(self, name) and self.loss.loss_agg != "token-mean":
        raise ValueError(f"{name} needs loss_agg='token-mean' (the packed loss is its weighted "
                         f"token sum), got {self.loss.loss_agg!r}")
    if self.pack_rows and self.group_by_length:
      raise ValueError("pack_rows and group_by_length are two layouts of the update's rows: "
                       "set one of them")
    if self.length_multiple < 1:
      raise ValueError(f"length_multiple={self.length_multiple} must be >= 1.")
    if self.ppo_epochs < 1 or self.micro_batch_rows < 1:
      raise ValueError(f"ppo_epochs={self.ppo_epochs} and micro_batch_rows={self.micro_batch_rows} must be >= 1.")
    if self.mini_batch_rows % self.micro_batch_rows:
      raise ValueError(f"mini_batch_rows={self.mini_batch_rows} must be a multiple of micro_batch_rows={self.micro_batch_rows}.")
    if self.loss_unit_rows < 0 or self.mini_batch_rows % self.loss_unit:
      raise ValueError(f"mini_batch_rows={self.mini_batch_rows} must be a multiple of "
                       f"loss_unit_rows={self.loss_unit_rows} (0: micro_batch_rows).")
    if self.loss_unit != self.micro_batch_rows and self.loss.loss_agg != "token-mean":
      raise ValueError(f"loss_unit_rows={self.loss_unit_rows} differs from micro_batch_rows="
                       f"{self.micro_batch_rows}: needs loss_agg='token-mean', got "
                       f"{self.loss.loss_agg!r}")
    if not self.lr > 0 or self.weight_decay < 0 or not self.grad_clip > 0:
      raise ValueError(f"lr={self.lr} and grad_clip={self.grad_clip} must be > 0, weight_decay={self.weight_decay} >= 0.")

  @property
  def loss_unit(self) -> int:
    """Rows per loss unit (`loss_unit_rows`, 0 meaning `micro_batch_rows`)."""
    return self.loss_unit_rows or self.micro_batch_rows

  @property
  def unit_weighted(self) -> bool:
    """Whether the loss unit differs from the micro-batch, so the update weights tokens
    (`unit_weights`) instead of averaging micro-batch aggregates."""
    return self.loss_unit != self.micro_batch_rows

  @property
  def grad_accum_steps(self) -> int:
    """k: micro-batches per mini-batch."""
    return self.mini_batch_rows // self.micro_batch_rows

  def on_policy(self, num_rows: int) -> bool:
    """Whether an iteration of `num_rows` rows (padded to the mini-batch) is a single
    optimizer step from the rollout's own params, so log pi_old = log pi_theta at the
    update (ratio 1: TRL GRPO with num_iterations=1 likewise detaches its own log-probs)
    and `reuse_on_policy_logprobs` may skip the separate pass."""
    return (self.reuse_on_policy_logprobs and self.ppo_epochs == 1
            and num_rows <= self.mini_batch_rows)


def make_optimizer(config: UpdateConfig) -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) then AdamW with a constant (optionally warmed-up) lr."""
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      optax.adamw(learning_rate_schedule(config), b1=config.b1, b2=config.b2, eps=config.eps,
                  weight_decay=config.weight_decay))


def learning_rate_schedule(config: UpdateConfig) -> optax.Schedule:
  if config.warmup_steps > 0:
    return optax.warmup_constant_schedule(0.0, config.lr, config.warmup_steps)
  return optax.constant_schedule(config.lr)


@flax.struct.dataclass
class TrainState:
  """Everything the update changes. Params are a pure nested dict of arrays."""

  params: Any
  """Model parameters as `nnx.to_pure_dict` of the nnx.Param state."""
  opt_state: Any
  """optax state of `make_optimizer`."""
  step: jax.Array
  """int32[]: optimizer steps taken. (The update is deterministic: no PRNG key is kept.)"""

  def to_checkpoint(self) -> dict:
    """The pytree that `checkpoint.Checkpointer` saves."""
    return {"params": self.params, "opt_state": self.opt_state, "step": self.step}

  @classmethod
  def from_checkpoint(cls, tree: dict) -> "TrainState":
    return cls(params=tree["params"], opt_state=tree["opt_state"], step=tree["step"])


def _pure(tree: Any) -> Any:
  """A pure nested dict from an nnx.State (or the tree itself if already pure)."""
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def token_logprobs(model: nnx.Module, tokens_bl: jax.Array, positions_bl: jax.Array,
                   input_mask_bl: jax.Array, with_entropy: bool = True,
                   scored_tail: Optional[int] = None):
  """Log-prob (and full-softmax entropy) of every token given the tokens before it.

  Column l holds the value for token l predicted from position l - 1 (the
  `train_batch` convention); column 0 is 0.

  Args:
    model: the decoder (`hidden(...)`, `logits(hidden)`).
    tokens_bl: int32[B, L]; positions_bl: int32[B, L]; input_mask_bl: bool[B, L].
    with_entropy: also return the entropy (else None).
    scored_tail: if set (static), only the last `scored_tail` columns can be scored (the
      response bucket of `train_batch`): the output layer runs on those positions only,
      which saves the [B, P, V] prompt logits (the vocabulary projection is a large part
      of a small model's cost); other columns hold 0.

  Returns:
    (logp_bl f32[B, L], entropy_bl f32[B, L] or None).
  """
  hidden_bld, _ = model.hidden(tokens_bl, positions_bl, input_mask_bl)
  seq = tokens_bl.shape[1]
  tail = seq - 1 if scored_tail is None else min(scored_tail, seq - 1)
  logits_blv = model.logits(hidden_bld[:, seq - 1 - tail:seq - 1]).astype(jnp.float32)
  logz_bl = jax.nn.logsumexp(logits_blv, axis=-1)
  picked_bl = jnp.take_along_axis(logits_blv, tokens_bl[:, seq - tail:, None], axis=-1)[..., 0]
  pad = ((0, 0), (seq - tail, 0))
  logp_bl = jnp.pad(picked_bl - logz_bl, pad)
  if not with_entropy:
    return logp_bl, None
  probs_blv = jnp.exp(logits_blv - logz_bl[..., None])
  entropy_bl = logz_bl - jnp.sum(probs_blv * logits_blv, axis=-1)
  return logp_bl, jnp.pad(entropy_bl, pad)


def packed_token_logprobs(model: nnx.Module, batch: packing.PackedBatch, with_entropy: bool = True):
  """Log-prob (and entropy) of each scored slot of a packed batch (`training.packing`).

  Segments attend to themselves only and count positions from 0, so each slot's value is
  the one `token_logprobs` gives the same token unpacked; the output layer runs on the
  scored slots only.

  Returns:
    (logp_bs f32[R, S], entropy_bs f32[R, S] or None); unused slots hold garbage (mask
    them with `score_mask`).
  """
  hidden_bld, _ = model.hidden(batch.tokens, batch.positions, batch.segment_ids)
  # the token in column l is predicted from position l - 1 (the train_batch convention)
  prev_bs = jnp.maximum(batch.score_index - 1, 0)
  hidden_bsd = jnp.take_along_axis(hidden_bld, prev_bs[..., None], axis=1)
  logits_bsv = model.logits(hidden_bsd).astype(jnp.float32)
  logz_bs = jax.nn.logsumexp(logits_bsv, axis=-1)
  target_bs = jnp.take_along_axis(batch.tokens, batch.score_index, axis=1)
  logp_bs = jnp.take_along_axis(logits_bsv, target_bs[..., None], axis=-1)[..., 0] - logz_bs
  if not with_entropy:
    return logp_bs, None
  probs_bsv = jnp.exp(logits_bsv - logz_bs[..., None])
  return logp_bs, logz_bs - jnp.sum(probs_bsv * logits_bsv, axis=-1)


class Learner:
  """The actor update of one model on one mesh: state init, log-probs, jitted update.

  Args:
    model: an nnx decoder whose Params carry logical-axis metadata (only its graph
      definition and shardings are taken from it here; pass its params to `init_state`).
    mesh: a mesh with axes `sharding.MESH_AXES` (data, fsdp, tensor).
    config: UpdateConfig.
    rules: logical-axis rules (default `sharding.DEFAULT_RULES`).
  """

  PHASE = "update"  # the name `train_iteration` reports to the progress line

  def __init__(self, model: nnx.Module, mesh: jax.sharding.Mesh, config: UpdateConfig,
               rules: Optional[Sequence] = None):
    self.config = config
    self.mesh = mesh
    self.rules = sharding_lib.DEFAULT_RULES if rules is None else rules
    self.graphdef, params_state = nnx.split(model, nnx.Param)
    self.param_shardings = _pure(sharding_lib.param_shardings(params_state, mesh, self.rules))
    self.tx = make_optimizer(config)
    self.replicated = NamedSharding(mesh, P())
    # Rows follow the "batch" logical axis of the rules (data x fsdp by default).
    row_spec = sharding_lib.logical_to_spec(("batch",), mesh, self.rules)
    row_axes = () if row_spec[0] is None else ((row_spec[0],) if isinstance(row_spec[0], str) else tuple(row_spec[0]))
    self.data_parallel = int(np.prod([mesh.shape[a] for a in row_axes]))
    if config.micro_batch_rows % self.data_parallel:
      raise ValueError(f"micro_batch_rows={config.micro_batch_rows} is not a multiple of the data-parallel size {self.data_parallel} (mesh {dict(mesh.shape)}); command line: --config.train.micro_batch_rows or --config.mesh.*.")
    self.row_sharding = NamedSharding(mesh, P(row_spec[0]))
    self._micro_sharding = NamedSharding(mesh, P(None, row_spec[0]))
    self._abstract = jax.eval_shape(self._init, _pure(params_state))
    self.state_sharding = self.state_shardings(self._abstract)
    # Fixed in/out shardings: the state an update returns has exactly the layout the
    # next call expects, so a second batch of the same bucket never recompiles.
    # (traced with the mesh in context: the splash attention kernel shard_maps over it)
    on_mesh = functools.partial(attention.traced_on, mesh)
    self.update = jax.jit(on_mesh(self._update), donate_argnums=(0,), static_argnums=(2,),
                          in_shardings=(self.state_sharding, self.row_sharding),
                          out_shardings=(self.state_sharding, self.replicated))
    # Length-grouped micro-batches: one gradient program per micro-batch shape, the
    # gradient sum donated from call to call, then the optimizer step.
    self.zero_grads = jax.jit(self._zero_grads, out_shardings=self.param_shardings)
    self.accumulate = jax.jit(on_mesh(self._accumulate), donate_argnums=(1,), static_argnums=(3,),
                              in_shardings=(self.param_shardings, self.param_shardings,
                                            self.row_sharding),
                              out_shardings=(self.param_shardings, self.replicated))
    self.apply_gradients = jax.jit(self._apply_gradients, donate_argnums=(0,),
                                   in_shardings=(self.state_sharding, self.param_shardings,
                                                 self.replicated),
                                   out_shardings=(self.state_sharding, self.replicated))
    self.compute_logprobs = jax.jit(on_mesh(self._compute_logprobs),
                                    in_shardings=(self.param_shardings, self.row_sharding),
                                    out_shardings=self.row_sharding)
    self._init_jit = jax.jit(self._init, out_shardings=self.state_sharding)

  # ---- state ------------------------------------------------------------------------
  def _init(self, params):
    return TrainState(params=params, opt_state=self.tx.init(params), step=jnp.zeros((), jnp.int32))

  def state_shardings(self, abstract: TrainState) -> TrainState:
    """Shardings of every TrainState leaf: optimizer moments follow their params."""
    opt = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract.opt_state, self.param_shardings,
        transform_non_params=lambda _: self.replicated)
    return TrainState(params=self.param_shardings, opt_state=opt, step=self.replicated)

  def abstract_state(self, params: Optional[Any] = None) -> TrainState:
    """ShapeDtypeStructs of the state with target shardings (the checkpoint restore target).

    Args:
      params: optional params (arrays or ShapeDtypeStructs) fixing shapes and dtypes;
        default: those of the model the Learner was built from.
    """
    abstract = self._abstract if params is None else jax.eval_shape(self._init, _pure(params))
    return checkpoint.abstract_state(abstract, self.state_sharding)

  def init_state(self, params: Any) -> TrainState:
    """A sharded TrainState from (host or device) params: eval_shape -> jit(out_shardings).

    Args:
      params: nnx.State of Params or its pure dict (e.g. `nnx.state(model, nnx.Param)`).
    """
    # Single-device / host params go through the host, so jit places them straight into
    # their target shardings; already distributed arrays are resharded by jit itself.
    to_host = lambda x: np.asarray(x) if getattr(x, "is_fully_addressable", True) else x
    return self._init_jit(jax.tree.map(to_host, _pure(params)))

  def reference_params(self, state: TrainState) -> Any:
    """A frozen copy of the current params with the same shardings (call before updating)."""
    return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=self.param_shardings)(state.params)

  # ---- batches ----------------------------------------------------------------------
  def put_batch(self, batch: train_batch_lib.TrainBatch) -> train_batch_lib.TrainBatch:
    """Places a host batch on the mesh, rows split over the data-parallel axes.

    Every process passes the same full (global) batch; each takes its own shards.
    """
    def put(x):
      x = np.asarray(x)
      return jax.make_array_from_callback(x.shape, self.row_sharding, lambda idx: x[idx])
    return jax.tree.map(put, batch)

  def _micro(self, batch: train_batch_lib.TrainBatch) -> train_batch_lib.TrainBatch:
    """[M, ...] -> [k, m, ...] contiguous micro-batches, each split over the data axes."""
    m = self.config.micro_batch_rows
    if batch.num_rows % m:
      raise ValueError(f"batch of {batch.num_rows} rows is not a multiple of micro_batch_rows={m}.")
    k = batch.num_rows // m
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x.reshape(k, m, *x.shape[1:]), self._micro_sharding), batch)

  def _model(self, params):
    return nnx.merge(self.graphdef, params)

  def _compute_logprobs(self, params: Any, batch: train_batch_lib.TrainBatch) -> jax.Array:
    """f32[M, L] log-probs of every token under `params`, micro-batch by micro-batch
    (f32[R, S] of every score slot for a `packing.PackedBatch`)."""
    model = self._model(params)
    micro = self._micro(batch)
    def one(x):
      if isinstance(x, packing.PackedBatch):
        logp, _ = packed_token_logprobs(model, x, with_entropy=False)
        return jnp.where(x.score_mask, logp, 0.0)
      logp, _ = token_logprobs(model, x.tokens, x.positions, x.input_mask, with_entropy=False,
                               scored_tail=self.config.scored_tail)
      return jnp.where(x.response_mask, logp, 0.0)
    logp_kml = jax.lax.map(one, micro)
    return logp_kml.reshape(batch.num_rows, -1)

  # ---- update -----------------------------------------------------------------------
  def _loss_mask(self, x: train_batch_lib.TrainBatch) -> jax.Array:
    """bool[B, L, C]: the entries of each of the loss's C token means (the actor's one: its
    response tokens; `critic_step.CriticLearner` has one per value head)."""
    return x.response_mask[..., None]

  def _loss(self, params, x: train_batch_lib.TrainBatch, on_policy: bool = False,
            weights: Optional[jax.Array] = None):
    """(loss, metrics) of one micro-batch; `critic_step.CriticLearner` replaces it.

    on_policy: log pi_old is this forward pass's own log-prob, detached
    (`UpdateConfig.on_policy`); `x.old_logprobs` is not read.
    weights: f32[B, L, 1] token weights of `unit_weights` (a loss unit other than the
      micro-batch): the loss is the weighted token sum, this micro-batch's share.
    A `packing.PackedBatch` micro-batch gives its weighted share of the mini-batch loss
    (`losses.weighted_actor_loss`).
    """
    if isinstance(x, packing.PackedBatch):
      logp, entropy = packed_token_logprobs(self._model(params), x)
      old = jax.lax.stop_gradient(logp) if on_policy else x.old_logprobs
      return losses.weighted_actor_loss(logp, entropy, old, x.ref_logprobs, x.advantages,
                                        x.loss_weights, self.config.loss)
    logp, entropy = token_logprobs(self._model(params), x.tokens, x.positions, x.input_mask,
                                   scored_tail=self.config.scored_tail)
    old = jax.lax.stop_gradient(logp) if on_policy else x.old_logprobs
    if weights is not None:
      return losses.weighted_actor_loss(logp, entropy, old, x.ref_logprobs, x.advantages,
                                        weights[..., 0], self.config.loss)
    return losses.actor_loss(logp, entropy, old, x.ref_logprobs, x.advantages,
                             x.response_mask, self.config.loss)

  def _update(self, state: TrainState, batch: train_batch_lib.TrainBatch, on_policy: bool = False):
    """One optimizer step on a mini-batch [M, L]; returns (new state, f32[] metrics).

    on_policy (static): old log-probs from the step's own forward pass (see `_loss`);
    valid only for the first step from the params that played the rollout.
    """
    micro = self._micro(batch)
    packed = isinstance(batch, packing.PackedBatch)
    scored = batch.score_mask if packed else batch.response_mask
    active_k = jnp.any((micro.score_mask if packed else micro.response_mask), axis=(1, 2))
    # A loss unit other than the micro-batch: token weights over the whole mini-batch.
    weighted = not packed and self.config.unit_weighted
    weights_k = None
    if weighted:
      weights = unit_weights(self._loss_mask(batch), self.config.loss_unit)
      m = self.config.micro_batch_rows
      weights_k = jax.lax.with_sharding_constraint(
          weights.reshape(weights.shape[0] // m, m, *weights.shape[1:]), self._micro_sharding)
    # packed or weighted micro-batch losses and metrics are shares of the mini-batch's: summed
    n_active = (1.0 if packed or weighted
                else jnp.maximum(jnp.sum(active_k), 1).astype(jnp.float32))

    def micro_step(grads, xs):
      x, active, w = xs
      (_, metrics), g = jax.value_and_grad(self._loss, has_aux=True)(
          state.params, x, on_policy, *(() if w is None else (w,)))
      scale = jnp.where(active, 1.0 / n_active, 0.0)
      grads = jax.tree.map(lambda a, b: a + scale * b, grads, g)
      return grads, metrics

    # Accumulate in f32 whatever the param dtype (bf16 sums of k terms lose bits), then
    # hand the optimizer grads in the param dtype so its state keeps a fixed dtype.
    grads, metrics_k = jax.lax.scan(micro_step, self._zero_grads(state.params),
                                    (micro, active_k, weights_k))
    metrics = {name: jnp.sum(jnp.where(active_k, v, 0.0)) / n_active for name, v in metrics_k.items()}
    metrics["scored_tokens"] = jnp.sum(scored).astype(jnp.float32)
    return self._apply_gradients(state, grads, metrics)

  def _zero_grads(self, params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

  def _apply_gradients(self, state: TrainState, grads: Any, metrics: dict):
    """Clipping and AdamW on the summed f32 gradients of a mini-batch; `metrics` (the
    mini-batch's loss metrics and `scored_tokens`) gain the step's own."""
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # verl skips the optimizer step when the gradient norm is not finite.
    finite = jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
    metrics = dict(metrics, grad_norm=grad_norm, skipped_step=1.0 - finite.astype(jnp.float32),
                   learning_rate=learning_rate_schedule(self.config)(state.step))
    new_state = state.replace(params=params, opt_state=opt_state,
                              step=state.step + finite.astype(jnp.int32))
    return new_state, metrics

  def _accumulate(self, params, grads, x: packing.PackedBatch, on_policy: bool = False):
    """grads + the gradient of one packed micro-batch's weighted loss share, and that
    share's metrics (with `scored_tokens`)."""
    (_, metrics), g = jax.value_and_grad(self._loss, has_aux=True)(params, x, on_policy)
    grads = jax.tree.map(lambda a, b: a + b, grads, g)
    metrics = dict(metrics, scored_tokens=jnp.sum(x.score_mask).astype(jnp.float32))
    return grads, metrics

  def update_micro_batches(self, state: TrainState, micro_batches: Sequence[packing.PackedBatch],
                           on_policy: bool = False):
    """One optimizer step on a mini-batch given as packed micro-batches of any shapes
    (`packing.group_mini_batch`), placed on the mesh; returns (new state, metrics).

    Each micro-batch runs its own compiled gradient program (one per shape), adding to a
    donated f32 gradient sum; the metrics, weighted shares of the mini-batch's, are summed.
    Donates `state`, like `update`.
    """
    if not micro_batches:
      raise ValueError("a mini-batch needs at least one micro-batch")
    grads, total = self.zero_grads(state.params), None
    for x in micro_batches:
      grads, metrics = self.accumulate(state.params, grads, x, on_policy)
      total = metrics if total is None else jax.tree.map(jnp.add, total, metrics)
    return self.apply_gradients(state, grads, total)


def unit_weights(mask_mlc: jax.Array, unit_rows: int) -> jax.Array:
  """f32[M, L, C] token weights of a mini-batch whose loss unit is `unit_rows` rows.

  With `U` the units (consecutive `unit_rows` rows) that score an entry, `n_uc` the scored
  entries of unit u in channel c (the actor: C = 1, its response tokens; the critic: one
  channel per value head) and `w_t = 1 / (U * n_uc)` on the scored entries (0 elsewhere),

      sum_t w_t x_t = (1 / U) sum_u sum_c token-mean_{u,c}(x),

  verl's loss (per-GPU micro-batch token means, / gradient accumulation, averaged over
  GPUs), whatever the micro-batches of the update are. With units equal to micro-batches
  it is the unweighted update's mean over active micro-batches.

  Args:
    mask_mlc: bool[M, L, C] scored entries; M a multiple of unit_rows.
    unit_rows: rows per unit.
  """
  mask = mask_mlc.astype(jnp.float32)
  rows, channels = mask.shape[0], mask.shape[-1]
  counts_uc = mask.reshape(rows // unit_rows, -1, channels).sum(axis=1)
  active = jnp.maximum(jnp.sum(jnp.any(counts_uc > 0, axis=-1)), 1).astype(jnp.float32)
  inv_uc = jnp.where(counts_uc > 0, 1.0 / (active * jnp.maximum(counts_uc, 1.0)), 0.0)
  return jnp.repeat(inv_uc, unit_rows, axis=0)[:, None, :] * mask


def _rows(batch: train_batch_lib.TrainBatch, size: int):
  if batch.num_rows % size:
    raise ValueError(f"batch has {batch.num_rows} rows, not a multiple of mini_batch_rows={size}; build it with row_multiple=mini_batch_rows.")
  for start in range(0, batch.num_rows, size):
    yield train_batch_lib.slice_rows(batch, start, start + size)


# An iteration's rows: one TrainBatch (split into mini-batches of mini_batch_rows), or its
# mini-batches already laid out: packed (`packing.pack_batch`: a PackedBatch each) or
# length-grouped (`packing.group_batch`: a tuple of micro-batch PackedBatches each).
Batches = train_batch_lib.TrainBatch | Sequence[packing.PackedBatch | tuple[packing.PackedBatch, ...]]


def mini_batches(learner: Learner, batch: Batches) -> list:
  """The iteration's mini-batches, in update order (a batch of rows, e.g. a TrainBatch or
  a critic's ValueBatch, is split; a list of packed or length-grouped mini-batches is
  taken as it is)."""
  if isinstance(batch, (list, tuple)):
    return list(batch)
  return list(_rows(batch, learner.config.mini_batch_rows))


def fill_logprobs(learner: Learner, params: Any, ref_params: Optional[Any],
                  batch: Batches, *, old: bool = True) -> Batches:
  """Returns the host batch with `old_logprobs` (and `ref_logprobs` if ref_params) filled.

  Runs mini-batch by mini-batch so every call has the compiled [mini_batch, L] shape
  (a list of packed mini-batches is filled one by one and returned as a list; a
  length-grouped mini-batch micro-batch by micro-batch, each in its own shape).
  old=False leaves `old_logprobs` as it is (an on-policy update computes its own, see
  `UpdateConfig.on_policy`).
  """
  filled = []
  for chunk in mini_batches(learner, batch):
    if isinstance(chunk, tuple):  # length-grouped: micro-batch by micro-batch
      filled.append(tuple(fill_logprobs(learner, params, ref_params, list(chunk), old=old)))
      continue
    dev = learner.put_batch(chunk)
    if old:
      chunk = chunk.replace(old_logprobs=_to_host(learner.compute_logprobs(params, dev)))
    if ref_params is not None:
      chunk = chunk.replace(ref_logprobs=_to_host(learner.compute_logprobs(ref_params, dev)))
    filled.append(chunk)
  if isinstance(batch, (list, tuple)):
    return filled
  return jax.tree.map(lambda *xs: np.concatenate(xs), *filled)


def _to_host(x: jax.Array) -> np.ndarray:
  """A fully addressable (or replicated-across-processes) array as numpy."""
  if x.is_fully_addressable:
    return np.asarray(x)
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def train_iteration(learner: Learner, state: TrainState, batch: Batches,
                    *, on_policy: bool = False):
  """ppo_epochs x (rows / mini_batch_rows) updates over a filled host batch, in row order.

  on_policy: the iteration is one optimizer step whose old log-probs the update computes
  itself (`UpdateConfig.on_policy`; the batch's `old_logprobs` are not read).

  Returns:
    (state, metrics): metrics are the means over the optimizer steps, plus `num_updates`.
  """
  chunks = mini_batches(learner, batch)
  if on_policy and not (learner.config.on_policy(learner.config.mini_batch_rows) and len(chunks) == 1):
    raise ValueError(f"on_policy needs one optimizer step per iteration: ppo_epochs=1 and "
                     f"<= mini_batch_rows rows (got ppo_epochs={learner.config.ppo_epochs}, "
                     f"{len(chunks)} mini-batches)")
  history = []
  total = learner.config.ppo_epochs * len(chunks)
  for _ in range(learner.config.ppo_epochs):
    for chunk in chunks:
      progress.phase(learner.PHASE, f"mini-batch {len(history) + 1}/{total}")
      if isinstance(chunk, tuple):  # length-grouped micro-batches
        state, metrics = learner.update_micro_batches(
            state, [learner.put_batch(x) for x in chunk], on_policy)
      elif on_policy:
        state, metrics = learner.update(state, learner.put_batch(chunk), True)  # on_policy
      else:
        state, metrics = learner.update(state, learner.put_batch(chunk))
      history.append(metrics)
  host = jax.device_get(history)
  mean = {k: float(np.mean([h[k] for h in host])) for k in host[0]}
  mean["num_updates"] = float(len(host))
  return state, mean
