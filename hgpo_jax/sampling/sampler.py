"""The jit KV-cache sampler: batched prompts -> responses, token log-probs and stop reasons.

One call of `Sampler.generate`:
  1. Host: prompts are left-padded into an int32[Bb, P] array; Bb and P are the batch and
     prompt-length buckets (the smallest configured bucket that fits), so a rollout that
     keeps producing prompts of similar size reuses one compiled program.
  2. Device, one jit: prefill of the first P-1 prompt slots into a KV cache of length
     S = P + max_new_tokens - 1 (hidden states only: no [B, P, V] logits are formed),
     then a `lax.while_loop` over new tokens that feeds the previous token (the last
     prompt token first) at slot P-1+j, samples token j, and exits early once every row is
     finished. Finished rows keep flowing through the fixed-shape loop but record nothing.
  3. Host: token ids, log-probs and texts are cut to each row's length; stop strings are
     re-checked on the decoded text and the response is truncated right after the first
     one (see `SampleOutput`).

Continuous batching (`Sampler(decode_slots=S)`, `rollout.decode_slots`): a call of more
than S rows decodes them in S cache rows ("slots") instead of one per row. Each step of
the decode loop first admits waiting rows into free slots (their prompts prefilled into
the slot's cache, `prefill_rows` rows at a time, or copied from a shared prefill), then
decodes every slot at its own cache offset (`Decoder.hidden` with a per-row
`cache_index`); a row that finishes frees its slot at once. A row samples token j with the
same key as in the lockstep loop, so the samples are the lockstep program's (log-probs
within float rounding: the matmuls run over S rows instead of Bb). The cache holds S rows,
and the row-steps spent on finished rows (`SampleOutput.decode_row_steps` minus the
decoded tokens) are those of the call's last rows only. The loop runs more steps of fewer
rows, so whether the wall time gains depends on how a step's cost grows with its rows and
on the spread of the response lengths (`python -m launch.benchmarks.decode_slots`,
docs/performance.md); the cache's memory shrinks to S rows in every case.

Left padding: row b holds its n_b prompt tokens in slots [P - n_b, P); slot s has RoPE
position s - (P - n_b), so the first real token has position 0 whatever the padding.
Query slot q attends key slot s iff P - n_b <= s <= q.

Per-token randomness: token j of row b uses `fold_in(fold_in(rng, j), b)`, so a row's
sample does not depend on the batch bucket or on how the batch is sharded.

Constraints (`allowed`): per row a token trie (`hgpo_jax.sampling.constrained`), possibly
with free spans (a free query inside `search[...]`, a HiPER subgoal): at a free node the
row writes free tokens (a per-class token mask) up to the span's cap, and never so many that
the shortest completion of the trie would no longer fit in max_new_tokens. A row none of
whose allowed actions fits in max_new_tokens is refused with a ValueError: truncated, its
response could only be an invalid action. (A single action longer than max_new_tokens
among shorter ones is still allowed and, if chosen, truncated: size max_new_tokens to the
longest action.)

Compilation: the jitted function is keyed by the shapes (Bb, P, automaton/trie sizes) and
the static flags (max_new_tokens, greedy, top-k/top-p on, constraint mode, ignore_eos).
Temperature, top_k and top_p values are traced scalars, so training (T = 1.0) and
evaluation (T = 0.4) share one program. The model is passed to the jitted function
as an argument (NNX modules are pytrees), so weight updates made in place by the trainer
are picked up without recompiling. `Sampler.num_compilations` counts traces.

Top-k / top-p (`filter_logits`) take the `max_candidates` largest logits of each row with
`jax.lax.top_k` instead of sorting the vocabulary, and decide the kept set on them whenever
that is exact: top_k <= max_candidates, or top_k off and the top_p nucleus inside the
candidates. A step where some row's nucleus is wider (or K < top_k < V) sorts the
vocabulary as before (`lax.cond`), so the kept set, and the token a key samples, do not
differ from the sort's (up to the rounding of the probability sums, for a token whose
mass-before lies within float rounding of top_p). Unfiltered sampling (top_k = 0 and
top_p = 1, e.g. training at T = 1) samples the full distribution without either.
"""

from __future__ import annotations

import bisect
import dataclasses
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hgpo_jax.models import attention
from hgpo_jax.models import decoder
from hgpo_jax.models import sharding
from hgpo_jax.sampling import constrained

STOP_REASONS = ("running", "eos", "stop_string", "constraint", "length")
TRIE_ARRAYS = ("edge_parent", "edge_token", "edge_child", "terminal", "has_children", "active",
                "free_class", "free_min", "free_max", "to_leaf")
"""The `constrained.ConstraintTries` fields `Sampler.generate_program` takes, in argument
order (after the stop-string flag, before the free-span masks)."""
_EOS, _STOP, _CONSTRAINT, _LENGTH = 1, 2, 3, 4
# Phases of a row: unconstrained, or walking its constraint trie.
_FREE, _IN_TRIE = 0, 1
NO_CONSTRAINT = 0
"""Static `constraint_mode` of `Sampler.generate_program`: free decoding (no `allowed`)."""
WHOLE_CONSTRAINT = 1
"""Static `constraint_mode` of `Sampler.generate_program`: rows walk their constraint trie."""


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to sample a response.

  Attributes:
    temperature: softmax temperature; 0 means greedy (argmax).
    top_k: keep the k most likely tokens (0 = off). Ties at the k-th logit are kept.
      Cheapest when top_k <= the sampler's max_candidates (otherwise every filtered
      step sorts the vocabulary; same result).
    top_p: nucleus sampling: keep the smallest set of most likely tokens whose
      probability (after temperature and top-k) reaches top_p (1.0 = off). Ties at the
      last kept logit are kept.
    max_new_tokens: most tokens generated per response (static: part of the compile key).
    stop_strings: generation of a row stops once its decoded text contains one of these;
      the returned response ends right after it.
    ignore_eos: keep generating past EOS tokens (benchmarks that need a fixed number of
      tokens; static).
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 512
  stop_strings: tuple[str, ...] = ()
  ignore_eos: bool = False

  @property
  def greedy(self) -> bool:
    """Argmax decoding (temperature 0): a static flag of the generate program."""
    return self.temperature == 0.0

  @property
  def filtered(self) -> bool:
    """Sampling with top-k or top-p on: a static flag of the generate program."""
    return not self.greedy and (self.top_k > 0 or self.top_p < 1.0)

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"SamplingParams.temperature={self.temperature} must be >= 0 (0 = greedy).")
    if self.top_k < 0:
      raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 = off).")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1] (1 = off).")
    if self.max_new_tokens < 1:
      raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1.")
    if isinstance(self.stop_strings, str) or any(not s for s in self.stop_strings):
      raise ValueError(f"SamplingParams.stop_strings={self.stop_strings!r} must be a tuple of "
                       "non-empty strings.")


