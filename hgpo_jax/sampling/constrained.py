"""Host-built token-level automata that the jit sampler steps through inside its loop.

Two structures, both built from strings on the host and packed into fixed-size int32
arrays so that the decode loop never sees a string:

1. `TokenAutomaton`: an Aho-Corasick automaton over *characters* for a set of patterns
   (stop strings such as "</action>"),
   lifted to tokens: `table[state, token]` is the state after appending the token's
   decoded text. The automaton therefore detects a pattern that is split across any
   number of tokens. Matching runs on the concatenation of the per-token decoded
   strings (`tokenizer.token_strings()`), which equals the decoded text except where a
   multi-byte UTF-8 character is split across tokens (those tokens decode to U+FFFD on
   their own). Guarantee: for patterns made of characters no token splits (ASCII, e.g.
   "</action>"), a pattern occurrence in the decoded response is detected at exactly the
   token that completes it. The sampler re-checks stop strings on the host regardless.

2. `ConstraintTries`: per row, a trie over the token-id sequences of the allowed strings
   (e.g. admissible actions wrapped as "<action>{a}</action>"), packed as padded edge
   lists `(parent, token, child)`. Inside jit the allowed next tokens at node n are the
   tokens of the edges whose parent is n.

The constraint (`ActionConstraint`) covers the whole response: it is exactly
`prefix + a + suffix` for one allowed string `a`, tokenized as one string (the
tokenization a model would produce after the prompt). The row ends when the trie reaches
a leaf (stop reason "constraint"); no EOS token is emitted. Free text inside the response
comes from free spans (below).

Free spans (`FreeSpan`). An allowed entry may be a tuple of pieces instead of a string:
fixed text and free spans, e.g. `("search[", FreeSpan(8, "[]<>"), "]")` for a WebShop query
or HiPER's `("<switch>SWITCH</switch><subgoal>", FreeSpan(12, "<>"), "</subgoal><action>go
to desk 1</action>")`. The fixed text between free spans is tokenized as one string (with
the prefix/suffix of the constraint); a free span becomes a *free node* of the trie. At a
free node the model may write between `min_tokens` and `max_tokens` free tokens (any token
whose text is non-empty, printable (no newline or control character), not whitespace
only, not special, not a partial UTF-8 character and holds no character of `forbidden`), then it must take one of the node's edges, i.e.
start the fixed text that follows (earlier when the shortest completion would otherwise no
longer fit in `max_new_tokens`; then also before `min_tokens`). That text must begin with a forbidden character, so a
free token can never be mistaken for the start of the terminator, and the free text never
contains the terminator. Several allowed entries sharing a fixed prefix share the free node
(one free span, then a choice among the continuations: a choice among alternatives is the
same trie as without free spans).

Exact token ids (`TokenIds`). A piece may also be fixed token ids, taken as they are and
never re-tokenized (the fixed text around it is tokenized on its own): HiPER's KEEP turn
copies the previous subgoal's sampled ids this way, so the copy is the same tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# Values of `TokenAutomaton.table` below zero.
MATCH = -1  # a pattern completed exactly at the end of the token
MATCH_INSIDE = -2  # a pattern completed before the token's last character


def power_of_two_bucket(n: int, minimum: int) -> int:
  """The smallest power of two >= max(n, minimum) (static array sizes): the sizes of the
  automaton tables, the tries and the sampler's free-span classes, so that inputs of
  similar size share one compiled program."""
  size = minimum
  while size < n:
    size *= 2
  return size


def automaton_rows(patterns: Sequence[str]) -> int:
  """Rows of `build_token_automaton(patterns, ...).table`: a function of the patterns
  alone (not of the vocabulary), so a program's stop-table shape is known from the config."""
  delta, _ = _aho_corasick(tuple(patterns))
  return power_of_two_bucket(len(delta), 8)


