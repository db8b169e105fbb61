"""Token automata and tries of hgpo_jax.sampling.constrained against brute-force references."""

import numpy as np
import pytest

from hgpo_jax.sampling import constrained


def _first_match(strings, seq, patterns):
  """Brute force: (index of the token whose text completes a pattern first, at its end?)."""
  text = ""
  for j, token in enumerate(seq):
    before = len(text)
    text += strings[token]
    ends = [text.find(p, max(0, before - len(p) + 1)) for p in patterns]
    ends = [i + len(p) for i, p in zip(ends, patterns) if i >= 0]
    # Only occurrences ending inside this token count (earlier ones would have fired).
    ends = [e for e in ends if e > before]
    if ends:
      return j, min(ends) == len(text)
  return None, None


@pytest.mark.parametrize("patterns", [("ab",), ("abab", "ba"), ("</a>",), ("aa", "a<")])
def test_token_automaton_matches_brute_force(patterns):
  rng = np.random.default_rng(0)
  alphabet = sorted(set("".join(patterns))) + ["x"]
  strings = ["".join(rng.choice(alphabet, size=rng.integers(0, 4))) for _ in range(60)]
  strings += list(patterns[0])  # single characters, so split matches occur
  table = constrained.build_token_automaton(patterns, strings).table
  assert table.shape[1] == len(strings) and table.dtype == np.int32
  checked_hits = 0
  for _ in range(400):
    seq = rng.integers(0, len(strings), size=16)
    want_j, want_at_end = _first_match(strings, seq, patterns)
    state, got_j, got_at_end = 0, None, None
    for j, token in enumerate(seq):
      state = table[state, token]
      if state < 0:
        got_j, got_at_end = j, state == constrained.MATCH
        break
    assert (got_j, got_at_end) == (want_j, want_at_end), (seq, patterns)
    checked_hits += got_j is not None
  assert checked_hits >= 10  # the random sequences really exercise matches


def test_token_automaton_detects_split_stop_string():
  strings = ["</", "act", "ion", ">", ">\n", "hello", "</action>"]
  table = constrained.build_token_automaton(("</action>",), strings).table
  state = 0
  for token in (5, 0, 1, 2):
    state = table[state, token]
    assert state > 0 or token == 5
  assert table[state, 3] == constrained.MATCH
  assert table[state, 4] == constrained.MATCH_INSIDE
  assert table[0, 6] == constrained.MATCH
  assert table[0, 5] == 0


def test_build_token_automaton_rejects_empty_pattern():
  with pytest.raises(ValueError, match="non-empty"):
    constrained.build_token_automaton(("",), ["a"])


def _paths(tries, row):
  """All token sequences from the root to a terminal node of one packed trie."""
  out = []

  def walk(node, prefix):
    if tries.terminal[row, node]:
      out.append(tuple(prefix))
    for e in np.nonzero(tries.edge_parent[row] == node)[0]:
      walk(tries.edge_child[row, e], prefix + [int(tries.edge_token[row, e])])

  walk(0, [])
  return sorted(out)


def test_build_tries_packs_exact_sequences():
  rows = [[[1, 2, 3], [1, 2, 4], [5]], [[7, 7], [7]], []]
  tries = constrained.build_tries(rows, batch_size=4)
  assert tries.edge_parent.shape == (4, 16) and tries.terminal.shape == (4, 16)
  assert _paths(tries, 0) == [(1, 2, 3), (1, 2, 4), (5,)]
  assert _paths(tries, 1) == [(7,), (7, 7)]  # a sequence that is a prefix of another
  np.testing.assert_array_equal(tries.active, [True, True, False, False])
  assert (tries.edge_parent[2:] == -1).all()
  # Node 0 of row 0 has children; its leaves have none.
  assert tries.has_children[0, 0] and tries.has_children[0].sum() == 3


def test_constrained_token_sequences_tokenize_the_whole_response_as_one_string():
  vocab = {"<action>": [10], "<action>go</action>": [10, 20, 30], "go</action>": [20, 30]}
  enc = lambda s: vocab[s]
  whole = constrained.constrained_token_sequences(["go"], constrained.ActionConstraint(), enc)
  assert whole == [[10, 20, 30]]


def _choices_reference(sequences, response, eos_ids):
  """The allowed ids at each response token, by brute force over the allowed sequences
  (no free spans): the next ids of every sequence that starts with the tokens so far, and
  EOS where the tokens so far are a whole sequence that another one continues."""
  out = []
  for j in range(len(response)):
    prefix = list(response[:j])
    if j and out[-1] == () and response[j - 1] in eos_ids:
      out.append(())
      continue
    nxt = {s[j] for s in sequences if len(s) > j and list(s[:j]) == prefix}
    if nxt and any(list(s) == prefix for s in sequences):
      nxt |= set(eos_ids)
    out.append(tuple(sorted(nxt)))
  return out


@pytest.mark.parametrize("response", [[1, 2, 3], [1, 2, 4, 5], [1, 2, 9], [7], [1, 2, 4]])
def test_response_choices_equal_the_brute_force_sets(response):
  sequences = [[1, 2, 3], [1, 2, 4, 5], [1, 2, 4], [7]]
  got = constrained.response_choices(sequences, response, eos_ids=(9,))
  assert got == _choices_reference(sequences, response, (9,))


def test_response_choices_spelled_out():
  """A choice among 1/7, a forced 2, a choice among 3/4, then 5 or EOS ([1, 2, 4] is
  allowed and [1, 2, 4, 5] continues it); an off-trie token ends the walk."""
  sequences = [[1, 2, 3], [1, 2, 4, 5], [1, 2, 4], [7]]
  assert constrained.response_choices(sequences, [1, 2, 4, 5], eos_ids=(9,)) == [
      (1, 7), (2,), (3, 4), (5, 9)]
  assert constrained.response_choices(sequences, [1, 2, 4, 9, 3], eos_ids=(9,)) == [
      (1, 7), (2,), (3, 4), (5, 9), ()]


def test_response_choices_leave_free_span_tokens_open():
  span = constrained.FreeSpan(max_tokens=3, forbidden="]")
  sequences = [[5, span, 6, 8], [5, span, 6, 9], [4]]
  # 5, two free tokens (11, 12), then the fixed "]"-text 6, then the choice 8/9
  got = constrained.response_choices(sequences, [5, 11, 12, 6, 8], eos_ids=(0,))
  assert got == [(4, 5), (), (), (), (8, 9)]
