"""The sharded PPO actor update: train state, old/reference log-probs, donated jitted step.

Flow of one iteration (docs/algorithms.md §9):
  1. `fill_logprobs`: log pi_old (current params) and log pi_ref (frozen initial params)
     of every scored token, computed in micro-batches, before any update.
  2. For each PPO epoch and each mini-batch (in order: verl `shuffle=False`), `update`:
     the mini-batch of M rows is split into k = M / m contiguous micro-batches; a
     `lax.scan` accumulates the gradients of each micro-batch's share of the mini-batch
     loss, `loss_i / k_active` (verl divides each micro-batch loss by the accumulation
     count, so the optimiser sees the *mean of micro-batch losses*, e.g. the mean of
     micro-batch token means under `token-mean`, not a global token mean; under
     `token-mean` the share is the layout's weighted token sum, below); then global-norm
     clipping and AdamW.

Micro-batches are *global*: a micro-batch of m rows is sharded over the data-parallel
axes (`data` x `fsdp`), and its token-mean is taken over all m rows. The result is
therefore the same on any mesh (1 device or 8), and equals verl's arithmetic with one
GPU; verl with G GPUs averages G per-GPU token means instead.

k_active: micro-batches with no scored token (all-padding, see `train_batch`) add
nothing and are not counted; without padding k_active = k exactly as in verl.

One layout (`train_batch.SegmentBatch`): every log-prob pass and every update step reads
token rows of segments with the scored tokens in score slots and per-slot loss weights
that make each micro-batch's loss its share of the mini-batch loss (under `token-mean`,
the mean of micro-batch means above as a weighted token sum, `train_batch.unit_weights`).
An unpacked mini-batch is one segment per row (laid out on the device by
`TrainBatch.segments`); packing puts several segments in a row; length grouping gives a
mini-batch as several parts of their own row lengths (`training.packing`). A mini-batch
is a tuple of parts: one part goes through the `lax.scan` above (`update`), several
through `update_mini_batch`: one compiled gradient program per part shape adding to a
donated f32 gradient sum, then one compiled optimizer step (`apply_gradients`).
`fill_logprobs` leaves the laid-out mini-batches on the mesh with their log-probs, so
the update reads them there.

Memory: the state holds params + 2 AdamW moments (3x params, f32), sharded by the
model's logical rules. The reference policy is a fourth copy of the params with the
same shardings: for SmolLM2-135M that is 0.54 GB extra in f32; with FSDP it is divided
over the fsdp devices. It stays on the mesh by default; `reference_memory="host"` keeps
it in the devices' pinned host memory and copies it in for each reference pass (verl's
`ref.fsdp_config.param_offload=True`), and `reference_dtype="bfloat16"` halves it.

State creation follows big_vision: `eval_shape(init)` -> shardings ->
`jit(init, out_shardings=...)`, so the optimizer state is born sharded.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hgpo_jax import progress
from hgpo_jax import registry
from hgpo_jax.models import attention
from hgpo_jax.models import decoder as decoder_lib
from hgpo_jax.models import lora as lora_lib
from hgpo_jax.models import sharding as sharding_lib
from hgpo_jax.training import checkpoint
from hgpo_jax.training import losses
from hgpo_jax.training import train_batch as train_batch_lib

REFERENCE_DTYPES = ("auto", "", "float32", "bfloat16")
"""Values of `UpdateConfig.reference_dtype` (`resolve_reference_dtype`)."""


def resolve_reference_dtype(name: str, compute_dtype: str) -> str:
  """The frozen reference's parameter dtype, "" for the parameters' own: "auto" is
  bfloat16 when the policy computes in bfloat16 (its products read bf16-rounded weights
  anyway; verl loads its reference in bf16, `fsdp_workers.py`: `torch_dtype` bf16 for
  every role but the actor) and "" otherwise, so float32 runs (CPU) keep an unrounded
  reference; else `name`."""
  if name not in REFERENCE_DTYPES:
    raise ValueError(f"reference_dtype={name!r}: use one of {REFERENCE_DTYPES}")
  if name == "auto":
    return "bfloat16" if compute_dtype == "bfloat16" else ""
  return name
REFERENCE_MEMORIES = ("device", "host")
"""Values of `UpdateConfig.reference_memory`."""
LR_SCHEDULES = registry.Registry("learning rate schedule")
"""Values of `UpdateConfig.lr_schedule` (verl `optim.warmup_style`) -> `fn(config:
UpdateConfig, iteration: int) -> float`, the learning rate of a 0-based iteration, warmup
included (`iteration_learning_rate`). Filled below `iteration_learning_rate`; every
schedule but "constant" reads `total_iterations`."""


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  """Optimizer, batching and loss options of the actor update (defaults: docs/algorithms.md §9)."""

  lr: float = 1e-6
  """Peak (and, with the constant schedule after warmup, constant) learning rate of AdamW."""
  lr_schedule: str = "constant"
  """A name of LR_SCHEDULES: the learning rate per iteration (`iteration_learning_rate`)."""
  warmup_steps: int = -1
  """Iterations of linear warmup (verl `lr_warmup_steps`, one scheduler step per
  iteration); < 0: `warmup_ratio` of `total_iterations`."""
  warmup_ratio: float = 0.0
  """Warmup as a fraction of `total_iterations` (verl `lr_warmup_steps_ratio`)."""
  min_lr_ratio: float = 0.0
  """cosine: the floor of the decay and the start of the warmup, a fraction of `lr`."""
  total_iterations: int = 0
  """Iterations of the run (`train.num_iterations`): the length of the cosine and of
  `warmup_ratio`."""
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
  """Score slots of an unpacked row: its last `scored_tail` columns (the response bucket),
  so the output layer is skipped on prompt positions (`TrainBatch.segments`). None: every
  column but the first."""
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
  them one by one (`Learner.update_mini_batch`); needs `loss.loss_agg == "token-mean"`."""
  length_multiple: int = 128
  """With `group_by_length`: micro-batch row lengths are rounded up to a multiple of this
  (fewer distinct lengths, fewer compiled programs; more padding)."""
  skip_zero_advantage: bool = False
  """With `pack_rows` or `group_by_length`: the update leaves out the steps whose scored
  tokens all have advantage exactly 0, which add exact zeros to the gradient
  (`training.packing`): the same optimizer step up to float summation order, less update
  time when whole groups score alike. Needs a loss whose every term carries the
  advantage (no KL loss, `entropy_coeff` 0). The `entropy` and `approx_kl` metrics then
  average over the updated tokens (`updated_weight`: their share of the loss's token
  weight); the loss, its other metrics and the gradient are the whole mini-batch's."""
  reference_dtype: str = ""
  """dtype of the frozen reference policy's parameters (the KL anchor): "" keeps the
  parameters' dtype; "bfloat16" halves its bytes per device (its log-probs are computed
  in the compute dtype from bf16-rounded weights); "auto" is bfloat16 when the policy
  computes in bfloat16, else "" (`resolve_reference_dtype`)."""
  reference_memory: str = "device"
  """Where the frozen reference policy's parameters live between its log-prob passes:
  "device" (in accelerator memory, beside the policy) or "host" (the host memory of each
  device, `pinned_host`; each reference log-prob pass copies them onto the devices and
  drops the copy when it ends: one model's bytes less per device through the rollout and
  the update, a host-to-device copy per pass). verl-agent's scripts offload the reference
  the same way (`actor_rollout_ref.ref.fsdp_config.param_offload=True`)."""
  loss_unit_rows: int = 0
  """Rows per loss unit: the mini-batch loss is the mean over its units (of consecutive
  rows) that score a token of each unit's own aggregate, whatever the micro-batches are
  (verl: a unit is a per-GPU micro-batch, averaged over gradient accumulation and GPUs).
  0: `micro_batch_rows` (the unit is the global micro-batch). A unit other than the
  micro-batch needs `token-mean` (`train_batch.unit_weights`)."""

  def __post_init__(self):
    if self.skip_zero_advantage:
      if not (self.pack_rows or self.group_by_length):
        raise ValueError("skip_zero_advantage lays out the update's rows: it needs pack_rows "
                         "or group_by_length")
      if self.loss.kl_in_loss or self.loss.entropy_coeff:
        raise ValueError(f"skip_zero_advantage is exact only for a loss whose every term "
                         f"carries the advantage: set use_kl_loss=false (or kl_coef=0) and "
                         f"entropy_coeff=0 (got kl_coef={self.loss.kl_coef}, use_kl_loss="
                         f"{self.loss.use_kl_loss}, entropy_coeff={self.loss.entropy_coeff})")
    for name in ("pack_rows", "group_by_length"):
      if getattr(self, name) and self.loss.loss_agg != "token-mean":
        raise ValueError(f"{name} needs loss_agg='token-mean' (the packed loss is its weighted "
                         f"token sum), got {self.loss.loss_agg!r}")
    if self.pack_rows and self.group_by_length:
      raise ValueError("pack_rows and group_by_length are two layouts of the update's rows: "
                       "set one of them")
    resolve_reference_dtype(self.reference_dtype, "")  # raises for an unknown name
    if self.reference_memory not in REFERENCE_MEMORIES:
      raise ValueError(f"reference_memory={self.reference_memory!r}: use one of "
                       f"{REFERENCE_MEMORIES}")
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
    try:
      LR_SCHEDULES.get(self.lr_schedule)
    except KeyError as e:
      raise ValueError(f"lr_schedule={self.lr_schedule!r}: {e.args[0]}") from None
    if not 0.0 <= self.warmup_ratio < 1.0 or not 0.0 <= self.min_lr_ratio <= 1.0:
      raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1) and min_lr_ratio="
                       f"{self.min_lr_ratio} in [0, 1]")
    if self.warmup_steps >= 0 and self.warmup_ratio > 0:
      raise ValueError(f"warmup_steps={self.warmup_steps} and warmup_ratio={self.warmup_ratio}: "
                       f"set one of them (warmup_steps=-1 reads warmup_ratio)")
    if (self.lr_schedule != "constant" or self.warmup_ratio > 0) and self.total_iterations < 1:
      raise ValueError(f"lr_schedule={self.lr_schedule!r} / warmup_ratio={self.warmup_ratio} "
                       f"need total_iterations >= 1, got {self.total_iterations}")

  @property
  def warmup_iterations(self) -> int:
    """Iterations of warmup: `warmup_steps`, or `warmup_ratio` of the run (verl: int())."""
    if self.warmup_steps >= 0:
      return self.warmup_steps
    return int(self.warmup_ratio * self.total_iterations)

  @property
  def scheduled(self) -> bool:
    """Whether the learning rate changes over the run (the optimizer then holds it as a
    hyperparameter that the trainer sets each iteration, `Learner.with_learning_rate`)."""
    return self.lr_schedule != "constant" or self.warmup_iterations > 0

  @property
  def loss_unit(self) -> int:
    """Rows per loss unit (`loss_unit_rows`, 0 meaning `micro_batch_rows`)."""
    return self.loss_unit_rows or self.micro_batch_rows

  @property
  def unit_weighted(self) -> bool:
    """Whether the loss unit differs from the micro-batch (the critic then weights its
    tokens, `train_batch.unit_weights`, instead of averaging micro-batch aggregates)."""
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