@dataclasses.dataclass
class SampleOutput:
  """What `Sampler.generate` returns, one entry per prompt.

  Attributes:
    tokens: response token ids, up to and including the EOS token or the token that
      completed the stop string / the constrained string.
    logprobs: f32[len(tokens)] log-prob of each response token under the model's raw
      distribution, log_softmax(logits) at temperature 1 without top-k/top-p or
      constraint masks: the "old log-prob" of PPO, which a teacher-forced forward pass of
      the same model over prompt + response reproduces.
    texts: decoded responses, without a final EOS token, truncated right after a stop
      string.
    stop_reason: "eos" | "stop_string" | "length" | "constraint" (the constrained string
      was completed).
    decoded_tokens: tokens the decode loop sampled for live rows (before stop strings
      are cut on the host).
    decode_row_steps: row-steps the decode loop ran: the batch bucket x its iterations
      (the longest row's length). decoded_tokens / decode_row_steps is the fraction of
      the loop's work that produced a token; the rest went to rows that had finished
      (they run in lockstep until the slowest ends) and to padding rows.
  """
  tokens: list[list[int]]
  logprobs: list[np.ndarray]
  texts: list[str]
  stop_reason: list[str]
  decoded_tokens: int = 0
  decode_row_steps: int = 0


def _bucket_for(n: int, buckets: Sequence[int], what: str) -> int:
  i = bisect.bisect_left(buckets, n)
  if i == len(buckets):
    raise ValueError(f"Sampler: {what} {n} exceeds the largest bucket {buckets[-1]}; "
                     f"add a larger bucket or shorten the input.")
  return buckets[i]


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
    platform = attention.target_platform(mesh_or_devices)
    return jnp.dtype(jnp.bfloat16 if platform in ("tpu", "gpu", "cuda", "rocm") else compute_dtype)
  return jnp.dtype(compute_dtype if name == "" else name)


DEFAULT_MAX_CANDIDATES = 256
"""Default `Sampler(max_candidates=...)`: the candidates `lax.top_k` takes per row and step
(`filter_logits`). Covers the usual top_k (20-100) and most top_p nuclei; on the 2-core CPU
`lax.top_k` of 8 x 151,936 logits took 8.6 ms at K = 256 and 7.1 ms at K = 64, the sort
517 ms (docs/performance.md)."""


def _sort_filter(scaled_bv: jax.Array, top_k, top_p) -> jax.Array:
  """The full-vocabulary sort filter (`filter_logits` on its fallback; module docstring)."""
  vocab = scaled_bv.shape[-1]
  sorted_bv = -jnp.sort(-scaled_bv, axis=-1)  # descending
  rank_v = jnp.arange(vocab)
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k_bv = rank_v[None, :] < k
  probs_bv = jax.nn.softmax(jnp.where(in_top_k_bv, sorted_bv, -jnp.inf), axis=-1)
  mass_before_bv = jnp.cumsum(probs_bv, axis=-1) - probs_bv
  # top_p >= 1 must keep everything even where the cumulative sum rounds up to 1.
  keep_bv = in_top_k_bv & ((mass_before_bv < top_p) | (top_p >= 1.0))
  num_kept_b = jnp.sum(keep_bv, axis=-1)  # >= 1: the first token has mass_before 0
  cutoff_b = jnp.take_along_axis(sorted_bv, (num_kept_b - 1)[:, None], axis=-1)
  return jnp.where(scaled_bv >= cutoff_b, scaled_bv, -jnp.inf)


def candidate_filter(scaled_bv: jax.Array, top_k, top_p, max_candidates: int
                     ) -> tuple[jax.Array, jax.Array]:
  """Top-k / top-p over the `max_candidates` largest logits only (`jax.lax.top_k`).

  Args:
    scaled_bv: f32[B, V] logits after temperature (may hold -inf).
    top_k: int32 scalar, 0 = off.
    top_p: f32 scalar in (0, 1], 1 = off.
    max_candidates: K (static), 1 <= K; K >= V takes all V.
  Returns:
    (f32[B, V] filtered logits, bool[B] exact): where `exact[b]`, row b equals the sort
    filter's row (`_sort_filter`; up to the float rounding of the softmax normaliser and
    its cumulative sum, which only matters for a token whose mass-before lies within
    ~1e-7 of top_p). A row is exact when the kept set is decided inside the K candidates:
    top_k in [1, K] (the nucleus lies inside the top-k set), or top_k off (or >= V) and the
    K candidates hold at least top_p < 1 of the probability (the normaliser is then the
    full row's logsumexp, one pass over V). Otherwise (K < top_k < V, or a nucleus wider
    than K) the row is not exact and `filter_logits` falls back to the sort.
  """
  vocab = scaled_bv.shape[-1]
  cands = min(max_candidates, vocab)
  # The sorted prefix's values, descending. The barrier keeps XLA from folding the slices
  # below (top_bk[:, :1]) into a slice of the sort that TopK is decomposed into, which
  # stops it from rewriting that sort back into a TopK: XLA:CPU then sorted all V logits
  # (0.94 s instead of 0.013 s at 8 x 151,936; docs/performance.md).
  top_bk = jax.lax.optimization_barrier(jax.lax.top_k(scaled_bv, cands)[0])
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  in_top_k_bk = jnp.arange(cands)[None, :] < k
  # Softmax over the top-k set as the sort filter's (max = the first value): from the
  # candidates when k <= K, else (k = V) from the whole row.
  exp_bk = jnp.exp(jnp.where(in_top_k_bk, top_bk - top_bk[:, :1], -jnp.inf))
  total_b = jax.lax.cond(k <= cands, lambda: jnp.sum(exp_bk, axis=-1),
                         lambda: jnp.sum(jnp.exp(scaled_bv - top_bk[:, :1]), axis=-1))
  probs_bk = exp_bk / total_b[:, None]
  cum_bk = jnp.cumsum(probs_bk, axis=-1)
  mass_before_bk = cum_bk - probs_bk
  keep_bk = in_top_k_bk & ((mass_before_bk < top_p) | (top_p >= 1.0))
  num_kept_b = jnp.sum(keep_bk, axis=-1)  # >= 1: the first token has mass_before 0
  cutoff_b = jnp.take_along_axis(top_bk, (num_kept_b - 1)[:, None], axis=-1)
  # k > K: only exact if k = V and the nucleus closes inside the candidates (the candidate
  # past the last one would not be kept: its mass-before, cum[K-1], reaches top_p).
  exact_b = (k <= cands) | ((k == vocab) & (top_p < 1.0) & (cum_bk[:, -1] >= top_p))
  return jnp.where(scaled_bv >= cutoff_b, scaled_bv, -jnp.inf), exact_b