@dataclasses.dataclass(frozen=True)
class TokenAutomaton:
  """Pattern matcher over token ids.

  Attributes:
    table: i32[S, V]; entry >= 0 is the next state, MATCH / MATCH_INSIDE mark a pattern
      completed by this token (at its end / strictly inside it). S is padded to a power
      of two (padding rows are never reached); state 0 is the start state.
    patterns: the patterns it matches.
  """
  table: np.ndarray
  patterns: tuple[str, ...]


def _aho_corasick(patterns: Sequence[str]):
  """Character DFA: (goto dict per state, accepting flags). Missing chars go to state 0."""
  children: list[dict[str, int]] = [{}]
  accept = [False]
  for pattern in patterns:
    node = 0
    for ch in pattern:
      if ch not in children[node]:
        children[node][ch] = len(children)
        children.append({})
        accept.append(False)
      node = children[node][ch]
    accept[node] = True
  alphabet = sorted({ch for p in patterns for ch in p})
  fail = [0] * len(children)
  delta: list[dict[str, int]] = [dict() for _ in children]
  order = []  # BFS order so that fail links point to already-finished states
  queue = [0]
  while queue:
    node = queue.pop(0)
    order.append(node)
    for ch, child in children[node].items():
      fail[child] = 0 if node == 0 else delta[fail[node]][ch]
      queue.append(child)
    for ch in alphabet:
      if ch in children[node]:
        delta[node][ch] = children[node][ch]
      else:
        delta[node][ch] = 0 if node == 0 else delta[fail[node]][ch]
    # Fail links computed in BFS order see accept flags of shallower states: a state whose
    # fail chain accepts also accepts (a pattern that is a suffix of the current text).
    if node and accept[fail[node]]:
      accept[node] = True
  return delta, accept


def build_token_automaton(patterns: Sequence[str], token_strings: Sequence[str]) -> TokenAutomaton:
  """Builds the token-level automaton of `patterns` (see module docstring).

  Args:
    patterns: non-empty strings to detect.
    token_strings: decoded text of every token id (length V).
  Returns:
    A TokenAutomaton with table i32[S, V].
  """
  patterns = tuple(patterns)
  if not patterns or any(not p for p in patterns):
    raise ValueError(f"build_token_automaton: patterns must be non-empty strings, got {patterns!r}.")
  delta, accept = _aho_corasick(patterns)
  num_states = len(delta)
  table = np.zeros((automaton_rows(patterns), len(token_strings)), np.int32)

  def run(state: int, text: str, start: int, end: int) -> int:
    """State after text[start:end], or MATCH/MATCH_INSIDE relative to the whole text."""
    for i in range(start, end):
      state = delta[state].get(text[i], 0)
      if accept[state]:
        return MATCH if i == len(text) - 1 else MATCH_INSIDE
    return state

  for token, text in enumerate(token_strings):
    if not text:
      table[:num_states, token] = np.arange(num_states)  # empty text keeps the state
      continue
    # A character outside the alphabet resets every state to 0, so only the text before
    # the first such character depends on the start state (most tokens: none of it).
    cut = next((i for i, ch in enumerate(text) if ch not in delta[0]), len(text))
    tail = run(0, text, cut, len(text)) if cut < len(text) else None
    for state in range(num_states):
      s = run(state, text, 0, cut)
      if s >= 0 and tail is not None:
        s = tail
      table[state, token] = s
  return TokenAutomaton(table=table, patterns=patterns)


@dataclasses.dataclass(frozen=True)
class ActionConstraint:
  """How allowed strings become the response: exactly `prefix + a + suffix`.

  Attributes:
    prefix: text before the allowed string ("<action>").
    suffix: text after it ("</action>").
  """
  prefix: str = "<action>"
  suffix: str = "</action>"