def check_reference_with_adapters(config: UpdateConfig, adapters: bool) -> None:
  """With LoRA adapters the reference is the frozen base with the adapters off (no copy),
  so the reference's placement and dtype settings must stay at their defaults (ValueError
  otherwise)."""
  if adapters and (config.reference_memory != "device"
                   or config.reference_dtype not in ("", "auto")):
    raise ValueError(f"reference_memory={config.reference_memory!r} / reference_dtype="
                     f"{config.reference_dtype!r} do not apply with LoRA: the reference is "
                     f"the frozen base with the adapters off (no copy); leave the defaults")


def make_optimizer(config: UpdateConfig) -> optax.GradientTransformation:
  """clip_by_global_norm(grad_clip) then AdamW: with a constant lr, or (`scheduled`) with
  its learning rate a hyperparameter in the optimizer state, set per iteration."""
  adamw = optax.inject_hyperparams(optax.adamw) if config.scheduled else optax.adamw
  lr = config.lr if config.scheduled else learning_rate_schedule(config)
  return optax.chain(
      optax.clip_by_global_norm(config.grad_clip),
      adamw(lr, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay))


def learning_rate_schedule(config: UpdateConfig) -> optax.Schedule:
  """The constant learning rate of an unscheduled optimizer."""
  return optax.constant_schedule(config.lr)