def filter_logits(logits_bv: jax.Array, temperature, top_k, top_p,
                  max_candidates: int = DEFAULT_MAX_CANDIDATES) -> jax.Array:
  """Temperature, then top-k, then top-p (the Hugging Face order); removed tokens -> -inf.

  The kept set is decided on the `max_candidates` largest logits (`jax.lax.top_k`, no sort
  of the vocabulary) when that is exact for every row of the batch (`candidate_filter`:
  top_k <= max_candidates, or top_k off and the nucleus inside the candidates); otherwise
  the step sorts the whole vocabulary as before (`lax.cond`: exact, at the old cost).
  Either way the result is the sort filter's, so the same keys sample the same tokens.

  Args:
    logits_bv: f32[B, V] (may already hold -inf for masked tokens).
    temperature: f32 scalar > 0.
    top_k: int32 scalar, 0 = off.
    top_p: f32 scalar in (0, 1], 1 = off.
    max_candidates: static bound K of the candidates (>= 1).
  Returns:
    f32[B, V] scaled logits with the removed tokens at -inf. Ties with the cut-off
    logit are kept (all of them, even past top_k or past the K candidates).
  """
  if max_candidates < 1:
    raise ValueError(f"filter_logits: max_candidates={max_candidates} must be >= 1.")
  scaled_bv = logits_bv / temperature
  filtered_bv, exact_b = candidate_filter(scaled_bv, top_k, top_p, max_candidates)
  return jax.lax.cond(jnp.all(exact_b), lambda: filtered_bv,
                      lambda: _sort_filter(scaled_bv, top_k, top_p))


def prefill_layout(lengths_b: jax.Array, prompt_len: int) -> tuple[jax.Array, jax.Array]:
  """(positions, segment ids), each int32[B, P-1], of the prefill of left-padded prompts.

  Row b holds its n_b = lengths_b[b] prompt tokens in slots [P - n_b, P) (module
  docstring); the prefill runs slots [0, P-1). Slot s has position max(s - (P - n_b), 0)
  and segment 1 if real, else 0 (padding, which real tokens never read).
  """
  pad_b = prompt_len - lengths_b
  slot_t = jnp.arange(prompt_len - 1)
  positions_bt = jnp.maximum(slot_t[None, :] - pad_b[:, None], 0)
  return positions_bt, (slot_t[None, :] >= pad_b[:, None]).astype(jnp.int32)


def decode_positions(lengths_b: jax.Array, step) -> jax.Array:
  """int32[B, 1] position of the token fed at decode step `step` (the last prompt token at
  step 0), written at cache slot P - 1 + step. The decoder reads row b's earlier tokens
  from the slots [slot - position, slot) = [P - n_b, slot): no mask is needed."""
  return (lengths_b - 1 + step)[:, None]