@dataclasses.dataclass(frozen=True)
class FreeSpan:
  """A free part of an allowed response (see the module docstring); its tokens are the ones
  `free_token_mask` allows.

  Attributes:
    max_tokens: most free tokens (the length cap); then the fixed text must follow.
    forbidden: characters no free token may contain; must include the first character
      of the fixed text that ends the span (its terminator).
    min_tokens: fewest free tokens before the terminator may start.
  """
  max_tokens: int
  forbidden: str
  min_tokens: int = 1

  def __post_init__(self):
    if not 0 <= self.min_tokens <= self.max_tokens or self.max_tokens < 1:
      raise ValueError(f"FreeSpan(max_tokens={self.max_tokens}, min_tokens={self.min_tokens}): "
                       "need 0 <= min_tokens <= max_tokens and max_tokens >= 1.")
    if not self.forbidden:
      raise ValueError("FreeSpan.forbidden must name at least the terminator's first character.")


@dataclasses.dataclass(frozen=True)
class TokenIds:
  """Fixed text of an allowed entry given as exact token ids, taken as they are (never
  re-tokenized): e.g. a copy of a span the model wrote earlier, whose ids need not be the
  ones its decoded text encodes to (a sampled "m", "i" against the merged "mi").

  Attributes:
    ids: the token ids, at least one.
  """
  ids: tuple[int, ...]

  def __post_init__(self):
    if not self.ids or not all(isinstance(i, (int, np.integer)) and i >= 0 for i in self.ids):
      raise ValueError(f"TokenIds({self.ids!r}): need at least one non-negative token id.")


def split_placeholder(text: str, placeholder: str, span: FreeSpan):
  """`text` with every `placeholder` replaced by the free `span` (a tuple of pieces), or
  `text` unchanged when it does not contain the placeholder.

  >>> split_placeholder("search[<your query>]", "<your query>", FreeSpan(8, "[]"))
  ('search[', FreeSpan(max_tokens=8, forbidden='[]', min_tokens=1), ']')
  """
  if placeholder not in text:
    return text
  parts = text.split(placeholder)
  pieces = [parts[0]]
  for part in parts[1:]:
    pieces += [span, part]
  return tuple(p for p in pieces if not isinstance(p, str) or p)


def free_token_mask(token_strings: Sequence[str], forbidden: str, special_ids=()) -> np.ndarray:
  """bool[V]: the tokens a free span with these forbidden characters may write."""
  mask = np.array([bool(t) and t.isprintable() and not t.isspace() and "\ufffd" not in t
                   and not any(ch in t for ch in forbidden) for t in token_strings], bool)
  special = [i for i in special_ids if 0 <= i < len(mask)]
  mask[special] = False
  return mask


@dataclasses.dataclass(frozen=True)
class ConstraintTries:
  """Per-row token tries packed as padded edge lists.

  Node 0 of every row is the root. Edges are padded with parent = -1.

  Attributes:
    edge_parent: i32[B, E] parent node of each edge (-1 = padding).
    edge_token: i32[B, E] token id on the edge.
    edge_child: i32[B, E] child node.
    terminal: bool[B, N] node ends an allowed sequence.
    has_children: bool[B, N] node has at least one outgoing edge.
    active: bool[B] the row is constrained (rows given no allowed strings are free).
    free_class: i32[B, N] index into `free_forbidden` of a free node's span, -1 elsewhere.
    free_min: i32[B, N] FreeSpan.min_tokens of a free node (0 elsewhere).
    free_max: i32[B, N] FreeSpan.max_tokens of a free node (0 elsewhere).
    to_leaf: i32[B, N] fewest tokens from the node to the end of an allowed sequence (the
      sampler stops a free span early when the rest would not fit in max_new_tokens).
    free_forbidden: the `forbidden` strings of the free-span classes, in class order.
  """
  edge_parent: np.ndarray
  edge_token: np.ndarray
  edge_child: np.ndarray
  terminal: np.ndarray
  has_children: np.ndarray
  active: np.ndarray
  free_class: np.ndarray = None
  free_min: np.ndarray = None
  free_max: np.ndarray = None
  to_leaf: np.ndarray = None
  free_forbidden: tuple[str, ...] = ()