def iteration_learning_rate(config: UpdateConfig, iteration: int) -> float:
  """The learning rate of 0-based `iteration`, verl's schedulers stepped once per iteration
  (verl/utils/torch_functional.py, with W warmup iterations, N = total_iterations,
  m = min_lr_ratio):

    constant: lr * min(1, i / max(1, W))                 (`get_constant_schedule_with_warmup`)
    cosine:   lr * (m + (1 - m) i / max(1, W))            for i < W
              lr * max(m, (1 + m)/2 + (1 - m)/2 cos(pi p)),  p = (i - W) / max(1, N - W)
                                                          (`get_cosine_schedule_with_warmup`,
                                                           num_cycles 0.5)

  Each schedule is a function of LR_SCHEDULES.
  """
  return LR_SCHEDULES.get(config.lr_schedule)(config, iteration)


def constant_learning_rate(config: UpdateConfig, iteration: int) -> float:
  """lr after a linear warmup from 0 (verl `get_constant_schedule_with_warmup`)."""
  return config.lr * min(1.0, iteration / max(1, config.warmup_iterations))


def cosine_learning_rate(config: UpdateConfig, iteration: int) -> float:
  """A half cosine from lr down to min_lr_ratio * lr after a linear warmup from
  min_lr_ratio * lr (verl `get_cosine_schedule_with_warmup`, num_cycles 0.5)."""
  w, n, m = config.warmup_iterations, config.total_iterations, config.min_lr_ratio
  if iteration < w:
    return config.lr * (m + (1.0 - m) * iteration / max(1, w))
  progress_frac = (iteration - w) / max(1, n - w)
  return config.lr * max(m, 0.5 * (1.0 + m) + 0.5 * (1.0 - m) * math.cos(math.pi * progress_frac))


