"""What a caller of the sampler hands in and gets back: `SamplingParams`, `SampleOutput`,
and the stop-reason and constraint-mode codes the device program writes and reads."""

from __future__ import annotations

import dataclasses

import numpy as np

STOP_REASONS = ("running", "eos", "stop_string", "constraint", "length")
"""Names of the stop-reason codes the device program writes (index = code)."""
EOS, STOP, CONSTRAINT, LENGTH = 1, 2, 3, 4
"""Stop-reason codes (indices of `STOP_REASONS`; 0 = still running)."""
FREE, IN_TRIE = 0, 1
"""Phases of a row: unconstrained, or walking its constraint trie."""
NO_CONSTRAINT = 0
"""`DecodeFlags.constraint_mode`: free decoding (no `allowed`)."""
WHOLE_CONSTRAINT = 1
"""`DecodeFlags.constraint_mode`: rows walk their constraint trie."""


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
    need_logprobs: the caller reads `SampleOutput.logprobs`. False (an evaluation, which
      reads only the responses) lets a jump-forward call end once every row holds its
      tokens, without the decode step that only scores a response's final forced run
      (`hgpo_jax.sampling.jump_forward`); the tokens, texts and stop reasons are the same,
      and the log-probs of that run are NaN. Traced: one program for both values.
  """
  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0
  max_new_tokens: int = 512
  stop_strings: tuple[str, ...] = ()
  ignore_eos: bool = False
  need_logprobs: bool = True

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