def _chunks(entry, constraint: ActionConstraint) -> list:
  """`prefix + entry + suffix` as alternating fixed strings and FreeSpans (checked)."""
  pieces = (entry,) if isinstance(entry, str) else tuple(entry)
  chunks: list = [constraint.prefix]
  for piece in pieces + (constraint.suffix,):
    if isinstance(piece, FreeSpan):
      if isinstance(chunks[-1], FreeSpan):
        raise ValueError(f"Allowed entry {entry!r}: two free spans in a row; put fixed text "
                         "(the first span's terminator) between them.")
      chunks.append(piece)
    elif isinstance(piece, str):
      if isinstance(chunks[-1], str):
        chunks[-1] += piece
      else:
        chunks.append(piece)
    elif isinstance(piece, TokenIds):
      chunks.append(piece)
    else:
      raise ValueError(f"Allowed entry {entry!r}: pieces must be str, FreeSpan or TokenIds, "
                       f"got {type(piece).__name__}.")
  for i, chunk in enumerate(chunks):
    if isinstance(chunk, FreeSpan):
      after = chunks[i + 1] if i + 1 < len(chunks) else ""
      if not isinstance(after, str) or not after or after[0] not in chunk.forbidden:
        raise ValueError(f"Allowed entry {entry!r}: a free span must be followed by fixed text "
                         f"whose first character is in its forbidden set {chunk.forbidden!r}.")
  return chunks


def constrained_token_sequences(allowed: Sequence, constraint: ActionConstraint,
                                encode) -> list[list]:
  """Token-id sequences of the constrained response for each allowed entry.

  `prefix + a + suffix` is tokenized as one string. An entry made of pieces (see
  `FreeSpan`) gives token ids with the FreeSpan objects in place, each fixed stretch of
  text tokenized as one string and each `TokenIds` piece taken as its ids.
  """
  sequences = []
  for entry in allowed:
    seq: list = []
    for chunk in _chunks(entry, constraint):
      if isinstance(chunk, FreeSpan):
        seq.append(chunk)
      elif isinstance(chunk, TokenIds):
        seq += [int(i) for i in chunk.ids]
      elif chunk:
        seq += list(encode(chunk))
    if not seq:
      raise ValueError(f"Allowed string {entry!r} with {constraint} tokenizes to nothing; "
                       "give a non-empty allowed string or a prefix/suffix.")
    sequences.append(seq)
  return sequences


def min_length(sequence: Sequence) -> int:
  """Fewest tokens that complete `sequence` (its fixed tokens and each free span's minimum)."""
  return sum(t.min_tokens if isinstance(t, FreeSpan) else 1 for t in sequence)


