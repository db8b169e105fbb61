"""The jit KV-cache sampler: batched prompts -> responses, token log-probs and stop reasons.

`Sampler` is the host side: it pads prompts into batch and prompt buckets, packs a call
into `inputs.DecodeInputs` + `inputs.DecodeFlags`, runs the jitted device program
(`engine.generate`: prefill, then a lockstep or slotted decode loop whose per-token rules
are `token_rules.TokenRules`), and cuts the rows to length, re-checking stop strings on the
decoded text. Programs are compiled per (shapes, flags); the model is an argument, so
weight updates made in place need no recompile; `precompile` compiles a config's calls
ahead of time. The parts, how a call flows through them, and where to change admission,
the token rules or the decode attention: docs/architecture.md ("Sampler").
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hgpo_jax.models import attention
from hgpo_jax.models import sharding
from hgpo_jax.sampling import constrained
from hgpo_jax.sampling import engine as engine_lib
from hgpo_jax.sampling import inputs as inputs_lib
from hgpo_jax.sampling import logits as logits_lib
from hgpo_jax.sampling import tables as tables_lib
from hgpo_jax.sampling import types

PROMPT_BUCKETS = (128, 256, 512, 640, 768, 1024, 1536, 2048, 3072, 4096)
"""Prompt buckets of a run's sampler, capped by rollout.max_prompt_tokens (`prompt_buckets`)."""


def prompt_buckets(max_prompt_tokens: int) -> tuple[int, ...]:
  """The run's prompt buckets: `PROMPT_BUCKETS` below `max_prompt_tokens`, then it."""
  return tuple(b for b in PROMPT_BUCKETS if b < max_prompt_tokens) + (max_prompt_tokens,)


def bucket_for(n: int, buckets: Sequence[int], what: str) -> int:
  """The smallest of the sorted `buckets` that holds `n`; ValueError when none does."""
  i = bisect.bisect_left(buckets, n)
  if i == len(buckets):
    raise ValueError(f"Sampler: {what} {n} exceeds the largest bucket {buckets[-1]}; "
                     f"add a larger bucket or shorten the input.")
  return buckets[i]