LR_SCHEDULES.register("constant", constant_learning_rate)
LR_SCHEDULES.register("cosine", cosine_learning_rate)


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
    """The pytree that `checkpoint.Checkpointer` saves: with LoRA adapters only the trained
    params (`lora.trainable_params`), not the frozen base."""
    return {"params": lora_lib.trainable_params(self.params), "opt_state": self.opt_state,
            "step": self.step}

  @classmethod
  def from_checkpoint(cls, tree: dict, like: Optional["TrainState"] = None) -> "TrainState":
    """The state of a saved tree; `like` (the run's initial state) supplies the frozen base
    that a LoRA checkpoint leaves out."""
    params = tree["params"] if like is None else lora_lib.with_frozen(tree["params"], like.params)
    return cls(params=params, opt_state=tree["opt_state"], step=tree["step"])


class AdaptersOff:
  """The reference policy of a policy with LoRA adapters: its own frozen base with the
  adapters off (verl's `ref_in_actor`), read from the current params: no copy, so
  `UpdateConfig.reference_dtype` / `reference_memory` do not apply."""


ADAPTERS_OFF = AdaptersOff()


def _pure(tree: Any) -> Any:
  """A pure nested dict from an nnx.State (or the tree itself if already pure)."""
  return nnx.to_pure_dict(tree) if isinstance(tree, nnx.State) else tree


def scored_logprobs(model: nnx.Module, batch: train_batch_lib.SegmentBatch,
                    with_entropy: bool = True):
  """Log-prob (and full-softmax entropy) of each score slot's token given the tokens before
  it in its segment: the one log-prob function of the update (old, reference and current).

  Segments attend to themselves only and count positions from 0, so a slot's value is the
  one its token gets in a row of its own; the token in column l is predicted from
  position l - 1 (the `train_batch` convention), and the output layer runs on the slots
  only (for an unpacked row: its response columns, not the [B, P, V] prompt logits).

  Args:
    model: the decoder (`hidden(...)`, `logits(hidden)`).
    batch: a SegmentBatch (`train_batch`): tokens, positions, segment_ids [R, L];
      score_index [R, S].
    with_entropy: also return the entropy (else None).

  Returns:
    (logp_rs f32[R, S], entropy_rs f32[R, S] or None); unused slots hold garbage (mask
    them with `score_mask`).
  """
  hidden_rld, _ = model.hidden(batch.tokens, batch.positions, batch.segment_ids)
  prev_rs = jnp.maximum(batch.score_index - 1, 0)
  hidden_rsd = jnp.take_along_axis(hidden_rld, prev_rs[..., None], axis=1)
  logits_rsv = model.logits(hidden_rsd).astype(jnp.float32)
  logz_rs = jax.nn.logsumexp(logits_rsv, axis=-1)
  target_rs = jnp.take_along_axis(batch.tokens, batch.score_index, axis=1)
  target_logit_rs = jnp.take_along_axis(logits_rsv, target_rs[..., None], axis=-1)[..., 0]
  if batch.choices is not None:
    return _constrained_logprobs(logits_rsv, logz_rs, target_logit_rs, batch.choices,
                                 with_entropy)
  logp_rs = target_logit_rs - logz_rs
  if not with_entropy:
    return logp_rs, None
  probs_rsv = jnp.exp(logits_rsv - logz_rs[..., None])
  return logp_rs, logz_rs - jnp.sum(probs_rsv * logits_rsv, axis=-1)


