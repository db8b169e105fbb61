"""`config.rollout` as a typed value: `RolloutParams`, built and validated once by the trainer.

The field names are the config's (`RolloutParams(**config.rollout.to_dict())`), so a field
added to the config without a field here, or the reverse, fails at the first validation.
"""

from __future__ import annotations

import dataclasses

from hgpo_jax.sampling import engine as engine_lib
from hgpo_jax.sampling import logits as logits_lib
from hgpo_jax.sampling import types

RESPONSE_FORMATS = ("react", "hiper")
"""`react`: verl-agent's `<think>`/`<action>` response; `hiper`: HiPER's
`<switch>`/`<subgoal>`/`<action>` blocks (`hgpo_jax.rollout.hiper`)."""
STOP_STRINGS = ("</action>",)
"""Both response formats end with the action block."""


@dataclasses.dataclass(frozen=True)
class RolloutParams:
  """How trajectories are played and sampled (the fields of `config.rollout`)."""

  num_groups: int = 16
  """G tasks per iteration (per process)."""
  group_size: int = 8
  """N trajectories per task, same env seed."""
  history_length: int = 2
  """Memory window H: earlier (observation, action) pairs shown in the prompt."""
  temperature: float = 1.0
  """Sampling temperature of training rollouts (evaluation has its own)."""
  top_p: float = 1.0
  """Nucleus sampling (1.0 = off)."""
  top_k: int = 0
  """Top-k sampling (0 = off)."""
  max_candidates: int = logits_lib.DEFAULT_MAX_CANDIDATES
  """K of top-k / top-p sampling: the largest logits per row and step the sampler takes
  with `jax.lax.top_k` (`Sampler(max_candidates=...)`); a top_k above K, or a nucleus wider
  than K, sorts the vocabulary on that step (same tokens, slower)."""
  kv_cache_dtype: str = "auto"
  """The sampler's KV cache dtype (`engine.CACHE_DTYPES`): "auto" = bfloat16 on TPU/GPU,
  the compute dtype on CPU; "" = the compute dtype; or "float32" / "bfloat16"."""
  prefill_chunk_rows: int = 0
  """Rows per step of the sampler's prefill loop (`Sampler(prefill_rows=...)`): the
  prefill's activations are this many rows' instead of the whole call's; a multiple of the
  sampler mesh's batch-parallel size. 0: all rows in one prefill."""
  decode_slots: int = 0
  """Continuous batching: a sampler call with more rows than this decodes them in this
  many KV-cache rows ("slots"), each row prefilled when a slot frees and decoding at its own
  offset, so a finished response stops costing decode steps and the cache holds this many
  rows instead of the call's (`Sampler(decode_slots=...)`); a multiple of the sampler mesh's
  batch-parallel size. Same tokens as lockstep decoding (log-probs within float rounding).
  0: every row of a call decodes in lockstep until the slowest ends."""
  share_prefill: bool = True
  """The first turn's prompts, the same for a group's trajectories, prefilled once per group
  and copied to its rows (the sampler's `generate_shared` program; `Sampler(share_prefill=G)`
  with G the group size). False: every row prefilled (one program fewer, whose cache copy
  can need more memory than the shared prefill saves; same tokens)."""
  decode_chunk_steps: int = 0
  """Lockstep decode steps per iteration of the sampler's device loop, which tests "every row
  finished?" once per chunk (`Sampler(decode_chunk=...)`, `engine.resolve_decode_chunk`):
  on GPUs a loop of unknown trip count waits for the host every iteration. Same tokens for
  every value. 0: by the platform (16 on GPUs, 1 elsewhere)."""
  decode_layers: str = "auto"
  """How a decode step reads the model's layers (`Sampler(decode_layers=...)`,
  `engine.DECODE_LAYERS`): "auto" (per-layer weight arrays on GPUs and TPUs, a scan over the
  stacked layers on CPUs) or "per_layer" (per-layer arrays everywhere; on CPUs also the
  lockstep loop's cache, and the decode weights made once per weight version). Samples equal
  up to float round-off."""
  jump_forward: int = 0
  """K > 0: a constrained call feeds the tokens a row's trie forces (up to K) in one decode
  step and scores them from that step's logits (`Sampler(jump_forward=...)`,
  `hgpo_jax.sampling.jump_forward`); lockstep decoding only (decode_slots = 0). 0: one
  token per step. Samples equal up to float round-off."""
  max_trie_nodes: int = 0
  """Nodes of a constrained row's token trie (its allowed responses' tokens, shared
  prefixes once), fixed in every call so the constrained sampler programs take their
  shapes from the config (`programs.build` lists them); a turn that needs more is an error
  naming this field. 0: sized per call (the next power of two of the call's largest)."""
  precompile: bool = False
  """Compile every sampler program a run can call before the first iteration
  (`programs.rollout_calls`: each batch and prompt bucket, shared and unshared prefill,
  training and evaluation sampling), so that no rollout compiles mid-run (a call outside
  that list is warned about once). Needs `max_trie_nodes` when `constrained`."""
  max_new_tokens: int = 512
  """Most tokens per response."""
  max_prompt_tokens: int = 2048
  """Longest prompt; longer prompts are truncated on the left."""
  constrained: bool = False
  """Constrained decoding: the response must pick an admissible action."""
  invalid_penalty: float = 0.1
  """eta: subtracted from the reward of a step whose action was invalid."""
  fallback_chars: int = 30
  """Projection fallback: a response without an action block is read as its last N chars."""
  dump: bool = False
  """Write every rollout as JSONL (`python -m hgpo_jax.advantages` format), and every
  evaluation's steps (`training.evaluation.eval_dump_path`)."""
  response_format: str = "react"
  """One of RESPONSE_FORMATS."""
  free_query_tokens: int = 8
  """Cap of a constrained free WebShop search query (`search[<your query>]`), in tokens."""
  subgoal_tokens: int = 12
  """Cap of a constrained free HiPER subgoal, in tokens."""
  format_instructions: bool = True
  """The released prompt with its format instructions (True), or without them (False): for
  constrained decoding, whose constraint writes the response's format, and small models
  whose left-truncated prompt would otherwise spend its budget on the instructions (react:
  `prompts.render_prompt`; HiPER: only its state parts, `hiper.render_prompt`)."""
  history_drop_chars: int = 0
  """Prompts (react and HiPER) longer than this many characters are rendered without their
  history (verl-agent's and HiPER-agent's WebShop env managers: 13,000); 0 = never."""

  def __post_init__(self):
    for name in ("num_groups", "group_size", "max_new_tokens", "max_prompt_tokens",
                 "free_query_tokens", "subgoal_tokens"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if (isinstance(self.max_candidates, bool) or not isinstance(self.max_candidates, int)
        or self.max_candidates < 1):
      raise ValueError(f"max_candidates must be an int >= 1, got {self.max_candidates!r}")
    for name in ("history_length", "fallback_chars", "history_drop_chars", "max_trie_nodes",
                 "prefill_chunk_rows", "decode_slots", "decode_chunk_steps", "jump_forward"):
      if getattr(self, name) < 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    if self.jump_forward and self.decode_slots:
      raise ValueError("jump_forward > 0 is implemented for lockstep decoding only; set "
                       "decode_slots=0 or jump_forward=0")
    if self.decode_layers not in engine_lib.DECODE_LAYERS:
      raise ValueError(f"decode_layers={self.decode_layers!r}; use one of "
                       f"{engine_lib.DECODE_LAYERS}")
    if self.kv_cache_dtype not in engine_lib.CACHE_DTYPES:
      raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}; use one of "
                       f"{engine_lib.CACHE_DTYPES}")
    if self.response_format not in RESPONSE_FORMATS:
      raise ValueError(f"response_format={self.response_format!r}; use one of "
                       f"{RESPONSE_FORMATS}")
    if not (self.format_instructions or self.constrained or self.response_format == "hiper"):
      raise ValueError("format_instructions=False needs constrained=True (the constraint "
                       "writes the response format) or response_format='hiper'")
    if self.precompile and self.constrained and not self.max_trie_nodes:
      raise ValueError("precompile=True with constrained decoding needs max_trie_nodes > 0 "
                       "(the constrained programs' trie shapes otherwise follow the data)")
    self.sampling()  # validates temperature, top_p and top_k

  def sampling(self, temperature: float | None = None, *,
               need_logprobs: bool = True) -> types.SamplingParams:
    """The sampler's parameters at the rollout temperature, or at `temperature` (evaluation,
    which reads no log-probs: `need_logprobs=False`, `types.SamplingParams`)."""
    return types.SamplingParams(
        temperature=self.temperature if temperature is None else temperature, top_p=self.top_p,
        top_k=self.top_k, max_new_tokens=self.max_new_tokens, stop_strings=STOP_STRINGS,
        need_logprobs=need_logprobs)
