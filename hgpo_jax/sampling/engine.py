"""The device side of the sampler: prefill, then a decode loop, over named state.

`generate(engine, model, inputs, flags)` is the body of the jitted generate program:
  1. `prefill`: the first P-1 prompt slots of the rows (or of the distinct prompts, copied
     to their rows with a shared prefill) into a KV cache of S = P + M - 1 slots, hidden
     states only (no [B, P, V] logits); `prefill_rows` rows per loop step when set.
  2. `lockstep_decode` (flags.slots == 0): a `lax.while_loop` over `DecodeState` that feeds
     each row's previous token at slot P-1+j, samples token j (`token_rules.TokenRules`)
     and exits once every row finished; finished rows keep flowing but record nothing.
     `slotted_decode` (flags.slots = S < B): S cache rows, rows admitted into free slots
     as others finish (`slots.admit_rows`), each slot at its own cache offset.
     `jump_forward.jump_forward_decode` (constrained calls with `Engine.jump_forward` K >
     0): each row at its own offset, the tokens its trie forces fed K at a time.
Both return a `DecodeResult`. With `Engine.per_layer` every layer's weights are arrays of
their own, and on CPUs the lockstep loop's cache too (`DECODE_LAYERS`). The cache's dtype, sharding and the prefill's chunking are
the `Engine`'s (built once per `Sampler`). The model is a `decoder.Decoder`, or any module
with its `for_decoding`, `prefill` and `decode`; `generate` decodes with
`model.for_decoding()` (the output layer cast to the compute dtype once per call).
"""

from __future__ import annotations

import dataclasses
import functools

import flax
import jax
import jax.numpy as jnp

from hgpo_jax.models import attention
from hgpo_jax.models import decoder
from hgpo_jax.models import kv_cache
from hgpo_jax.models import platform
from hgpo_jax.models import sharding
from hgpo_jax.sampling import decode_loop
from hgpo_jax.sampling import inputs as inputs_lib
from hgpo_jax.sampling import jump_forward
from hgpo_jax.sampling import slots as slots_lib
from hgpo_jax.sampling import token_rules
from hgpo_jax.sampling import types


DecodeResult = decode_loop.DecodeResult  # what `generate` returns

CACHE_DTYPES = ("auto", "", "float32", "bfloat16")
"""Values of `Sampler(cache_dtype=...)` / `config.rollout.kv_cache_dtype`."""


def resolve_cache_dtype(name: str, mesh_or_devices, compute_dtype) -> jnp.dtype:
  """The KV cache's dtype: "auto" is bfloat16 when the sampler's devices are TPUs or GPUs
  (half the cache bytes; the field's engines keep bf16 caches) and the compute dtype
  elsewhere (so CPU numbers are unchanged); "" is the compute dtype; else the named dtype.
  Raises ValueError for another name."""
  if name not in CACHE_DTYPES:
    raise ValueError(f"kv_cache_dtype={name!r}: use one of {CACHE_DTYPES}.")
  if name == "auto":
    accelerated = platform.target_platform(mesh_or_devices) in ("tpu", "gpu")
    return jnp.dtype(jnp.bfloat16 if accelerated else compute_dtype)
  return jnp.dtype(compute_dtype if name == "" else name)


DECODE_LAYERS = ("auto", "per_layer")
"""Values of `Sampler(decode_layers=...)` / `config.rollout.decode_layers`: how a decode step
reads the layers. "auto": per-layer weight arrays on GPUs and TPUs
(`decoder.per_layer_decode_weights`), a `lax.scan` over the stacked layers on CPUs.
"per_layer": per-layer weight arrays on every platform; on CPUs also the lockstep loop's
cache (`kv_cache.layered`) and, in the sampler, the decode weights made once per weight
version instead of once per call (`Sampler.decoding_model`). On XLA:CPU a scanned step
copies each layer's weight and cache slices out of the stacked arrays before its products
read them; unrolled over arrays of their own it reads them in place. The samples are those
of "auto" up to float round-off (a bfloat16 program fuses differently, so its bits differ)."""