def _constrained_logprobs(logits_rsv, logz_rs, target_logit_rs, choices_rsk, with_entropy):
  """`scored_logprobs` under the constraint: at a slot with allowed ids (`choices_rsk`, -1
  padded) the log-softmax and entropy run over those ids only, the distribution the
  constrained sampler drew from (at temperature 1); a slot without any keeps the full
  softmax (`logz_rs`)."""
  valid_rsk = choices_rsk >= 0
  chosen_rsk = jnp.take_along_axis(logits_rsv, jnp.maximum(choices_rsk, 0), axis=-1)
  chosen_rsk = jnp.where(valid_rsk, chosen_rsk, -jnp.inf)
  constrained_rs = jnp.any(valid_rsk, axis=-1)
  safe_rsk = jnp.where(constrained_rs[..., None], chosen_rsk, 0.0)  # no all -inf row
  logz_c_rs = jax.nn.logsumexp(safe_rsk, axis=-1)
  logp_rs = target_logit_rs - jnp.where(constrained_rs, logz_c_rs, logz_rs)
  if not with_entropy:
    return logp_rs, None
  probs_rsv = jnp.exp(logits_rsv - logz_rs[..., None])
  full_rs = logz_rs - jnp.sum(probs_rsv * logits_rsv, axis=-1)
  probs_rsk = jnp.where(valid_rsk, jnp.exp(safe_rsk - logz_c_rs[..., None]), 0.0)
  inner_rs = logz_c_rs - jnp.sum(probs_rsk * jnp.where(valid_rsk, safe_rsk, 0.0), axis=-1)
  return logp_rs, jnp.where(constrained_rs, inner_rs, full_rs)


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
    # "" or the dtype the reference's floating params are cast to (`resolve_reference_dtype`
    # against the model's compute dtype)
    self.reference_dtype = resolve_reference_dtype(
        config.reference_dtype, getattr(getattr(model, "cfg", None), "dtype", ""))
    self.graphdef, params_state = nnx.split(model, nnx.Param)
    self.param_shardings = _pure(sharding_lib.param_shardings(params_state, mesh, self.rules))
    # With LoRA adapters the optimizer, its clipping, the gradients and the checkpoints see
    # only the adapters (and value heads), `lora.trainable_params`: the base is frozen.
    self.adapters = lora_lib.has_adapters(self.param_shardings)
    self.trained_shardings = lora_lib.trainable_params(self.param_shardings)
    check_reference_with_adapters(config, self.adapters)
    if self.adapters:
      self.reference_dtype = ""
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
    # A mini-batch of several parts (length grouping): one gradient program per part
    # shape, the gradient sum donated from call to call, then the optimizer step.
    self.zero_grads = jax.jit(self._zero_grads, out_shardings=self.trained_shardings)
    self.accumulate = jax.jit(on_mesh(self._accumulate), donate_argnums=(1,), static_argnums=(3,),
                              in_shardings=(self.param_shardings, self.trained_shardings,
                                            self.row_sharding),
                              out_shardings=(self.trained_shardings, self.replicated))
    self.apply_gradients = jax.jit(self._apply_gradients, donate_argnums=(0,),
                                   in_shardings=(self.state_sharding, self.trained_shardings,
                                                 self.replicated),
                                   out_shardings=(self.state_sharding, self.replicated))
    self.compute_logprobs = jax.jit(on_mesh(self._compute_logprobs),
                                    in_shardings=(self.param_shardings, self.row_sharding),
                                    out_shardings=self.row_sharding)
    self.reference_shardings = self._reference_shardings(mesh)
    if self.config.reference_memory == "host":
      self.compute_reference_logprobs = jax.jit(
          on_mesh(self._compute_offloaded_logprobs),
          in_shardings=(self.reference_shardings, self.row_sharding),
          out_shardings=self.row_sharding)
    elif self.adapters:  # the base's log-probs, the adapters dropped from the params
      self.base_graphdef = decoder_lib.base_graphdef(model.cfg)
      self.compute_reference_logprobs = jax.jit(
          on_mesh(self._compute_base_logprobs),
          in_shardings=(self.param_shardings, self.row_sharding),
          out_shardings=self.row_sharding)
    else:
      self.compute_reference_logprobs = self.compute_logprobs
    self.lay_out = jax.jit(self._layout, in_shardings=(self.row_sharding,),
                           out_shardings=self.row_sharding)
    self._init_jit = jax.jit(self._init, out_shardings=self.state_sharding)

  # ---- state ------------------------------------------------------------------------
  def _init(self, params):
    return TrainState(params=params, opt_state=self.tx.init(lora_lib.trainable_params(params)),
                      step=jnp.zeros((), jnp.int32))

  def state_shardings(self, abstract: TrainState) -> TrainState:
    """Shardings of every TrainState leaf: optimizer moments follow their params."""
    opt = optax.tree_map_params(
        self.tx, lambda _, s: s, abstract.opt_state, self.trained_shardings,
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
    """A frozen copy of the current params with the same shardings (call before updating),
    floating leaves in `self.reference_dtype` when set, in the memory of
    `UpdateConfig.reference_memory` (the devices' host memory for "host"). With LoRA
    adapters `ADAPTERS_OFF`: the policy's own base is the reference."""
    if self.adapters:
      return ADAPTERS_OFF
    return jax.jit(lambda p: jax.tree.map(self._to_reference, p),
                   out_shardings=self.reference_shardings)(state.params)

  def with_learning_rate(self, state: TrainState, iteration: int) -> TrainState:
    """`state` with the learning rate of `iteration` (`iteration_learning_rate`) in its
    optimizer state; `state` itself when the learning rate is constant."""
    if not self.config.scheduled:
      return state
    clip_state, adamw_state = state.opt_state
    old = adamw_state.hyperparams["learning_rate"]
    lr = jax.device_put(np.asarray(iteration_learning_rate(self.config, iteration), old.dtype),
                        old.sharding)
    hyperparams = dict(adamw_state.hyperparams, learning_rate=lr)
    return state.replace(opt_state=(clip_state, adamw_state._replace(hyperparams=hyperparams)))

  def _reference_shardings(self, mesh: jax.sharding.Mesh) -> Any:
    """The reference's shardings: the params' layout, in host memory when offloaded."""
    if self.config.reference_memory != "host":
      return self.param_shardings
    device = mesh.devices.flat[0]
    kinds = {m.kind for m in device.addressable_memories()}
    if "pinned_host" not in kinds:
      raise ValueError(f"reference_memory='host': the mesh's {device.platform} devices have no "
                       f"pinned_host memory (they have {sorted(kinds)}); use 'device'")
    return jax.tree.map(lambda s: s.with_memory_kind("pinned_host"), self.param_shardings)

  def _compute_offloaded_logprobs(self, ref_params, x):
    """Log-probs of the host-resident reference: its params copied onto the devices (the
    params' device shardings) for this pass only."""
    on_device = jax.tree.map(lambda s: s.with_memory_kind("device"), self.param_shardings)
    return self._compute_logprobs(jax.device_put(ref_params, on_device), x)

  def _to_reference(self, x):
    dtype = self.reference_dtype
    if dtype and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return jnp.copy(x)

  def abstract_reference(self, params: Any) -> Any:
    """The reference params' `jax.ShapeDtypeStruct`s (with their shardings and memory) for
    `params`."""
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, jax.eval_shape(self._to_reference, a).dtype,
                                          sharding=s), params, self.reference_shardings)

  # ---- batches ----------------------------------------------------------------------
  def put_batch(self, batch: Any) -> Any:
    """Places a batch on the mesh, rows split over the data-parallel axes.

    Every process passes the same full (global) batch; each takes its own shards. Arrays
    already on the mesh in that layout (`fill_logprobs`' results) stay where they are.
    """
    def put(x):
      if isinstance(x, jax.Array) and x.sharding == self.row_sharding:
        return x
      x = np.asarray(x)
      return jax.make_array_from_callback(x.shape, self.row_sharding, lambda idx: x[idx])
    return jax.tree.map(put, batch)

  def _micro(self, batch: Any) -> Any:
    """[M, ...] -> [k, m, ...] contiguous micro-batches, each split over the data axes."""
    m = self.config.micro_batch_rows
    if batch.num_rows % m:
      raise ValueError(f"batch of {batch.num_rows} rows is not a multiple of micro_batch_rows={m}.")
    k = batch.num_rows // m
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x.reshape(k, m, *x.shape[1:]), self._micro_sharding), batch)

  def _model(self, params):
    return nnx.merge(self.graphdef, params)

  def _layout(self, batch: Any) -> train_batch_lib.SegmentBatch:
    """A mini-batch (part) as the loss reads it: the actor's SegmentBatch (a TrainBatch
    is laid out one segment per row); `critic_step.CriticLearner` keeps its rows."""
    return batch.segments(self.config.scored_tail, self.config.loss_unit,
                          with_rollout=self.reads_rollout_logprobs)

  @property
  def reads_rollout_logprobs(self) -> bool:
    """Whether the loss reads the sampler's log-probs (`rollout_is` / `rollout_rs`): only
    then does the laid-out batch carry them to the update."""
    loss = self.config.loss
    return loss.rollout_is != "none" or loss.rollout_rs != "none"

  def _compute_logprobs(self, params: Any, batch: Any, graphdef=None) -> jax.Array:
    """f32[R, S] log-probs of every score slot under `params` (0 on unused slots),
    micro-batch by micro-batch; `graphdef`: another model's structure for `params`."""
    model = self._model(params) if graphdef is None else nnx.merge(graphdef, params)
    batch = self._layout(batch)
    def one(x):
      logp, _ = scored_logprobs(model, x, with_entropy=False)
      return jnp.where(x.score_mask, logp, 0.0)
    return jax.lax.map(one, self._micro(batch)).reshape(batch.num_rows, -1)

  def _compute_base_logprobs(self, params: Any, batch: Any) -> jax.Array:
    """`_compute_logprobs` of the frozen base: the adapters dropped from `params`."""
    return self._compute_logprobs(lora_lib.without_adapters(params), batch, self.base_graphdef)

  # ---- update -----------------------------------------------------------------------
  @property
  def weighted_loss(self) -> bool:
    """Whether each micro-batch's loss is already its share of the mini-batch loss (the
    layout's `loss_weights`, token-mean), so the update sums micro-batch losses; else
    (the `seq-mean-*` modes) it averages them over the micro-batches that score a token."""
    return self.config.loss.loss_agg == "token-mean"

  def _loss_mask(self, x: Any) -> jax.Array:
    """bool[B, S, C]: the entries of each of the loss's C token means (the actor's one: its
    scored slots; `critic_step.CriticLearner` has one per value head)."""
    return x.score_mask[..., None]

  def _loss(self, params, x: train_batch_lib.SegmentBatch, on_policy: bool = False):
    """(loss, metrics) of one micro-batch; `critic_step.CriticLearner` replaces it.

    on_policy: log pi_old is this forward pass's own log-prob, detached
    (`UpdateConfig.on_policy`); `x.old_logprobs` is not read.
    """
    logp, entropy = scored_logprobs(self._model(params), x)
    old = jax.lax.stop_gradient(logp) if on_policy else x.old_logprobs
    if self.weighted_loss:
      loss, metrics = losses.weighted_actor_loss(logp, entropy, old, x.ref_logprobs,
                                                 x.advantages, x.loss_weights,
                                                 self.config.loss, x.rollout_logprobs)
      if self.config.skip_zero_advantage:  # the updated tokens' share of the weight
        metrics["updated_weight"] = jnp.sum(jnp.where(x.score_mask, x.loss_weights, 0.0))
      return loss, metrics
    # seq-mean-token-sum-norm without a norm_length divides by the row length, as unpacked
    config = dataclasses.replace(self.config.loss,
                                 norm_length=self.config.loss.norm_length or x.seq_len)
    return losses.actor_loss(logp, entropy, old, x.ref_logprobs, x.advantages, x.score_mask,
                             config, x.rollout_logprobs)

  def _accumulate(self, params, grads, batch: Any, on_policy: bool = False):
    """grads + the gradient of `batch`'s share of the mini-batch loss, its micro-batches in
    a `lax.scan`, and the share's metrics (with `scored_tokens`).

    on_policy (static): old log-probs from the step's own forward pass (see `_loss`);
    valid only for the first step from the params that played the rollout.
    """
    batch = self._layout(batch)
    micro = self._micro(batch)
    active_k = jnp.any(self._loss_mask(micro), axis=tuple(range(1, 4)))
    n_active = (1.0 if self.weighted_loss
                else jnp.maximum(jnp.sum(active_k), 1).astype(jnp.float32))

    # gradients of the trained params only (with LoRA: no weight gradients of the base)
    trained = lora_lib.trainable_params(params)
    loss = lambda t, x: self._loss(lora_lib.with_frozen(t, params), x, on_policy)  # noqa: E731

    def micro_step(grads, xs):
      x, active = xs
      (_, metrics), g = jax.value_and_grad(loss, has_aux=True)(trained, x)
      scale = jnp.where(active, 1.0 / n_active, 0.0)
      return jax.tree.map(lambda a, b: a + scale * b, grads, g), metrics

    grads, metrics_k = jax.lax.scan(micro_step, grads, (micro, active_k))
    metrics = {name: jnp.sum(jnp.where(active_k, v, 0.0)) / n_active for name, v in metrics_k.items()}
    metrics["scored_tokens"] = jnp.sum(jnp.any(self._loss_mask(batch), axis=-1)).astype(jnp.float32)
    return grads, metrics

  def _update(self, state: TrainState, batch: Any, on_policy: bool = False):
    """One optimizer step on a one-part mini-batch [M, ...]; returns (new state, f32[] metrics)."""
    # Accumulate in f32 whatever the param dtype (bf16 sums of k terms lose bits), then
    # hand the optimizer grads in the param dtype so its state keeps a fixed dtype.
    grads, metrics = self._accumulate(state.params, self._zero_grads(state.params), batch,
                                      on_policy)
    return self._apply_gradients(state, grads, metrics)

  def _zero_grads(self, params):
    return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32),
                        lora_lib.trainable_params(params))

  def _apply_gradients(self, state: TrainState, grads: Any, metrics: dict):
    """Clipping and AdamW on the summed f32 gradients of a mini-batch; `metrics` (the
    mini-batch's loss metrics and `scored_tokens`) gain the step's own."""
    trained = lora_lib.trainable_params(state.params)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trained)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = self.tx.update(grads, state.opt_state, trained)
    params = optax.apply_updates(trained, updates)
    # verl skips the optimizer step when the gradient norm is not finite.
    finite = jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    params, opt_state = keep(params, trained), keep(opt_state, state.opt_state)
    params = lora_lib.with_frozen(params, state.params)
    lr = (state.opt_state[1].hyperparams["learning_rate"] if self.config.scheduled
          else learning_rate_schedule(self.config)(state.step))
    metrics = dict(metrics, grad_norm=grad_norm, skipped_step=1.0 - finite.astype(jnp.float32),
                   learning_rate=lr)
    if "updated_weight" in metrics:  # skip_zero_advantage: token means over the updated tokens
      w = metrics["updated_weight"]
      for name in ("entropy", "approx_kl"):
        metrics[name] = jnp.where(w > 0, metrics[name] / jnp.where(w > 0, w, 1.0), 0.0)
    new_state = state.replace(params=params, opt_state=opt_state,
                              step=state.step + finite.astype(jnp.int32))
    return new_state, metrics

  def update_mini_batch(self, state: TrainState, parts: Sequence[Any], on_policy: bool = False):
    """One optimizer step on a mini-batch given as its parts (`training.packing`); returns
    (new state, metrics). Donates `state`, like `update`.

    One part (an unpacked or packed mini-batch) is one compiled program (`update`); several
    (length-grouped micro-batches of their own shapes) run one gradient program per shape,
    adding to a donated f32 gradient sum, and the metrics, weighted shares of the
    mini-batch's, are summed.
    """
    parts = [self.put_batch(x) for x in parts]
    if len(parts) == 1:
      return self.update(state, parts[0], on_policy)
    if not parts or not self.weighted_loss:
      raise ValueError(f"a mini-batch of {len(parts)} parts needs at least one part and "
                       f"loss_agg='token-mean' (each part's loss its weighted share)")
    grads, total = self.zero_grads(state.params), None
    for x in parts:
      grads, metrics = self.accumulate(state.params, grads, x, on_policy)
      total = metrics if total is None else jax.tree.map(jnp.add, total, metrics)
    return self.apply_gradients(state, grads, total)