def build_tries(sequences_per_row: Sequence[Sequence[Sequence]], batch_size: int,
                num_nodes: int = 0) -> ConstraintTries:
  """Packs one token trie per row into padded edge arrays.

  Args:
    sequences_per_row: for each row, the allowed token-id sequences (with `FreeSpan`
      items where a free span starts, from `constrained_token_sequences`); an empty list
      leaves the row unconstrained. Rows beyond len(sequences_per_row) up to batch_size
      are unconstrained padding rows.
    batch_size: B of the packed arrays (the batch bucket).
    num_nodes: N and E of the packed arrays, fixed (a config maximum: the program's shape
      does not depend on the call); 0: the next power of two (>= 16) of the largest trie.
  Returns:
    ConstraintTries with E and N padded to `num_nodes`, or to powers of two.
  Raises:
    ValueError: a row's trie has more than `num_nodes` nodes.
  """
  rows = []
  classes: dict[str, int] = {}
  for sequences in sequences_per_row:
    children: list[dict[int, int]] = [{}]
    terminal = [False]
    free: dict[int, FreeSpan] = {}
    for seq in sequences:
      node = 0
      for token in seq:
        if isinstance(token, FreeSpan):
          if free.setdefault(node, token) != token:
            raise ValueError(f"two different free spans ({free[node]}, {token}) start after the "
                             "same fixed text; give them the same FreeSpan.")
          classes.setdefault(token.forbidden, len(classes))
          continue
        token = int(token)
        if token not in children[node]:
          children[node][token] = len(children)
          children.append({})
          terminal.append(False)
        node = children[node][token]
      terminal[node] = True
    rows.append((children, terminal, free))
  max_nodes = max([len(t) for _, t, _ in rows], default=1)
  if num_nodes:
    if max_nodes > num_nodes:
      raise ValueError(f"a constrained row's token trie has {max_nodes} nodes, more than the "
                       f"fixed {num_nodes} (rollout.max_trie_nodes); raise it.")
    num_edges = num_nodes  # a trie has nodes - 1 edges
  else:
    num_nodes = power_of_two_bucket(max_nodes, 16)
    num_edges = power_of_two_bucket(max_nodes - 1, 16)  # a trie has nodes - 1 edges
  parent = np.full((batch_size, num_edges), -1, np.int32)
  token_ = np.zeros((batch_size, num_edges), np.int32)
  child = np.zeros((batch_size, num_edges), np.int32)
  term = np.zeros((batch_size, num_nodes), bool)
  has_children = np.zeros((batch_size, num_nodes), bool)
  active = np.zeros((batch_size,), bool)
  free_class = np.full((batch_size, num_nodes), -1, np.int32)
  free_min = np.zeros((batch_size, num_nodes), np.int32)
  free_max = np.zeros((batch_size, num_nodes), np.int32)
  to_leaf = np.zeros((batch_size, num_nodes), np.int32)
  for b, (children, terminal, free) in enumerate(rows):
    if len(children) == 1 and not free:
      continue
    active[b] = True
    edges = [(p, t, c) for p, kids in enumerate(children) for t, c in kids.items()]
    if edges:
      parent[b, :len(edges)], token_[b, :len(edges)], child[b, :len(edges)] = np.array(edges).T
    term[b, :len(terminal)] = terminal
    has_children[b, :len(children)] = [bool(k) for k in children]
    for node, span in free.items():
      free_class[b, node] = classes[span.forbidden]
      free_min[b, node], free_max[b, node] = span.min_tokens, span.max_tokens
      has_children[b, node] = True  # a free node is never a leaf
    # Children are created after their parents, so a reverse sweep sees every child first.
    for node in range(len(children) - 1, -1, -1):
      if not terminal[node]:
        to_leaf[b, node] = 1 + min(to_leaf[b, c] for c in children[node].values())
  forbidden = tuple(sorted(classes, key=classes.get))
  return ConstraintTries(parent, token_, child, term, has_children, active, free_class, free_min,
                         free_max, to_leaf, forbidden)


def response_choices(sequences: Sequence[Sequence], response_ids: Sequence[int],
                     eos_ids: Sequence[int]) -> list[tuple[int, ...]]:
  """The tokens the constraint let the sampler choose from at each token of a response.

  The trie of `sequences` (a row's `constrained_token_sequences`, as `build_tries` packs
  them) is walked along `response_ids`. Entry j holds, sorted, the ids allowed at the node
  the sampler stood on before token j: the node's edge tokens, and the EOS ids where the
  node also ends an allowed sequence (the sampler's `token_rules` step); one id means the
  token was forced. At a free node, and once the response has left the trie (an EOS), the
  entry is `()`: the whole vocabulary was open (a free span's tokens are scored
  unconstrained).
  """
  children: list[dict[int, int]] = [{}]
  terminal = [False]
  free: set[int] = set()
  for seq in sequences:
    node = 0
    for token in seq:
      if isinstance(token, FreeSpan):
        free.add(node)
        continue
      node = children[node].setdefault(int(token), len(children))
      if node == len(children):
        children.append({})
        terminal.append(False)
    terminal[node] = True
  eos = tuple(int(i) for i in eos_ids)
  out: list[tuple[int, ...]] = []
  node: int | None = 0
  for token in response_ids:
    token = int(token)
    if node is None or node in free:
      out.append(())
      if node is not None:
        node = children[node].get(token, node)  # a free token stays on the free node
      continue
    kids = children[node]
    allowed = set(kids) | (set(eos) if terminal[node] and kids else set())
    out.append(tuple(sorted(allowed)))
    node = kids.get(token)
  return out