def resolve_decode_layers(name: str, mesh_or_devices) -> tuple[bool, bool]:
  """(per-layer decode weights forced, per-layer cache) of `decode_layers` on the target
  devices: "auto" (False, False); "per_layer" (True, whether they are CPUs). Raises
  ValueError for another name."""
  if name not in DECODE_LAYERS:
    raise ValueError(f"decode_layers={name!r}: use one of {DECODE_LAYERS}.")
  if name == "auto":
    return False, False
  return True, platform.target_platform(mesh_or_devices) == "cpu"


GPU_DECODE_CHUNK = 16
"""Lockstep decode steps per device-loop iteration on GPUs (`resolve_decode_chunk`)."""


def resolve_decode_chunk(steps: int, mesh_or_devices) -> int:
  """Decode steps per iteration of the lockstep loop: `steps` when > 0, else by the target
  devices' platform: `GPU_DECODE_CHUNK` on GPUs, 1 elsewhere.

  Why: XLA:GPU runs a `while` loop whose trip count it cannot know by copying the condition
  to the host and waiting for the device in every iteration (openxla/xla,
  xla/backends/gpu/runtime/while_thunk.cc), so a one-step loop pays a host round trip per
  token; an inner loop of K steps has a known trip count and queues without that wait. TPUs
  and CPUs evaluate the condition without a host round trip, so 1 keeps their programs as
  they were. Same tokens either way (`lockstep_decode`)."""
  if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
    raise ValueError(f"decode_chunk_steps={steps!r} must be an int >= 0 (0: by platform).")
  if steps:
    return steps
  return GPU_DECODE_CHUNK if platform.target_platform(mesh_or_devices) == "gpu" else 1


KERNEL_CACHE_MULTIPLE = 128
"""Cache slots are a multiple of this under a Pallas decode kernel (the TPU kernel's blocks
of 128-512 slots, the GPU kernel's of 16-64)."""


def cache_multiple(cfg, mesh_or_devices) -> int:
  """`KERNEL_CACHE_MULTIPLE` when `cfg.decode_attention_impl` resolves to a Pallas kernel on
  the target devices, or the targets are GPUs; else 1 (the XLA form takes any length: CPU
  and TPU programs unchanged). On GPUs the XLA form pads an odd cache length (P + M - 1) to
  the next multiple of its matmul tiles, a copy of each layer's keys and values in every
  decode step (the XLA:GPU decode-traffic proxy of the 1.5B paper setting: 2114 MB per
  step, docs/performance.md)."""
  impl = attention.resolve_decode_impl(cfg.decode_attention_impl, mesh_or_devices,
                                      head_dim=cfg.head_dim)
  if impl in attention.STACKED_DECODE_IMPLEMENTATIONS:
    return KERNEL_CACHE_MULTIPLE
  return KERNEL_CACHE_MULTIPLE if platform.target_platform(mesh_or_devices) == "gpu" else 1