# An iteration's rows: a batch of rows (a host TrainBatch, or a critic's ValueBatch), split
# into one-part mini-batches of mini_batch_rows, or its mini-batches already laid out, a list
# of tuples of parts (`packing.plain_batch`, `pack_batch`, `group_batch`).
Batches = Any


def mini_batches(learner: Learner, batch: Batches) -> list[tuple]:
  """The iteration's mini-batches in update order, each a tuple of parts."""
  if isinstance(batch, list):  # laid out by the caller (`training.packing`)
    return batch
  return [(chunk,) for chunk in train_batch_lib.row_chunks(batch, learner.config.mini_batch_rows)]


def fill_logprobs(learner: Learner, params: Any, ref_params: Optional[Any],
                  batches: list[tuple], *, old: bool = True) -> list[tuple]:
  """The iteration's mini-batches (a list of tuples of parts: `training.packing`'s layouts)
  laid out on the mesh (SegmentBatch parts) with `old_logprobs` (and `ref_logprobs` if
  ref_params) filled there, in the same structure: the update reads them on the device,
  with no trip through the host.

  Runs part by part, so every call has a part's compiled shape. old=False leaves
  `old_logprobs` as they are (an on-policy update computes its own, see
  `UpdateConfig.on_policy`). `fill_rows` takes one batch of rows instead.
  """
  if not isinstance(batches, list):
    raise TypeError(f"fill_logprobs takes a list of mini-batches (training.packing); "
                    f"got {type(batches).__name__}: use fill_rows for one batch of rows")
  filled = []
  for parts in batches:
    laid_out = []
    for part in parts:
      x = learner.lay_out(learner.put_batch(part))
      if old:
        x = x.replace(old_logprobs=learner.compute_logprobs(params, x))
      if ref_params is not None:
        ref = params if ref_params is ADAPTERS_OFF else ref_params
        x = x.replace(ref_logprobs=learner.compute_reference_logprobs(ref, x))
      laid_out.append(x)
    filled.append(tuple(laid_out))
  return filled


