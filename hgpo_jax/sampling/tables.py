"""The host-side tables of a sampler call, built from the tokenizer and cached: the text
of every token, stop-string automata, free-span token masks, and a call's per-row
constraint tries (`hgpo_jax.sampling.constrained` compiles them)."""

from __future__ import annotations

import numpy as np

from hgpo_jax.sampling import constrained


class TokenTables:
  """The tables of one tokenizer and vocabulary (each built once, on first use).

  Args:
    tokenizer: the model's tokenizer (encode, token_strings; `backend` for special tokens).
    vocab: the model's vocabulary size V (ids past the tokenizer's never match).
    eos_ids, pad_id: the tokenizer's EOS ids and pad id (never free tokens).
    trie_nodes: fixed nodes of every call's tries (0: sized per call).
  """

  def __init__(self, tokenizer, vocab: int, eos_ids, pad_id: int, trie_nodes: int):
    self.tokenizer, self.vocab = tokenizer, vocab
    self.eos_ids, self.pad_id, self.trie_nodes = eos_ids, pad_id, trie_nodes
    self._token_strings = None
    self._automata: dict[tuple[str, ...], constrained.TokenAutomaton] = {}
    self._free_masks: dict[str, np.ndarray] = {}

  def token_strings(self) -> list[str]:
    """Decoded text of every token id (computed once)."""
    if self._token_strings is None:
      strings = list(self.tokenizer.token_strings())
      if len(strings) < self.vocab:  # ids past the tokenizer's vocab never match
        strings += [""] * (self.vocab - len(strings))
      self._token_strings = strings[:self.vocab]
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

  def stop_table(self, stop_strings: tuple[str, ...]) -> np.ndarray:
    """i32[A, V] the stop strings' automaton table (one all-zero row without any)."""
    if not stop_strings:
      return np.zeros((1, self.vocab), np.int32)
    return self.automaton(stop_strings).table

  def tries(self, allowed, constraint, batch: int, max_new: int):
    """(`ConstraintTries`, bool[C, V] free-span masks) of a call's `allowed` strings."""
    vocab = self.vocab
    if allowed is None:
      return constrained.build_tries([], 1), np.zeros((2, vocab), bool)
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
    return tries, free_masks