@dataclasses.dataclass(frozen=True)
class Engine:
  """The sampler's settings the device program reads (constants of every program).

  Attributes:
    cfg: the model's `ModelConfig` (cache shape).
    mesh: the sampler's mesh, or None (the cache is constrained to its shardings).
    cache_dtype: the KV cache's dtype.
    pad_id: the token written after a row finished.
    eos_ids: the tokenizer's EOS ids.
    max_candidates: K of top-k / top-p (`logits.filter_logits`).
    prefill_rows: rows per prefill step (0: one step; `Sampler(prefill_rows=)`).
    batch_parallel: the mesh's batch-parallel size D.
    admit_rows: rows a slotted decode admits at a time.
    decode_chunk: lockstep decode steps per iteration of the device loop (`lockstep_decode`):
      1 tests "every row finished?" after each step (the CPU default); K > 1 runs K steps
      as an inner loop of known trip count and tests once per K (`resolve_decode_chunk`).
    cache_multiple: the cache's slots are a multiple of this (`cache_length`).
    per_layer: decode from per-layer weights on every platform (`decoding`).
    layered_cache: the lockstep loop carries its cache as per-layer arrays
      (`kv_cache.layered`; CPU targets with `per_layer`).
    jump_forward: K > 0 decodes constrained calls with `jump_forward.jump_forward_decode`
      (a row's forced tokens, up to K, fed in one step); 0 one token per step.
  """
  cfg: object
  mesh: object
  cache_dtype: object
  pad_id: int
  eos_ids: tuple[int, ...]
  max_candidates: int
  prefill_rows: int
  batch_parallel: int
  admit_rows: int
  decode_chunk: int = 1
  cache_multiple: int = 1
  per_layer: bool = False
  layered_cache: bool = False
  jump_forward: int = 0

  def decoding(self, model):
    """`model.for_decoding()`, with every layer's weights arrays of their own when
    `per_layer` (`Sampler(decode_layers="per_layer")`)."""
    return model.for_decoding(True) if self.per_layer else model.for_decoding()

  def cache_length(self, plen: int, max_new_tokens: int) -> int:
    """Slots of a call's cache: P - 1 prompt slots + M new ones, rounded up to
    `cache_multiple` (the Pallas decode kernels tile the slots in blocks; the slots past
    P + M - 1 are never valid, so never read)."""
    return -(-(plen + max_new_tokens - 1) // self.cache_multiple) * self.cache_multiple

  def chunks(self, rows: int) -> bool:
    """Whether `rows` rows are prefilled (or, shared, copied) `prefill_rows` at a time."""
    return bool(self.prefill_rows) and rows > self.prefill_rows and rows % self.prefill_rows == 0

  def constrain(self, cache: decoder.KVCache, rows: int, length: int) -> decoder.KVCache:
    """`cache` constrained to its shardings on the mesh (unchanged without one)."""
    if self.mesh is None:
      return cache
    return jax.lax.with_sharding_constraint(
        cache, sharding.cache_shardings(self.cfg, self.mesh, rows, length))

  def empty_cache(self, rows: int, length: int) -> decoder.KVCache:
    """An all-zero cache of `rows` rows and `length` slots in the engine's dtype."""
    return self.constrain(decoder.init_cache(self.cfg, rows, length, self.cache_dtype), rows,
                          length)

  def rules(self, inputs, flags) -> token_rules.TokenRules:
    return token_rules.TokenRules(inputs, flags, vocab=self.cfg.vocab_size,
                                  eos_ids=self.eos_ids, max_candidates=self.max_candidates)


@flax.struct.dataclass
class DecodeState:
  """The lockstep loop's carry (B rows)."""
  step: jax.Array  # i32[]: the token index j being sampled
  cache: decoder.KVCache
  prev: jax.Array  # i32[B]: the token fed at this step
  tokens: jax.Array  # i32[B, M]
  logprobs: jax.Array  # f32[B, M]
  done: jax.Array  # bool[B]
  reasons: jax.Array  # i32[B]
  lengths: jax.Array  # i32[B]
  rules: token_rules.RowRules


def generate(engine: Engine, model, inputs: inputs_lib.DecodeInputs,
             flags: inputs_lib.DecodeFlags) -> DecodeResult:
  """Prefill + decode of one call (module docstring)."""
  model = engine.decoding(model)
  batch, plen = inputs.tokens.shape
  cache_len = engine.cache_length(plen, flags.max_new_tokens)
  rules = engine.rules(inputs, flags)
  phase_b = rules.start_phase()
  prefill_up, prefill_lengths_u = inputs.prefill_tokens, inputs.prefill_lengths
  if flags.slots:  # rows are prefilled as they enter a slot; a shared prefill's rows first
    shared_cache = None
    if flags.shared_prefill and plen > 1:
      shared_cache = prefill(engine, model, prefill_up, prefill_lengths_u,
                             engine.empty_cache(prefill_up.shape[0], plen - 1))
    return slotted_decode(engine, model, rules, inputs, phase_b, shared_cache,
                          slots=flags.slots)
  jump = engine.jump_forward > 0 and flags.constraint_mode != types.NO_CONSTRAINT
  if jump:  # a step's K + 1 positions may pass P + M - 1 (padding; never read)
    cache_len = engine.cache_length(plen, flags.max_new_tokens + engine.jump_forward)
  cache = engine.empty_cache(prefill_up.shape[0], cache_len)
  if plen > 1:
    # Prefill the first P-1 slots; the last prompt token is the first decode input, so
    # the [B, P, V] logits of the prompt are never needed (only hidden is called).
    cache = prefill(engine, model, prefill_up, prefill_lengths_u, cache)
  if flags.shared_prefill:
    if engine.chunks(batch):
      cache = chunked_copy(engine, cache, inputs.source, engine.empty_cache(batch, cache_len))
    else:
      cache = jax.tree.map(lambda c: jnp.take(c, inputs.source, axis=1), cache)
    if engine.mesh is not None:
      cache = engine.constrain(cache, batch, cache_len)
  if jump:
    return jump_forward.jump_forward_decode(engine, model, rules, inputs, phase_b, cache)
  return lockstep_decode(engine, model, rules, inputs, phase_b, cache)


def prefill(engine: Engine, model, tokens_up, lengths_u, cache) -> decoder.KVCache:
  """`cache` with slots [0, P-1) of its U rows holding the left-padded prompts
  `tokens_up` [U, P] minus their last token (`chunked_prefill` when `engine.chunks(U)`)."""
  positions_ut, segment_ids_ut = inputs_lib.prefill_layout(lengths_u, tokens_up.shape[1])
  if engine.chunks(tokens_up.shape[0]):
    return chunked_prefill(engine, model, tokens_up[:, :-1], positions_ut, segment_ids_ut,
                           cache)
  _, cache = model.prefill(tokens_up[:, :-1], positions_ut, segment_ids_ut, cache)
  return cache


def chunked_prefill(engine: Engine, model, tokens_ut, positions_ut, segment_ids_ut, cache):
  """The prefill of U rows in U / prefill_rows steps of a loop, each writing its rows'
  keys/values into `cache` in place. Rows split over D batch-parallel devices lie in
  contiguous blocks of U / D, so step i takes rows [i c, (i + 1) c) of every device's
  block (c = prefill_rows / D): each device prefills its own rows, no row moves."""
  d = engine.batch_parallel
  unique, t = tokens_ut.shape
  per, c = unique // d, engine.prefill_rows // d
  blocks = lambda x: x.reshape(d, per, *x.shape[1:])  # noqa: E731
  tok, pos, seg = blocks(tokens_ut), blocks(positions_ut), blocks(segment_ids_ut)
  k_all = cache.k.reshape(cache.k.shape[0], d, per, *cache.k.shape[2:])
  v_all = cache.v.reshape(k_all.shape)

  def step(i, kv):
    k_all, v_all = kv
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1).reshape(d * c, t)  # noqa: E731
    part = decoder.init_cache(engine.cfg, d * c, t, cache.k.dtype)
    _, part = model.prefill(take(tok), take(pos), take(seg), part)
    put = lambda full, new: jax.lax.dynamic_update_slice(  # noqa: E731
        full, new.reshape(new.shape[0], d, c, *new.shape[2:]),
        (0, 0, i * c) + (0,) * (full.ndim - 3))
    return put(k_all, part.k), put(v_all, part.v)

  k_all, v_all = jax.lax.fori_loop(0, per // c, step, (k_all, v_all))
  return decoder.KVCache(k=k_all.reshape(cache.k.shape), v=v_all.reshape(cache.v.shape))


def chunked_copy(engine: Engine, cache_u, source_b, cache_b):
  """A shared prefill's B-row cache, row b = `cache_u`'s row `source_b[b]`, written into
  the empty `cache_b` in place, `prefill_rows` rows per loop step (each device its own
  block of rows, as `chunked_prefill`): only the U-row cache and one step's rows are
  live beside it. `jnp.take` of all B rows at once made XLA:TPU keep a second B-row
  cache next to the decode loop's (docs/performance.md)."""
  d = engine.batch_parallel
  batch = source_b.shape[0]
  per, c = batch // d, engine.prefill_rows // d
  source = source_b.reshape(d, per)

  def step(i, kv):
    rows = jax.lax.dynamic_slice_in_dim(source, i * c, c, axis=1).reshape(d * c)
    return tuple(
        jax.lax.dynamic_update_slice(
            full, jnp.take(u, rows, axis=1).reshape(u.shape[0], d, c, *u.shape[2:]),
            (0, 0, i * c) + (0,) * (full.ndim - 3))
        for full, u in zip(kv, (cache_u.k, cache_u.v)))

  shape = (cache_b.k.shape[0], d, per) + cache_b.k.shape[2:]
  k_b, v_b = jax.lax.fori_loop(0, per // c, step,
                               (cache_b.k.reshape(shape), cache_b.v.reshape(shape)))
  return decoder.KVCache(k=k_b.reshape(cache_b.k.shape), v=v_b.reshape(cache_b.v.shape))


def lockstep_decode(engine: Engine, model, rules: token_rules.TokenRules,
                    inputs: inputs_lib.DecodeInputs, phase_b, cache) -> DecodeResult:
  """Every row of the call decodes in its own cache row, all at the same slot per step.

  With `engine.decode_chunk` = K > 1 the loop's body is an inner loop of K steps (known trip
  count) and the exit test runs once per K steps. A step past the last token (j >= M) or
  after every row finished records nothing, so the tokens, log-probs, lengths, reasons and
  the reported step count equal the one-step loop's; row r's token j keeps its
  fold_in(fold_in(rng, j), r) key."""
  batch, plen = inputs.tokens.shape
  max_new_tokens = rules.flags.max_new_tokens
  rows_b = jnp.arange(batch)

  def body(state: DecodeState) -> DecodeState:
    step = state.step
    slot = plen - 1 + step
    positions_b1 = inputs_lib.decode_positions(inputs.lengths, step)
    # The decoder reads row b's cache slots [slot - position, slot) = [pad_b, slot).
    logits_b1v, cache = model.decode(state.prev[:, None], positions_b1, state.cache, slot)
    out = rules.step(logits_b1v[:, 0], rows_b, step, inputs.tries, state.rules)
    live_b = ~state.done
    return DecodeState(
        step=step + 1, cache=cache, prev=out.token,
        tokens=state.tokens.at[:, step].set(jnp.where(live_b, out.token, engine.pad_id)),
        logprobs=state.logprobs.at[:, step].set(jnp.where(live_b, out.logprob, 0.0)),
        done=state.done | (out.reason > 0),
        reasons=jnp.where(live_b & (out.reason > 0), out.reason, state.reasons),
        lengths=state.lengths + live_b.astype(jnp.int32), rules=out.rules)

  def cond(state: DecodeState):
    return (state.step < max_new_tokens) & ~jnp.all(state.done)

  if engine.layered_cache:
    cache = kv_cache.layered(cache)
  zeros_b = jnp.zeros((batch,), jnp.int32)
  state = DecodeState(
      step=jnp.int32(0), cache=cache, prev=inputs.tokens[:, -1],
      tokens=jnp.full((batch, max_new_tokens), engine.pad_id, jnp.int32),
      logprobs=jnp.zeros((batch, max_new_tokens), jnp.float32), done=~inputs.row_valid,
      reasons=zeros_b, lengths=zeros_b,
      rules=token_rules.RowRules.start(phase_b))
  return decode_loop.run_loop(engine.decode_chunk, body, cond, state, max_new_tokens)


@flax.struct.dataclass
class SlottedLoop:
  """The slotted loop's carry: the slots and the call's outputs (B rows)."""
  slots: slots_lib.SlotState
  tokens: jax.Array  # i32[B, M]
  logprobs: jax.Array  # f32[B, M]
  reasons: jax.Array  # i32[B]
  lengths: jax.Array  # i32[B]
  steps: jax.Array  # i32[]


def slotted_decode(engine: Engine, model, rules: token_rules.TokenRules,
                   inputs: inputs_lib.DecodeInputs, phase_b, shared_cache, *,
                   slots: int) -> DecodeResult:
  """The decode of B rows in S < B cache rows ("slots"), each slot at its own offset.

  A while loop of decode steps over the S slots; before each step, while rows wait and
  enough slots are free, the next `admit_rows` rows are prefilled into free slots (or,
  with `shared_cache`, their shared prefill's rows copied there: `slots.admit_rows`). A
  slot decodes row r's token j at cache slot P - 1 + j with row r's key
  (`fold_in(fold_in(rng, j), r)`, as the lockstep loop), so a row samples what the
  lockstep program samples for it; a finished row frees its slot at once instead of
  running with the slowest row of the call. Its `steps` count steps of S slots.
  """
  batch, plen = inputs.tokens.shape
  max_new = rules.flags.max_new_tokens
  cache_len = engine.cache_length(plen, max_new)
  admission = slots_lib.Admission(
      model=model, inputs=inputs, phase=phase_b, shared_cache=shared_cache, slots=slots,
      rows=engine.admit_rows, cache_len=cache_len,
      n_valid=jnp.sum(inputs.row_valid.astype(jnp.int32)),
      prefill=functools.partial(prefill, engine), empty_cache=engine.empty_cache,
      constrain=engine.constrain if engine.mesh is not None else None)

  def body(loop: SlottedLoop) -> SlottedLoop:
    now = jax.lax.while_loop(functools.partial(slots_lib.may_admit, admission),
                             functools.partial(slots_lib.admit_rows, admission), loop.slots)
    take_s = jnp.minimum(now.row, batch - 1)
    positions_s1 = (inputs.lengths[take_s] - 1 + now.step)[:, None]
    logits_s1v, cache = model.decode(now.prev[:, None], positions_s1, now.cache,
                                     plen - 1 + now.step)
    out = rules.step(logits_s1v[:, 0], take_s, now.step, inputs.tries.rows(take_s), now.rules)
    row_or_none_s = jnp.where(now.active, now.row, batch)
    ended_s = now.active & (out.reason > 0)
    return SlottedLoop(
        slots=slots_lib.SlotState(
            cache=cache, row=now.row, step=now.step + now.active.astype(jnp.int32),
            prev=out.token, active=now.active & ~ended_s, rules=out.rules,
            next_row=now.next_row),
        tokens=loop.tokens.at[row_or_none_s, now.step].set(out.token, mode="drop"),
        logprobs=loop.logprobs.at[row_or_none_s, now.step].set(out.logprob, mode="drop"),
        reasons=loop.reasons.at[jnp.where(ended_s, now.row, batch)].set(out.reason,
                                                                        mode="drop"),
        lengths=loop.lengths.at[row_or_none_s].add(1, mode="drop"), steps=loop.steps + 1)

  def cond(loop: SlottedLoop):
    return (loop.slots.next_row < admission.n_valid) | jnp.any(loop.slots.active)

  zeros_b = jnp.zeros((batch,), jnp.int32)
  loop = SlottedLoop(
      slots=slots_lib.SlotState.empty(engine.empty_cache(slots, cache_len), slots, batch),
      tokens=jnp.full((batch, max_new), engine.pad_id, jnp.int32),
      logprobs=jnp.zeros((batch, max_new), jnp.float32), reasons=zeros_b, lengths=zeros_b,
      steps=jnp.int32(0))
  loop = jax.lax.while_loop(cond, body, loop)
  return DecodeResult(tokens=loop.tokens, logprobs=loop.logprobs, lengths=loop.lengths,
                      reasons=loop.reasons, steps=loop.steps)