def fill_rows(learner: Learner, params: Any, ref_params: Optional[Any], batch: Any, *,
              old: bool = True):
  """`fill_logprobs` of one batch of rows (its mini-batches of `mini_batch_rows`): one
  SegmentBatch of the same rows, its mini-batches' layouts end to end (what
  `Learner.update` and `train_iteration` take)."""
  filled = fill_logprobs(learner, params, ref_params, mini_batches(learner, batch), old=old)
  if len(filled) == 1:
    return filled[0][0]
  return jax.tree.map(lambda *xs: jnp.concatenate(xs), *[parts[0] for parts in filled])


def train_iteration(learner: Learner, state: TrainState, batch: Batches,
                    *, on_policy: bool = False):
  """ppo_epochs x (mini-batches) updates over a filled batch, in row order.

  on_policy: the iteration is one optimizer step whose old log-probs the update computes
  itself (`UpdateConfig.on_policy`; the batch's `old_logprobs` are not read).

  Returns:
    (state, metrics): metrics are the means over the optimizer steps, plus `num_updates`
    and `skipped_steps` (how many steps a non-finite gradient norm skipped).
  """
  chunks = mini_batches(learner, batch)
  if on_policy and not (learner.config.on_policy(learner.config.mini_batch_rows) and len(chunks) == 1):
    raise ValueError(f"on_policy needs one optimizer step per iteration: ppo_epochs=1 and "
                     f"<= mini_batch_rows rows (got ppo_epochs={learner.config.ppo_epochs}, "
                     f"{len(chunks)} mini-batches)")
  history = []
  total = learner.config.ppo_epochs * len(chunks)
  for _ in range(learner.config.ppo_epochs):
    for parts in chunks:
      progress.phase(learner.PHASE, f"mini-batch {len(history) + 1}/{total}")
      state, metrics = learner.update_mini_batch(state, parts, on_policy)
      history.append(metrics)
  host = jax.device_get(history)
  mean = {k: float(np.mean([h[k] for h in host])) for k in host[0]}
  mean["num_updates"] = float(len(host))
  if "skipped_step" in host[0]:  # steps the non-finite-norm rule skipped (count, not mean)
    mean["skipped_steps"] = float(sum(h["skipped_step"] for h in host))
  return state, mean