class Sampler:
  """Jit-compiled batched sampler over a decoder with a KV cache (see module docstring).

  Args:
    model: a `hgpo_jax.models.decoder.Decoder` (its `cfg` gives the cache shape).
    tokenizer: the model's tokenizer (encode, decode, eos_ids, pad_id, token_strings).
    prompt_buckets: allowed padded prompt lengths P (sorted ascending).
    batch_buckets: allowed padded batch sizes Bb (sorted ascending). With a mesh each is
      rounded up to a multiple of the mesh's data-parallel size.
    mesh: optional mesh from `hgpo_jax.models.sharding.make_mesh` over this process's own
      devices (each process of a multi-process run samples its own prompts); prompts, outputs and
      the KV cache are split over the mesh axes of the logical "batch" axis (data, fsdp),
      the cache's kv-heads over "tensor"; the model keeps the shardings its parameters
      already have (`hgpo_jax.models.sharding.shard_model`).
    share_prefill: rows of one call with the same prompt (a group's trajectories at
      their first step) are prefilled once and share the cache rows (the decode stays per
      row). True: the shared prefill runs the batch bucket of the call's distinct prompts
      (a program per pair of buckets); an int G >= 2 (the rollout's group size): it always
      runs `shared_prefill_rows(Bb)` = the bucket of ceil(Bb / G) rows, and a call with
      more distinct prompts than that prefills every row, so each (Bb, P) has at most two
      programs (`hgpo_jax.training.programs.rollout_calls` lists them); False prefills
      every row.
    max_candidates: K of top-k / top-p sampling (`filter_logits`): the largest logits per
      row and step that `jax.lax.top_k` takes; a top_k above K, or a top_p nucleus wider
      than K candidates, costs a full-vocabulary sort on that step (exact either way).
    cache_dtype: the KV cache's dtype, one of `CACHE_DTYPES` (`resolve_cache_dtype`
      against the mesh's devices, else this process's): "auto" = bfloat16 on TPU/GPU, the
      compute dtype on CPU.
    prefill_rows: rows prefilled per step of the prefill loop (`rollout.prefill_chunk_rows`;
      a multiple of the mesh's batch-parallel size): the prefill's activations are those of
      this many rows instead of all rows of the call (the MLP intermediates of every row
      at once set the generate program's peak); the same keys/values. A shared prefill's
      copy of the unique rows' cache to the call's rows goes as many rows per step. 0, or
      a call with at most this many rows or a count it does not divide: one step.
    decode_slots: continuous batching (module docstring): a call of more bucketed rows
      than this decodes them in this many cache rows, admitting rows as slots free (a
      multiple of the mesh's batch-parallel size; 0 = lockstep, every row its own cache
      row). `slots_for(Bb)` is the generate program's static `slots` flag.
    trie_nodes: nodes (and edges) of every constrained call's per-row token tries, fixed,
      so that constrained programs take their shapes from the config
      (`rollout.max_trie_nodes`); a call whose trie needs more raises ValueError. 0: the
      next power of two of each call's largest trie (programs can differ between calls).

  Attributes:
    generate_program: the jitted device program `generate` calls (prefill + decode loop),
      public so that `hgpo_jax.training.programs` can lower and compile exactly it (and
      `precompile` compile its calls ahead of time). Its
      positional arguments: the model, then the arrays `generate` places (tokens, lengths,
      row validity, prefill tokens and lengths, row sources, rng, temperature, top_k, top_p,
      stop table, stop flag), the `TRIE_ARRAYS` in that order, and the free-span masks; its
      static keywords: max_new_tokens, greedy, filtered, constraint_mode (`NO_CONSTRAINT` or
      `WHOLE_CONSTRAINT`), ignore_eos, shared_prefill, slots.
  """

  def __init__(self, model, tokenizer, *, prompt_buckets=(128, 256, 512, 1024, 2048, 4096),
               batch_buckets=(1, 2, 4, 8, 16, 32, 64, 128), mesh=None, share_prefill=True,
               max_candidates=DEFAULT_MAX_CANDIDATES, cache_dtype="auto", trie_nodes=0,
               prefill_rows=0, decode_slots=0):
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
    self.share_prefill = share_prefill  # rows with one prompt share its prefill (generate)
    self.tokenizer = tokenizer
    self.cfg = model.cfg
    self.mesh = mesh
    self.cache_dtype = resolve_cache_dtype(
        cache_dtype, jax.local_devices() if mesh is None else mesh, model.cfg.compute_dtype)
    self.prompt_buckets = tuple(sorted(prompt_buckets))
    data_size = 1
    if mesh is not None and not all(d.process_index == jax.process_index()
                                    for d in mesh.devices.flat):
      # Prompts are host arrays of this process only (`_place`); a mesh with other
      # processes' devices would need every process to send the same prompts in lockstep.
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
    self._token_strings = None
    self._automata: dict[tuple[str, ...], constrained.TokenAutomaton] = {}
    self._free_masks: dict[str, np.ndarray] = {}
    self._warned_sort = False  # top_k > max_candidates warned once
    self.num_compilations = 0  # traces of the jitted program (one per new bucket/flags)
    # programs compiled ahead of time (`precompile`), by `_call_key` of their arguments
    self._compiled: dict[tuple, jax.stages.Compiled] = {}
    self.unlisted_calls = 0  # calls that found no precompiled program (with some compiled)
    # (traced with the mesh in context: the splash attention kernel shard_maps over it)
    self.generate_program = jax.jit(
        attention.traced_on(mesh, self._generate_device),
        static_argnames=("max_new_tokens", "greedy", "filtered", "constraint_mode", "ignore_eos",
                         "shared_prefill", "slots"))

  # ----------------------------------------------------------------------------- host side
  def token_strings(self) -> list[str]:
    """Decoded text of every token id (computed once)."""
    if self._token_strings is None:
      strings = list(self.tokenizer.token_strings())
      if len(strings) < self.cfg.vocab_size:  # ids past the tokenizer's vocab never match
        strings += [""] * (self.cfg.vocab_size - len(strings))
      self._token_strings = strings[:self.cfg.vocab_size]
    return self._token_strings

  def automaton(self, patterns: tuple[str, ...]) -> constrained.TokenAutomaton:
    """The token automaton of `patterns`, built once per distinct tuple."""
    if patterns not in self._automata:
      self._automata[patterns] = constrained.build_token_automaton(patterns, self.token_strings())
    return self._automata[patterns]

  def free_mask(self, forbidden: str) -> np.ndarray:
    """bool[V]: tokens a free span may write (`constrained.free_token_mask`), built once."""
    if forbidden not in self._free_masks:
      special = set(self.eos_ids) | {self.pad_id}
      backend = getattr(self.tokenizer, "backend", None)
      if backend is not None and hasattr(backend, "get_added_tokens_decoder"):
        special |= {int(i) for i, t in backend.get_added_tokens_decoder().items() if t.special}
      self._free_masks[forbidden] = constrained.free_token_mask(
          self.token_strings(), forbidden, sorted(special))
    return self._free_masks[forbidden]

  def shared_prefill_rows(self, batch: int) -> int | None:
    """Rows of the shared prefill of a call of `batch` (bucketed) rows with
    `share_prefill=G`: the batch bucket of ceil(batch / G); None when the count follows
    the call's distinct prompts (`share_prefill=True`) or nothing is shared."""
    if isinstance(self.share_prefill, bool):
      return None
    return _bucket_for(-(-batch // self.share_prefill), self.batch_buckets, "batch size")

  @property
  def admit_rows(self) -> int:
    """Rows a slotted decode admits (prefills into free slots) at a time: `prefill_rows`,
    else the mesh's batch-parallel size (at most `decode_slots`)."""
    return min(self.prefill_rows or self.batch_parallel, self.decode_slots or 1 << 30)

  def decode_loop_weights(self, batch: int, max_new_tokens: int) -> tuple[float, ...]:
    """Trip counts of the generate program's data-dependent loops, outermost first, as
    upper bounds for cost estimates (`perf.hlo_matmul_flops`): lockstep, max_new_tokens
    steps; slotted (S slots), ceil(Bb / S) x max_new_tokens steps, inside which the
    admission loop runs ceil(Bb / admit) times in all (a fraction per step)."""
    slots = self.slots_for(batch)
    if not slots:
      return (max_new_tokens,)
    steps = -(-batch // slots) * max_new_tokens
    return (steps, -(-batch // self.admit_rows) / steps)

  def slots_for(self, batch: int) -> int:
    """The `slots` flag of a call of `batch` (bucketed) rows: `decode_slots` when the call
    has more rows than that, else 0 (every row has its own cache row)."""
    return self.decode_slots if 0 < self.decode_slots < batch else 0

  def precompile(self, calls) -> int:
    """Compiles the generate programs of `calls` ahead of time for the current model.

    Args:
      calls: (arguments after the model, static keywords) of `generate_program`, arrays or
        `jax.ShapeDtypeStruct`s with the shardings `generate` places them with
        (`hgpo_jax.training.programs.rollout_calls`: every call a run of a config makes).
    Returns:
      how many programs are now compiled. A `generate` call whose argument shapes and
      static flags are one of them runs that executable and traces nothing; any other
      call is jit-compiled as before (and counted in `num_compilations`). The executables
      take the model's parameters with the shardings they had here: keep them (the
      trainer's sampler weights do).
    """
    for args, static in calls:
      key = _call_key(args, static)
      if key not in self._compiled:
        self._compiled[key] = self.generate_program.lower(self.model, *args, **static).compile()
    return len(self._compiled)

  def _place(self, x):
    """Puts a host array on the mesh, split over the batch axes on its leading dim."""
    if self.mesh is None:
      return jnp.asarray(x)
    spec = sharding.logical_to_spec(("batch",) + (None,) * (x.ndim - 1), self.mesh, shape=x.shape)
    return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, spec))

  def _replicate(self, x):
    if self.mesh is None:
      return jnp.asarray(x)
    return jax.device_put(x, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

  def generate(self, prompts: list[list[int]], params: SamplingParams, rng: jax.Array,
               allowed: list[list[str]] | None = None,
               constraint: constrained.ActionConstraint = constrained.ActionConstraint()
               ) -> SampleOutput:
    """Samples one response per prompt.

    Args:
      prompts: token ids of each prompt (non-empty).
      params: SamplingParams.
      rng: a JAX PRNG key.
      allowed: optional, per prompt, the strings the response must choose from (see
        `hgpo_jax.sampling.constrained`); an entry may also be a tuple of pieces with free
        spans (`constrained.FreeSpan`); an empty list leaves that row free.
      constraint: how allowed strings appear in the response.
    Returns:
      SampleOutput.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("Sampler.generate: give at least one prompt, each with >= 1 token.")
    if allowed is not None and len(allowed) != len(prompts):
      raise ValueError(f"Sampler.generate: allowed has {len(allowed)} entries for "
                       f"{len(prompts)} prompts; give one list of strings per prompt.")
    num_rows = len(prompts)
    batch = _bucket_for(num_rows, self.batch_buckets, "batch size")
    longest = max(len(p) for p in prompts)
    plen = _bucket_for(longest, self.prompt_buckets, "prompt length")
    max_new = params.max_new_tokens
    if longest + max_new > self.cfg.max_seq_len:
      raise ValueError(f"Sampler.generate: prompt of {longest} tokens + max_new_tokens={max_new} "
                       f"exceeds the model's max_seq_len={self.cfg.max_seq_len}.")

    tokens_bp = np.full((batch, plen), self.pad_id, np.int32)
    lengths_b = np.ones((batch,), np.int32)  # padding rows: one pad token, finished at once
    for b, prompt in enumerate(prompts):
      tokens_bp[b, plen - len(prompt):] = prompt
      lengths_b[b] = len(prompt)
    row_valid_b = np.arange(batch) < num_rows
    # Rows with the same prompt (a group's N trajectories at their first step) share one
    # prefill: the unique prompts are prefilled and their cache rows copied to every row.
    first_row: dict[tuple[int, ...], int] = {}
    source = [first_row.setdefault(tuple(p), len(first_row)) for p in prompts]
    shared = self.share_prefill is not False and plen > 1 and len(first_row) < num_rows
    ubatch = self.shared_prefill_rows(batch)
    if ubatch is None:
      ubatch = _bucket_for(len(first_row), self.batch_buckets, "batch size")
    else:  # a fixed row count (share_prefill=G): share only what fits in it
      shared = shared and len(first_row) <= ubatch < batch
    if shared:
      prefill_up = np.full((ubatch, plen), self.pad_id, np.int32)
      prefill_lengths_u = np.ones((ubatch,), np.int32)
      for u, prompt in enumerate(first_row):
        prefill_up[u, plen - len(prompt):] = prompt
        prefill_lengths_u[u] = len(prompt)
      source_b = np.zeros((batch,), np.int32)  # padding rows: any source (their mask hides it)
      source_b[:num_rows] = source
    else:
      prefill_up, prefill_lengths_u, source_b = tokens_bp, lengths_b, np.arange(batch, dtype=np.int32)

    # Any `allowed` (even all rows free) runs the constrained program: whether a call is
    # constrained is then the caller's setting, not its data (free rows sample as unconstrained).
    mode = NO_CONSTRAINT if allowed is None else WHOLE_CONSTRAINT
    greedy, filtered = params.greedy, params.filtered
    vocab = self.cfg.vocab_size
    if filtered and self.max_candidates < params.top_k < vocab and not self._warned_sort:
      self._warned_sort = True
      warnings.warn(f"Sampler: top_k={params.top_k} > max_candidates={self.max_candidates}: "
                    "every sampled token sorts the vocabulary (exact, slow); construct the "
                    f"Sampler with max_candidates >= {params.top_k}.", stacklevel=2)

    stop_table = (self.automaton(tuple(params.stop_strings)).table if params.stop_strings
                  else np.zeros((1, vocab), np.int32))
    free_masks = np.zeros((2, vocab), bool)
    if mode == NO_CONSTRAINT:
      tries = constrained.build_tries([], 1)
    else:
      encode = self.tokenizer.encode
      sequences = [constrained.constrained_token_sequences(a, constraint, encode) if a else []
                   for a in allowed]
      for row, seqs in zip(allowed, sequences):
        if seqs and min(constrained.min_length(q) for q in seqs) > max_new:
          # Truncated, every response of this row would be an invalid action.
          shortest = min(zip(row, seqs), key=lambda e: constrained.min_length(e[1]))
          raise ValueError(
              f"Sampler.generate: no allowed action fits in max_new_tokens={max_new}: the "
              f"shortest, {shortest[0]!r}, needs {constrained.min_length(shortest[1])} tokens "
              f"with {constraint}; raise max_new_tokens (rollout.max_new_tokens).")
      tries = constrained.build_tries(sequences, batch, self.trie_nodes)
      bad = [t for seqs in sequences for s in seqs for t in s
             if not isinstance(t, constrained.FreeSpan) and not 0 <= t < vocab]
      # Free-span classes: [C, V] with C a power of two (>= 2), so batches with and without
      # free spans share one program.
      classes = constrained.power_of_two_bucket(len(tries.free_forbidden), 2)
      free_masks = np.zeros((classes, vocab), bool)
      for c, forbidden in enumerate(tries.free_forbidden):
        free_masks[c] = self.free_mask(forbidden)
      if bad:
        raise ValueError(f"Sampler.generate: allowed strings tokenize to ids {bad[:3]} outside "
                         f"the model's vocabulary of {vocab}.")

    rep = self._replicate
    by_row = lambda x: self._place(x) if x.shape[0] == batch else rep(x)
    args = (self._place(tokens_bp), self._place(lengths_b), self._place(row_valid_b),
            self._place(prefill_up), self._place(prefill_lengths_u), self._place(source_b), rng,
            rep(np.float32(max(params.temperature, 1e-6))), rep(np.int32(params.top_k)),
            rep(np.float32(params.top_p)), rep(stop_table), np.bool_(bool(params.stop_strings)),
            *(by_row(getattr(tries, name)) for name in TRIE_ARRAYS), rep(free_masks))
    static = dict(max_new_tokens=max_new, greedy=greedy, filtered=filtered, constraint_mode=mode,
                  ignore_eos=params.ignore_eos, shared_prefill=shared,
                  slots=self.slots_for(batch))
    compiled = self._compiled.get(_call_key(args, static))
    if compiled is None and self._compiled:
      self.unlisted_calls += 1
      if self.unlisted_calls == 1:
        warnings.warn(f"Sampler.generate: a call of {batch} rows x prompt {plen} "
                      f"(flags {static}) is not among the {len(self._compiled)} precompiled "
                      "programs: compiling it now (programs.rollout_calls misses a case).",
                      stacklevel=2)
    out = (compiled(self.model, *args) if compiled is not None
           else self.generate_program(self.model, *args, **static))
    out_tokens, out_logp, num_b, reason_b, steps = jax.device_get(out)
    result = self._finish(out_tokens[:num_rows], out_logp[:num_rows], num_b[:num_rows],
                          reason_b[:num_rows], params.stop_strings)
    lengths = np.asarray(num_b[:num_rows], np.int64)
    return dataclasses.replace(result, decoded_tokens=int(lengths.sum()),
                               decode_row_steps=(static["slots"] or batch) * int(steps))

  def _finish(self, out_tokens, out_logp, num_b, reason_b, stop_strings) -> SampleOutput:
    """Cuts rows to length, decodes them and re-checks stop strings on the text."""
    tokens, logprobs, texts, reasons = [], [], [], []
    decode = self.tokenizer.decode
    eos = set(self.eos_ids)
    for row_tokens, row_logp, n, r in zip(out_tokens, out_logp, num_b, reason_b):
      ids = [int(t) for t in row_tokens[:n]]
      logp = np.asarray(row_logp[:n], np.float32)
      reason = STOP_REASONS[int(r)]
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
    return SampleOutput(tokens=tokens, logprobs=logprobs, texts=texts, stop_reason=reasons)

  # --------------------------------------------------------------------------- device side
  def _chunks(self, rows: int) -> bool:
    """Whether `rows` rows are prefilled (or, shared, copied) `prefill_rows` at a time."""
    return bool(self.prefill_rows) and rows > self.prefill_rows and rows % self.prefill_rows == 0

  def _chunked_copy(self, cache_u, source_b, cache_b):
    """A shared prefill's B-row cache, row b = `cache_u`'s row `source_b[b]`, written into
    the empty `cache_b` in place, `prefill_rows` rows per loop step (each device its own
    block of rows, as `_chunked_prefill`): only the U-row cache and one step's rows are
    live beside it. `jnp.take` of all B rows at once made XLA:TPU keep a second B-row
    cache next to the decode loop's (docs/performance.md)."""
    d = self.batch_parallel
    batch = source_b.shape[0]
    per, c = batch // d, self.prefill_rows // d
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

  def _chunked_prefill(self, model, tokens_ut, positions_ut, segment_ids_ut, cache):
    """The prefill of U rows in U / prefill_rows steps of a loop, each writing its rows'
    keys/values into `cache` in place. Rows split over D batch-parallel devices lie in
    contiguous blocks of U / D, so step i takes rows [i c, (i + 1) c) of every device's
    block (c = prefill_rows / D): each device prefills its own rows, no row moves."""
    cfg = self.cfg
    d = self.batch_parallel
    unique, t = tokens_ut.shape
    per, c = unique // d, self.prefill_rows // d
    blocks = lambda x: x.reshape(d, per, *x.shape[1:])  # noqa: E731
    tok, pos, seg = blocks(tokens_ut), blocks(positions_ut), blocks(segment_ids_ut)
    k_all = cache.k.reshape(cache.k.shape[0], d, per, *cache.k.shape[2:])
    v_all = cache.v.reshape(k_all.shape)

    def step(i, kv):
      k_all, v_all = kv
      take = lambda x: jax.lax.dynamic_slice_in_dim(x, i * c, c, axis=1).reshape(d * c, t)  # noqa: E731
      part = decoder.init_cache(cfg, d * c, t, cache.k.dtype)
      _, part = model.hidden(take(tok), take(pos), take(seg), cache=part, cache_index=0)
      put = lambda full, new: jax.lax.dynamic_update_slice(  # noqa: E731
          full, new.reshape(new.shape[0], d, c, *new.shape[2:]),
          (0, 0, i * c) + (0,) * (full.ndim - 3))
      return put(k_all, part.k), put(v_all, part.v)

    k_all, v_all = jax.lax.fori_loop(0, per // c, step, (k_all, v_all))
    return decoder.KVCache(k=k_all.reshape(cache.k.shape), v=v_all.reshape(cache.v.shape))

  def _generate_device(self, model, tokens_bp, lengths_b, row_valid_b, prefill_up,
                       prefill_lengths_u, source_b, rng, temperature, top_k,
                       top_p, stop_table, use_stop, edge_parent_be, edge_token_be,
                       edge_child_be, terminal_bn, has_children_bn, constrained_b, free_class_bn,
                       free_min_bn, free_max_bn, to_leaf_bn, free_masks_cv, *,
                       max_new_tokens, greedy, filtered, constraint_mode, ignore_eos,
                       shared_prefill, slots=0):
    """The jitted program: prefill + while_loop decode. Returns (tokens i32[B, M],
    logprobs f32[B, M], lengths i32[B], stop reasons i32[B] (indices of STOP_REASONS),
    decode steps i32[]).

    shared_prefill (static): prefill the U unique prompts `prefill_up` [U, P] (lengths
    `prefill_lengths_u`) and give row b the cache row `source_b[b]`; otherwise
    `prefill_up` is `tokens_bp` itself.
    slots (static): 0 decodes all B rows in lockstep; S < B decodes S cache rows and
    admits the next rows into the slots that finished (`_slotted_decode`)."""
    self.num_compilations += 1  # runs at trace time only
    cfg = self.cfg
    batch, plen = tokens_bp.shape
    cache_len = plen + max_new_tokens - 1
    rules = _TokenRules(
        self, rng, temperature, top_k, top_p, stop_table, use_stop,
        (edge_parent_be, edge_token_be, edge_child_be, terminal_bn, has_children_bn,
         free_class_bn, free_min_bn, free_max_bn, to_leaf_bn), free_masks_cv,
        max_new_tokens=max_new_tokens, greedy=greedy, filtered=filtered,
        constraint_mode=constraint_mode, ignore_eos=ignore_eos)
    if constraint_mode == WHOLE_CONSTRAINT:
      phase_b = jnp.where(constrained_b, _IN_TRIE, _FREE).astype(jnp.int32)
    else:
      phase_b = jnp.zeros((batch,), jnp.int32)

    if slots:  # rows are prefilled as they enter a slot; a shared prefill's rows first
      shared_cache = None
      if shared_prefill and plen > 1:
        shared_cache = self._prefill(model, prefill_up, prefill_lengths_u,
                                     self._empty_cache(prefill_up.shape[0], plen - 1))
      return self._slotted_decode(model, rules, shared_cache, tokens_bp, lengths_b,
                                  row_valid_b, source_b, phase_b, slots=slots)
    cache = self._empty_cache(prefill_up.shape[0], cache_len)
    if plen > 1:
      # Prefill the first P-1 slots; the last prompt token is the first decode input, so
      # the [B, P, V] logits of the prompt are never needed (only hidden is called).
      cache = self._prefill(model, prefill_up, prefill_lengths_u, cache)
    if shared_prefill:
      if self._chunks(batch):
        cache = self._chunked_copy(cache, source_b, self._empty_cache(batch, cache_len))
      else:
        cache = jax.tree.map(lambda c: jnp.take(c, source_b, axis=1), cache)
      if self.mesh is not None:
        cache = jax.lax.with_sharding_constraint(
            cache, sharding.cache_shardings(cfg, self.mesh, batch, cache_len))

    rows_b = jnp.arange(batch)

    def body(carry):
      (step, cache, prev_b, toks_bm, logp_bm, done_b, reason_b, num_b, stop_state_b, phase_b,
       node_b, free_count_b) = carry
      slot = plen - 1 + step
      positions_b1 = decode_positions(lengths_b, step)
      # The decoder reads row b's cache slots [slot - position, slot) = [pad_b, slot).
      logits_b1v, cache = model(prev_b[:, None], positions_b1, jnp.ones_like(positions_b1),
                                cache=cache, cache_index=slot)
      token_b, token_logp_b, new_reason_b, stop_state_b, node_b, free_count_b = rules.step(
          logits_b1v[:, 0], rows_b, step, rules.tables, phase_b, node_b, free_count_b,
          stop_state_b)
      live_b = ~done_b
      toks_bm = toks_bm.at[:, step].set(jnp.where(live_b, token_b, self.pad_id))
      logp_bm = logp_bm.at[:, step].set(jnp.where(live_b, token_logp_b, 0.0))
      num_b = num_b + live_b.astype(jnp.int32)
      reason_b = jnp.where(live_b & (new_reason_b > 0), new_reason_b, reason_b)
      done_b = done_b | (new_reason_b > 0)
      return (step + 1, cache, token_b, toks_bm, logp_bm, done_b, reason_b, num_b, stop_state_b,
              phase_b, node_b, free_count_b)

    def cond(carry):
      step, done_b = carry[0], carry[5]
      return (step < max_new_tokens) & ~jnp.all(done_b)

    zeros_b = jnp.zeros((batch,), jnp.int32)
    carry = (jnp.int32(0), cache, tokens_bp[:, -1],
             jnp.full((batch, max_new_tokens), self.pad_id, jnp.int32),
             jnp.zeros((batch, max_new_tokens), jnp.float32), ~row_valid_b, zeros_b, zeros_b,
             zeros_b, phase_b, zeros_b, zeros_b)
    carry = jax.lax.while_loop(cond, body, carry)
    return carry[3], carry[4], carry[7], carry[6], carry[0]

  def _empty_cache(self, rows: int, length: int) -> decoder.KVCache:
    cache = decoder.init_cache(self.cfg, rows, length, self.cache_dtype)
    if self.mesh is not None:
      cache = jax.lax.with_sharding_constraint(
          cache, sharding.cache_shardings(self.cfg, self.mesh, rows, length))
    return cache

  def _prefill(self, model, tokens_up, lengths_u, cache):
    """`cache` with slots [0, P-1) of its U rows holding the left-padded prompts
    `tokens_up` [U, P] minus their last token (`_chunked_prefill` when `_chunks(U)`)."""
    positions_ut, segment_ids_ut = prefill_layout(lengths_u, tokens_up.shape[1])
    if self._chunks(tokens_up.shape[0]):
      return self._chunked_prefill(model, tokens_up[:, :-1], positions_ut, segment_ids_ut,
                                   cache)
    _, cache = model.hidden(tokens_up[:, :-1], positions_ut, segment_ids_ut, cache=cache,
                            cache_index=0)
    return cache

  def _slotted_decode(self, model, rules, shared_cache, tokens_bp, lengths_b, row_valid_b,
                      source_b, phase_b, *, slots):
    """The decode of B rows in S < B cache rows ("slots"), each slot at its own offset.

    A while loop of decode steps over the S slots; before each step, while rows wait and
    enough slots are free, the next `admit` rows (`prefill_rows`, else the batch-parallel
    size) are prefilled into free slots (or, with `shared_cache`, their shared prefill's
    rows copied there). A slot decodes row r's token j at cache slot P - 1 + j with row r's
    key (`fold_in(fold_in(rng, j), r)`, as the lockstep loop), so a row samples what the
    lockstep program samples for it; a finished row frees its slot at once instead of
    running with the slowest row of the call. Returns what `_generate_device` returns;
    its decode steps count steps of S slots.
    """
    cfg = self.cfg
    batch, plen = tokens_bp.shape
    max_new = rules.max_new_tokens
    cache_len = plen + max_new - 1
    admit = self.admit_rows
    cache = self._empty_cache(slots, cache_len)
    n_valid = jnp.sum(row_valid_b.astype(jnp.int32))
    none_s = jnp.full((slots,), batch, jnp.int32)  # row `batch`: no row (writes dropped)

    def admit_rows(state):
      """The next `admit` rows into the first free slots (fewer at the end of the call)."""
      (cache, row_s, step_s, prev_s, active_s, stop_state_s, phase_s, node_s, free_count_s,
       next_row) = state
      rows_a = next_row + jnp.arange(admit)
      real_a = rows_a < n_valid
      free_a = jnp.nonzero(~active_s, size=admit, fill_value=slots)[0]
      slot_a = jnp.where(real_a, free_a, slots)  # slot `slots`: dropped
      take_a = jnp.minimum(rows_a, batch - 1)
      if plen > 1:
        if shared_cache is None:
          part = self._prefill(model, tokens_bp[take_a], lengths_b[take_a],
                               self._empty_cache(admit, plen - 1))
        else:
          part = jax.tree.map(lambda c: jnp.take(c, source_b[take_a], axis=1), shared_cache)
        zero_a = jnp.zeros((admit,), jnp.int32)
        cache = jax.tree.map(
            lambda full, new: decoder.write_rows(full, new, slot_a, zero_a, real_a), cache,
            part)
        if self.mesh is not None:
          cache = jax.lax.with_sharding_constraint(
              cache, sharding.cache_shardings(cfg, self.mesh, slots, cache_len))
      put = lambda x_s, v_a: x_s.at[slot_a].set(v_a, mode="drop")  # noqa: E731
      zero_a = jnp.zeros((admit,), jnp.int32)
      return (cache, put(row_s, rows_a), put(step_s, zero_a), put(prev_s, tokens_bp[take_a, -1]),
              put(active_s, real_a), put(stop_state_s, zero_a), put(phase_s, phase_b[take_a]),
              put(node_s, zero_a), put(free_count_s, zero_a),
              next_row + jnp.sum(real_a.astype(jnp.int32)))

    def may_admit(state):
      active_s, next_row = state[4], state[-1]
      waiting = n_valid - next_row
      free = slots - jnp.sum(active_s.astype(jnp.int32))
      return (waiting > 0) & (free >= jnp.minimum(admit, waiting))

    def body(carry):
      state, toks_bm, logp_bm, reason_b, num_b, steps = carry
      state = jax.lax.while_loop(may_admit, admit_rows, state)
      (cache, row_s, step_s, prev_s, active_s, stop_state_s, phase_s, node_s, free_count_s,
       next_row) = state
      take_s = jnp.minimum(row_s, batch - 1)
      positions_s1 = (lengths_b[take_s] - 1 + step_s)[:, None]
      logits_s1v, cache = model(prev_s[:, None], positions_s1, jnp.ones_like(positions_s1),
                                cache=cache, cache_index=plen - 1 + step_s)
      tables = tuple(t[take_s] for t in rules.tables)
      token_s, token_logp_s, new_reason_s, stop_state_s, node_s, free_count_s = rules.step(
          logits_s1v[:, 0], take_s, step_s, tables, phase_s, node_s, free_count_s,
          stop_state_s)
      row_or_none_s = jnp.where(active_s, row_s, batch)
      toks_bm = toks_bm.at[row_or_none_s, step_s].set(token_s, mode="drop")
      logp_bm = logp_bm.at[row_or_none_s, step_s].set(token_logp_s, mode="drop")
      num_b = num_b.at[row_or_none_s].add(1, mode="drop")
      ended_s = active_s & (new_reason_s > 0)
      reason_b = reason_b.at[jnp.where(ended_s, row_s, batch)].set(new_reason_s, mode="drop")
      state = (cache, row_s, step_s + active_s.astype(jnp.int32), token_s, active_s & ~ended_s,
               stop_state_s, phase_s, node_s, free_count_s, next_row)
      return state, toks_bm, logp_bm, reason_b, num_b, steps + 1

    def cond(carry):
      state = carry[0]
      return (state[-1] < n_valid) | jnp.any(state[4])

    zeros_s = jnp.zeros((slots,), jnp.int32)
    state = (cache, none_s, zeros_s, zeros_s, jnp.zeros((slots,), bool), zeros_s, zeros_s,
             zeros_s, zeros_s, jnp.int32(0))
    zeros_b = jnp.zeros((batch,), jnp.int32)
    carry = (state, jnp.full((batch, max_new), self.pad_id, jnp.int32),
             jnp.zeros((batch, max_new), jnp.float32), zeros_b, zeros_b, jnp.int32(0))
    _, toks_bm, logp_bm, reason_b, num_b, steps = jax.lax.while_loop(cond, body, carry)
    return toks_bm, logp_bm, num_b, reason_b, steps


class _TokenRules:
  """What a decode step does with B rows' logits, shared by the lockstep and the slotted
  decode: constraint masks, sampling, stop strings, constraint transitions, stop reasons.
  `tables` are the per-row constraint arrays (`TRIE_ARRAYS` less `active`, in order);
  `step` takes them already gathered for its rows."""

  def __init__(self, sampler, rng, temperature, top_k, top_p, stop_table, use_stop, tables,
               free_masks_cv, *, max_new_tokens, greedy, filtered, constraint_mode,
               ignore_eos):
    self.vocab = sampler.cfg.vocab_size
    self.max_candidates = sampler.max_candidates
    self.eos_v = jnp.zeros((self.vocab,), bool).at[jnp.asarray(sampler.eos_ids)].set(True)
    self.rng, self.temperature, self.top_k, self.top_p = rng, temperature, top_k, top_p
    self.stop_table, self.use_stop = stop_table, use_stop
    self.tables, self.free_masks_cv = tables, free_masks_cv
    self.max_new_tokens, self.greedy, self.filtered = max_new_tokens, greedy, filtered
    self.constraint_mode, self.ignore_eos = constraint_mode, ignore_eos

  def choose(self, logits_bv, rows_b, step):
    if self.greedy:
      return jnp.argmax(logits_bv, axis=-1).astype(jnp.int32)
    if self.filtered:
      logits_bv = filter_logits(logits_bv, self.temperature, self.top_k, self.top_p,
                                self.max_candidates)
    else:
      logits_bv = logits_bv / self.temperature
    if jnp.ndim(step) == 0:
      keys_b = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.fold_in(self.rng, step),
                                                       rows_b)
    else:  # each row at its own step (slotted decode): the same key per (row, step)
      keys_b = jax.vmap(lambda j, r: jax.random.fold_in(jax.random.fold_in(self.rng, j), r))(
          step, rows_b)
    return jax.vmap(jax.random.categorical)(keys_b, logits_bv).astype(jnp.int32)

  def step(self, logits_bv, rows_b, step, tables, phase_b, node_b, free_count_b,
           stop_state_b):
    """(token, its raw log-prob, stop reason (0 = none), stop state, trie node, free
    count) of each row; `step` is a scalar or per row."""
    (edge_parent_be, edge_token_be, edge_child_be, terminal_bn, has_children_bn,
     free_class_bn, free_min_bn, free_max_bn, to_leaf_bn) = tables
    vocab, max_new_tokens = self.vocab, self.max_new_tokens
    batch = logits_bv.shape[0]
    logits_bv = logits_bv.astype(jnp.float32)
    logp_all_bv = jax.nn.log_softmax(logits_bv, axis=-1)
    at_node = lambda table_bn: jnp.take_along_axis(table_bn, node_b[:, None], axis=1)[:, 0]  # noqa: E731

    masked_bv = logits_bv
    constrained_run = self.constraint_mode != NO_CONSTRAINT
    if constrained_run:
      # Tokens allowed at a trie node; at a free node also the free tokens (below the
      # cap, and while the shortest completion still fits in max_new_tokens), and its
      # edges once `min_tokens` free tokens were written or no more may be.
      in_trie_b = phase_b == _IN_TRIE
      on_node_be = edge_parent_be == node_b[:, None]
      targets_be = jnp.where(on_node_be, edge_token_be, vocab)  # vocab = dropped
      edges_bv = jnp.zeros((batch, vocab), bool).at[jnp.arange(batch)[:, None], targets_be].set(
          True, mode="drop")
      edges_bv = edges_bv | (at_node(terminal_bn)[:, None] & self.eos_v[None, :])
      free_class_b = at_node(free_class_bn)
      is_free_b = free_class_b >= 0
      free_bv = self.free_masks_cv[jnp.maximum(free_class_b, 0)]
      fits_b = step + 1 + at_node(to_leaf_bn) <= max_new_tokens
      may_write_b = (free_count_b < at_node(free_max_bn)) & fits_b
      may_end_b = (free_count_b >= at_node(free_min_bn)) | ~may_write_b
      at_free_bv = (edges_bv & may_end_b[:, None]) | (free_bv & may_write_b[:, None])
      allowed_bv = jnp.where(is_free_b[:, None], at_free_bv, edges_bv)
      masked_bv = jnp.where(in_trie_b[:, None] & ~allowed_bv, -jnp.inf, masked_bv)
    token_b = self.choose(masked_bv, rows_b, step)
    token_logp_b = jnp.take_along_axis(logp_all_bv, token_b[:, None], axis=1)[:, 0]

    is_eos_b = self.eos_v[token_b] & (not self.ignore_eos)
    next_stop_b = self.stop_table[stop_state_b, token_b]
    stop_hit_b = self.use_stop & (next_stop_b < 0)
    stop_state_b = jnp.maximum(next_stop_b, 0)

    finished_constraint_b = jnp.zeros((batch,), bool)
    if constrained_run:
      match_be = (edge_parent_be == node_b[:, None]) & (edge_token_be == token_b[:, None])
      child_b = jnp.sum(jnp.where(match_be, edge_child_be, 0), axis=1)
      child_is_leaf_b = ~jnp.take_along_axis(has_children_bn, child_b[:, None], axis=1)[:, 0]
      took_edge_b = in_trie_b & jnp.any(match_be, axis=1)
      finished_constraint_b = took_edge_b & child_is_leaf_b
      # Stop strings inside the forced text are the caller's own strings: not a stop.
      stop_hit_b = stop_hit_b & ~in_trie_b
      # A token at a free node that is no edge is a free token: stay, count it.
      wrote_free_b = in_trie_b & is_free_b & ~took_edge_b
      node_b = jnp.where(took_edge_b, child_b, node_b)
      free_count_b = jnp.where(took_edge_b, 0, free_count_b + wrote_free_b.astype(jnp.int32))

    new_reason_b = jnp.select(
        [finished_constraint_b, is_eos_b, stop_hit_b, step + 1 >= max_new_tokens],
        [_CONSTRAINT, _EOS, _STOP, _LENGTH], 0)
    return token_b, token_logp_b, new_reason_b, stop_state_b, node_b, free_count_b


def _call_key(args, static: dict) -> tuple:
  """What selects a compiled generate program: the shapes and dtypes of its arguments
  after the model (arrays or `jax.ShapeDtypeStruct`s) and its static keywords."""
  shapes = tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args))
  return shapes + tuple(sorted(static.items()))


def _first_stop_end(text: str, stop_strings: Sequence[str]) -> int | None:
  """End index of the stop-string occurrence that completes first in `text`, or None."""
  ends = [i + len(s) for s in stop_strings if (i := text.find(s)) >= 0]
  return min(ends) if ends else None