class Sampler:
  """Jit-compiled batched sampler over a decoder with a KV cache (module docstring).

  Args:
    model: a `hgpo_jax.models.decoder.Decoder` (its `cfg` gives the cache shape).
    tokenizer: the model's tokenizer (encode, decode, eos_ids, pad_id, token_strings).
    prompt_buckets: allowed padded prompt lengths P (sorted ascending).
    batch_buckets: allowed padded batch sizes Bb; with a mesh each is rounded up to a
      multiple of the mesh's data-parallel size.
    mesh: optional mesh over this process's own devices; prompts, outputs and the KV cache
      are split over the logical "batch" axis, the cache's kv-heads over "tensor".
    share_prefill: rows of a call with the same prompt are prefilled once. True: the
      shared prefill runs the bucket of the call's distinct prompts; an int G >= 2 (the
      group size): always `shared_prefill_rows(Bb)` rows (a call with more distinct
      prompts prefills every row); False: every row is prefilled.
    max_candidates: K of top-k / top-p (`logits.filter_logits`).
    cache_dtype: one of `CACHE_DTYPES` (`resolve_cache_dtype`).
    prefill_rows: rows prefilled per step of the prefill loop (a multiple of the mesh's
      batch-parallel size; 0: one step).
    decode_slots: continuous batching: a call of more bucketed rows than this decodes
      them in this many cache rows (a multiple of the batch-parallel size; 0: lockstep).
    trie_nodes: fixed nodes of every constrained call's tries (0: sized per call).
    decode_chunk: lockstep decode steps per device-loop iteration (0: by the devices'
      platform, `engine.resolve_decode_chunk`); same tokens for every value.
    decode_layers: one of `engine.DECODE_LAYERS` (how a decode step reads the layers).
    jump_forward: K > 0 feeds the tokens a constrained row's trie forces, up to K, in one
      decode step (`jump_forward.jump_forward_decode`; lockstep decoding only); 0 one token
      per step. Samples equal up to float round-off.

  Attributes:
    generate_program: the jitted device program, `(model, inputs: inputs.DecodeInputs,
      flags=inputs.DecodeFlags)`, public so that `hgpo_jax.training.programs` lowers exactly it.
  """

  def __init__(self, model, tokenizer, *, prompt_buckets=(128, 256, 512, 1024, 2048, 4096),
               batch_buckets=(1, 2, 4, 8, 16, 32, 64, 128), mesh=None, share_prefill=True,
               max_candidates=logits_lib.DEFAULT_MAX_CANDIDATES, cache_dtype="auto",
               trie_nodes=0, prefill_rows=0, decode_slots=0, decode_chunk=0,
               decode_layers="auto", jump_forward=0):
    if isinstance(trie_nodes, bool) or not isinstance(trie_nodes, int) or trie_nodes < 0:
      raise ValueError(f"Sampler: trie_nodes={trie_nodes!r} must be an int >= 0 "
                       "(rollout.max_trie_nodes; 0 = sized per call).")
    self.trie_nodes = trie_nodes
    if (isinstance(max_candidates, bool) or not isinstance(max_candidates, int)
        or max_candidates < 1):
      raise ValueError(f"Sampler: max_candidates={max_candidates!r} must be an int >= 1 (the "
                       "top-k/top-p candidates per row; docs/performance.md).")
    self.max_candidates = max_candidates
    if not (isinstance(share_prefill, bool)
            or (isinstance(share_prefill, int) and share_prefill >= 2)):
      raise ValueError(f"Sampler: share_prefill={share_prefill!r} must be a bool or an int "
                       ">= 2 (the group size: a shared prefill runs ceil(rows / G) rows).")
    self.model = model
    self.share_prefill = share_prefill
    self.tokenizer = tokenizer
    self.cfg = model.cfg
    self.mesh = mesh
    self.cache_dtype = engine_lib.resolve_cache_dtype(
        cache_dtype, jax.local_devices() if mesh is None else mesh, model.cfg.compute_dtype)
    self.prompt_buckets = tuple(sorted(prompt_buckets))
    data_size = 1
    if mesh is not None and not all(d.process_index == jax.process_index()
                                    for d in mesh.devices.flat):
      # Prompts are host arrays of this process only; a mesh with other processes'
      # devices would need every process to send the same prompts in lockstep.
      raise ValueError("Sampler: the mesh spans devices of other processes; give each process "
                       "a mesh over its own jax.local_devices() (docs/scaling.md).")
    if mesh is not None:
      batch_spec = sharding.logical_to_spec(("batch",), mesh)[0]
      batch_axes = () if batch_spec is None else (
          (batch_spec,) if isinstance(batch_spec, str) else tuple(batch_spec))
      data_size = int(np.prod([mesh.shape[a] for a in batch_axes]))
    self.batch_parallel = data_size
    for name, value, meaning in (
        ("prefill_rows", prefill_rows, "rollout.prefill_chunk_rows; 0 = one prefill"),
        ("decode_slots", decode_slots,
         "rollout.decode_slots; 0 = every row of a call decodes in lockstep")):
      if (isinstance(value, bool) or not isinstance(value, int) or value < 0
          or value % data_size):
        raise ValueError(f"Sampler: {name}={value!r} must be an int >= 0 and a multiple of "
                         f"the mesh's batch-parallel size {data_size} ({meaning}).")
    self.prefill_rows = prefill_rows
    self.decode_slots = decode_slots
    self.batch_buckets = tuple(sorted({-(-b // data_size) * data_size for b in batch_buckets}))
    self.eos_ids = tuple(sorted(set(int(i) for i in tokenizer.eos_ids)))
    if not self.eos_ids:
      raise ValueError("Sampler: the tokenizer has no eos_ids; generation could never end with EOS.")
    self.pad_id = int(tokenizer.pad_id)
    self.tables = tables_lib.TokenTables(tokenizer, self.cfg.vocab_size, self.eos_ids,
                                         self.pad_id, trie_nodes)
    self._warned_sort = False  # top_k > max_candidates warned once
    self.num_compilations = 0  # traces of the jitted program (one per new bucket/flags)
    # programs compiled ahead of time (`precompile`), by `_call_key` of their arguments
    self._compiled: dict[tuple, jax.stages.Compiled] = {}
    self.unlisted_calls = 0  # calls that found no precompiled program (with some compiled)
    if isinstance(jump_forward, bool) or not isinstance(jump_forward, int) or jump_forward < 0:
      raise ValueError(f"Sampler: jump_forward={jump_forward!r} must be an int >= 0 "
                       "(rollout.jump_forward; 0 = one token per step).")
    if jump_forward and decode_slots:
      raise ValueError("Sampler: jump_forward > 0 is implemented for lockstep decoding only; "
                       "set decode_slots=0 (rollout.decode_slots) or jump_forward=0.")
    target = jax.local_devices() if mesh is None else mesh
    per_layer, layered_cache = engine_lib.resolve_decode_layers(decode_layers, target)
    self.decode_layers = decode_layers
    # the decode weights of the current model (`decoding_model`), made once per version on
    # CPUs with per-layer decode weights: (the model's parameter arrays, the view)
    self._decoding: tuple[tuple, object] | None = None
    self._cache_decoding = layered_cache
    self.engine = engine_lib.Engine(
        cfg=self.cfg, mesh=mesh, cache_dtype=self.cache_dtype, pad_id=self.pad_id,
        eos_ids=self.eos_ids, max_candidates=max_candidates, prefill_rows=prefill_rows,
        batch_parallel=data_size, admit_rows=self.admit_rows,
        decode_chunk=engine_lib.resolve_decode_chunk(decode_chunk, target),
        cache_multiple=engine_lib.cache_multiple(self.cfg, target),
        per_layer=per_layer, layered_cache=layered_cache, jump_forward=jump_forward)
    self._decoding_program = jax.jit(attention.traced_on(mesh, self.engine.decoding))
    # (traced with the mesh in context: the splash attention kernel shard_maps over it)
    self.generate_program = jax.jit(attention.traced_on(mesh, self._generate_device),
                                    static_argnames=("flags",))

  @classmethod
  def from_settings(cls, model, tokenizer, rollout, mesh, *, share_prefill=True) -> "Sampler":
    """The sampler of a run: prompt buckets up to `rollout.max_prompt_tokens` and the
    rollout's candidates, cache dtype, trie nodes, prefill chunk and decode slots
    (`rollout` a `hgpo_jax.rollout.params.RolloutParams`)."""
    return cls(model, tokenizer, prompt_buckets=prompt_buckets(rollout.max_prompt_tokens),
               mesh=mesh, share_prefill=share_prefill, max_candidates=rollout.max_candidates,
               cache_dtype=rollout.kv_cache_dtype, trie_nodes=rollout.max_trie_nodes,
               prefill_rows=rollout.prefill_chunk_rows, decode_slots=rollout.decode_slots,
               decode_chunk=rollout.decode_chunk_steps, decode_layers=rollout.decode_layers,
               jump_forward=rollout.jump_forward)

  def _generate_device(self, model, inputs: inputs_lib.DecodeInputs,
                       flags: inputs_lib.DecodeFlags):
    """The jitted program (`engine.generate`); counts its traces."""
    self.num_compilations += 1  # runs at trace time only
    return engine_lib.generate(self.engine, model, inputs, flags)

  def sharing_identical_prompts(self) -> "Sampler":
    """This sampler with `share_prefill=True`: every call's identical prompts prefilled
    once, in the batch bucket of the distinct ones (where `share_prefill=G` shares only
    what fits in ceil(rows / G) rows: a group's first turn). A view with the same model,
    programs and tables (new prefill shapes compile on first use); itself when it shares
    every prompt already or shares none (`share_prefill=False`). Samples equal the
    unshared ones' (`test_shared_prefill_equals_one_prefill_per_row`)."""
    if isinstance(self.share_prefill, bool):
      return self
    view = copy.copy(self)
    view.share_prefill = True
    return view

  def shared_prefill_rows(self, batch: int) -> int | None:
    """Rows of the shared prefill of a call of `batch` (bucketed) rows with
    `share_prefill=G`: the batch bucket of ceil(batch / G); None when the count follows
    the call's distinct prompts (`share_prefill=True`) or nothing is shared."""
    if isinstance(self.share_prefill, bool):
      return None
    return bucket_for(-(-batch // self.share_prefill), self.batch_buckets, "batch size")

  @property
  def admit_rows(self) -> int:
    """Rows a slotted decode admits (prefills into free slots) at a time: `prefill_rows`,
    else the mesh's batch-parallel size (at most `decode_slots`)."""
    return min(self.prefill_rows or self.batch_parallel, self.decode_slots or 1 << 30)

  def decode_loop_weights(self, batch: int, max_new_tokens: int) -> tuple[float, ...]:
    """Trip counts of the generate program's data-dependent loops, outermost first, as
    upper bounds for cost estimates (`hlo.hlo_matmul_flops`): lockstep, max_new_tokens
    steps in chunks of `decode_steps_per_iteration` (the loop runs once per chunk); slotted (S slots), ceil(Bb / S) x max_new_tokens steps, inside which the
    admission loop runs ceil(Bb / admit) times in all (a fraction per step)."""
    slots = self.slots_for(batch)
    if not slots:
      return (-(-max_new_tokens // self.decode_steps_per_iteration(batch, max_new_tokens)),)
    steps = -(-batch // slots) * max_new_tokens
    return (steps, -(-batch // self.admit_rows) / steps)

  def decode_steps_per_iteration(self, batch: int, max_new_tokens: int) -> int:
    """Decode steps one iteration of the generate program's outermost data-dependent loop
    runs: a lockstep decode's chunk (`engine.lockstep_decode`: K steps per iteration, the
    inner loop of known trip count), 1 for a slotted decode."""
    if self.slots_for(batch):
      return 1
    return max(1, min(self.engine.decode_chunk, max_new_tokens))

  def slots_for(self, batch: int) -> int:
    """The `slots` flag of a call of `batch` (bucketed) rows: `decode_slots` when the call
    has more rows than that, else 0 (every row has its own cache row)."""
    return self.decode_slots if 0 < self.decode_slots < batch else 0

  def decoding_model(self):
    """The model the generate program is given: with per-layer decode weights on CPUs
    (`decode_layers="per_layer"`) its decode weights (`Decoder.for_decoding`: adapters
    merged, projections cast, one array per layer), made by a program of their own once per
    version of the model's parameters (a new parameter array is a new version) and kept
    until the next, where each call would make them again (on 2 CPU cores ~0.5 s per call
    for SmolLM2-135M); else the model itself (the program makes them per call)."""
    if not self._cache_decoding:
      return self.model
    leaves = tuple(jax.tree.leaves(nnx.state(self.model)))
    if self._decoding is None or len(leaves) != len(self._decoding[0]) or any(
        a is not b for a, b in zip(leaves, self._decoding[0])):
      self._decoding = (leaves, self._decoding_program(self.model))
    return self._decoding[1]

  def precompile(self, calls) -> int:
    """Compiles the generate programs of `calls` ahead of time for the current model.

    Args:
      calls: (arguments after the model, static keywords) of `generate_program`, arrays or
        `jax.ShapeDtypeStruct`s with the shardings `generate` places them with
        (`hgpo_jax.training.programs.rollout_calls`: every call a run of a config makes).
    Returns:
      how many programs are now compiled. A `generate` call whose argument shapes and
      static flags are one of them runs that executable and traces nothing; any other
      call is jit-compiled (and counted in `num_compilations`). The executables
      take the model's parameters with the shardings they had here: keep them (the
      trainer's sampler weights do).
    """
    for args, static in calls:
      key = _call_key(args, static)
      if key not in self._compiled:
        self._compiled[key] = self.generate_program.lower(self.decoding_model(), *args,
                                                          **static).compile()
    return len(self._compiled)

  def _placed(self, host: inputs_lib.DecodeInputs) -> inputs_lib.DecodeInputs:
    """`host` on the mesh (`inputs.shardings`); the key and the stop flag as given."""
    if self.mesh is None:
      placed = jax.tree.map(jnp.asarray, host)
    else:
      placed = jax.tree.map(jax.device_put, host, inputs_lib.shardings(host, self.mesh))
    return placed.replace(rng=host.rng, use_stop=host.use_stop)

  def generate(self, prompts: list[list[int]], params: types.SamplingParams, rng: jax.Array,
               allowed: list[list[str]] | None = None,
               constraint: constrained.ActionConstraint = constrained.ActionConstraint()
               ) -> types.SampleOutput:
    """Samples one response per prompt.

    Args:
      prompts: token ids of each prompt (non-empty).
      params: `types.SamplingParams`.
      rng: a JAX PRNG key.
      allowed: optional, per prompt, the strings the response must choose from (see
        `hgpo_jax.sampling.constrained`); an entry may also be a tuple of pieces with free
        spans (`constrained.FreeSpan`); an empty list leaves that row free. A row none of
        whose allowed actions fits in max_new_tokens is refused with a ValueError.
      constraint: how allowed strings appear in the response.
    Returns:
      `types.SampleOutput`.
    """
    inputs, flags = self.pack(prompts, params, rng, allowed, constraint)
    args, static = (self._placed(inputs),), dict(flags=flags)
    compiled = self._compiled.get(_call_key(args, static))
    batch, plen = inputs.tokens.shape
    if compiled is None and self._compiled:
      self.unlisted_calls += 1
      if self.unlisted_calls == 1:
        warnings.warn(f"Sampler.generate: a call of {batch} rows x prompt {plen} "
                      f"(flags {flags}) is not among the {len(self._compiled)} precompiled "
                      "programs: compiling it now (programs.rollout_calls misses a case).",
                      stacklevel=2)
    model = self.decoding_model()
    out = (compiled(model, *args) if compiled is not None
           else self.generate_program(model, *args, **static))
    out = jax.device_get(out)
    num_rows = len(prompts)
    result = self._finish(out.tokens[:num_rows], out.logprobs[:num_rows],
                          out.lengths[:num_rows], out.reasons[:num_rows], params.stop_strings)
    lengths = np.asarray(out.lengths[:num_rows], np.int64)
    return dataclasses.replace(result, decoded_tokens=int(lengths.sum()),
                               decode_row_steps=(flags.slots or batch) * int(out.steps))

  def pack(self, prompts, params: types.SamplingParams, rng, allowed=None,
           constraint: constrained.ActionConstraint = constrained.ActionConstraint()
           ) -> tuple[inputs_lib.DecodeInputs, inputs_lib.DecodeFlags]:
    """The host `DecodeInputs` (numpy arrays) and the flags of a `generate` call:
    left-padded prompts in their buckets, the shared prefill's distinct prompts, the stop
    automaton, the constraint tries and free-span masks. Raises ValueError for a call
    no bucket or vocabulary holds."""
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("Sampler.generate: give at least one prompt, each with >= 1 token.")
    if allowed is not None and len(allowed) != len(prompts):
      raise ValueError(f"Sampler.generate: allowed has {len(allowed)} entries for "
                       f"{len(prompts)} prompts; give one list of strings per prompt.")
    num_rows = len(prompts)
    batch = bucket_for(num_rows, self.batch_buckets, "batch size")
    longest = max(len(p) for p in prompts)
    plen = bucket_for(longest, self.prompt_buckets, "prompt length")
    max_new = params.max_new_tokens
    if longest + max_new > self.cfg.max_seq_len:
      raise ValueError(f"Sampler.generate: prompt of {longest} tokens + max_new_tokens={max_new} "
                       f"exceeds the model's max_seq_len={self.cfg.max_seq_len}.")
    tokens_bp, lengths_b = inputs_lib.left_padded(prompts, batch, plen, self.pad_id)
    # Rows with the same prompt (a group's N trajectories at their first step) share one
    # prefill: the unique prompts are prefilled and their cache rows copied to every row.
    first_row: dict[tuple[int, ...], int] = {}
    source = [first_row.setdefault(tuple(p), len(first_row)) for p in prompts]
    shared = self.share_prefill is not False and plen > 1 and len(first_row) < num_rows
    ubatch = self.shared_prefill_rows(batch)
    if ubatch is None:
      ubatch = bucket_for(len(first_row), self.batch_buckets, "batch size")
    else:  # a fixed row count (share_prefill=G): share only what fits in it
      shared = shared and len(first_row) <= ubatch < batch
    if shared:
      prefill_up, prefill_lengths_u = inputs_lib.left_padded(list(first_row), ubatch, plen,
                                                                 self.pad_id)
      source_b = np.zeros((batch,), np.int32)  # padding rows: any source (their mask hides it)
      source_b[:num_rows] = source
    else:
      prefill_up, prefill_lengths_u = tokens_bp, lengths_b
      source_b = np.arange(batch, dtype=np.int32)

    vocab = self.cfg.vocab_size
    if params.filtered and self.max_candidates < params.top_k < vocab and not self._warned_sort:
      self._warned_sort = True
      warnings.warn(f"Sampler: top_k={params.top_k} > max_candidates={self.max_candidates}: "
                    "every sampled token sorts the vocabulary (exact, slow); construct the "
                    f"Sampler with max_candidates >= {params.top_k}.", stacklevel=3)
    stop_table = self.tables.stop_table(tuple(params.stop_strings))
    # Any `allowed` (even all rows free) runs the constrained program: whether a call is
    # constrained is then the caller's setting, not its data (free rows sample as unconstrained).
    tries, free_masks = self.tables.tries(allowed, constraint, batch, max_new)
    inputs = inputs_lib.DecodeInputs(
        tokens=tokens_bp, lengths=lengths_b, row_valid=np.arange(batch) < num_rows,
        prefill_tokens=prefill_up, prefill_lengths=prefill_lengths_u, source=source_b,
        rng=rng, temperature=np.float32(max(params.temperature, 1e-6)),
        top_k=np.int32(params.top_k), top_p=np.float32(params.top_p), stop_table=stop_table,
        use_stop=np.bool_(bool(params.stop_strings)),
        need_logprobs=np.bool_(params.need_logprobs), tries=inputs_lib.TrieArrays.of(tries),
        free_masks=free_masks)
    return inputs, inputs_lib.DecodeFlags.of(params, constrained=allowed is not None,
                                             shared_prefill=shared, slots=self.slots_for(batch))

  def _finish(self, out_tokens, out_logp, num_b, reason_b, stop_strings) -> types.SampleOutput:
    """Cuts rows to length, decodes them and re-checks stop strings on the text."""
    tokens, logprobs, texts, reasons = [], [], [], []
    decode = self.tokenizer.decode
    eos = set(self.eos_ids)
    for row_tokens, row_logp, n, r in zip(out_tokens, out_logp, num_b, reason_b):
      ids = [int(t) for t in row_tokens[:n]]
      logp = np.asarray(row_logp[:n], np.float32)
      reason = types.STOP_REASONS[int(r)]
      body = ids[:-1] if reason == "eos" and ids and ids[-1] in eos else ids
      text = decode(body)
      if stop_strings and reason != "constraint":
        end = _first_stop_end(text, stop_strings)
        if end is not None:
          # Fewest tokens whose text holds a stop string (monotone in the prefix length).
          lo, hi = 1, len(body)
          while lo < hi:
            mid = (lo + hi) // 2
            if _first_stop_end(decode(body[:mid]), stop_strings) is None:
              lo = mid + 1
            else:
              hi = mid
          ids, logp = body[:lo], logp[:lo]
          text = decode(ids)
          text = text[:_first_stop_end(text, stop_strings)]
          reason = "stop_string"
      tokens.append(ids)
      logprobs.append(logp)
      texts.append(text)
      reasons.append(reason)
    return types.SampleOutput(tokens=tokens, logprobs=logprobs, texts=texts, stop_reason=reasons)


def _call_key(args, static: dict) -> tuple:
  """What selects a compiled generate program: the shapes and dtypes of its arguments
  after the model (arrays or `jax.ShapeDtypeStruct`s) and its static keywords."""
  shapes = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args))
  return shapes + tuple(sorted(static.items()))


def _first_stop_end(text: str, stop_strings: Sequence[str]) -> int | None:
  """End index of the stop-string occurrence that completes first in `text`, or None."""
  ends = [i + len(s) for s in stop_strings if (i := text.find(s)) >= 0]
  return min(ends) if ends else None
