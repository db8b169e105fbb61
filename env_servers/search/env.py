"""SearchEnv: Search-R1's question answering with a search tool, as verl-agent plays it.

  env = SearchEnv()                                   # frozen synthetic data, in-process BM25
  env = SearchEnv(data_dir="DIR", corpus="wiki-18.jsonl", retriever="127.0.0.1:8123")
  obs, info = env.reset(options={"task_id": "test-0001"})     # obs: the question
  obs, reward, terminated, truncated, info = env.step("<search>Zorvath Industries</search>")

An episode asks one question. An action is `<search>query</search>` (the top-`topk`
passages come back as the observation, in Search-R1's format
`<information>Doc 1(Title: T) text\\nDoc 2(Title: ...) ...</information>`) or
`<answer>text</answer>` (ends the episode). As in verl-agent's search env (agent_system/
environments/env_package/search/third_party/skyrl_gym/envs/search/env.py): an action
holding `<answer>` and `</answer>` ends the episode; otherwise the first
`<search>...</search>` block is searched; anything else (no tag) is an invalid action with
an empty observation (verl-agent passes such a step on with no tool call); every action
counts a turn, and at `max_steps` turns the episode ends whatever the action (truncated
unless it answered). The trainer's projection (hgpo_jax/rollout/projection.py,
`project_search_action`) flags no tag and two tags as invalid format, as verl-agent's.

Reward: 1.0 when the answer matches a gold answer exactly after Search-R1's normalisation
(`reward.exact_match`), else 0; info["f1"] and info["score"] hold the token F1 (a metric).

Documented handling of bad inputs: an empty query (`<search> </search>`) is an invalid
action (empty observation, info["invalid_reason"]); a query longer than
`MAX_QUERY_CHARS` is cut to it; a search with no hit shows
`<information>No search results found.</information>`; a passage longer than
`passage_words` words is cut there with " ..." (Search-R1's wiki-18 passages are 100
words). A retriever that cannot answer raises `RetrieverError` (the server reports the
slot's env error): a search never silently returns nothing.

Observations for grouping: info["anchor_obs"] is the question followed by every
`<information>` block the episode retrieved so far, so two trajectories at equal question
and equal retrieved history share an anchor state (GiGPO), whatever their queries' wording
and their invalid turns. verl-agent's anchor is the last observation alone; the history
makes states with different earlier retrievals distinct.

`actions="listed"` (a CPU-scale variant, not the published setting, whose actions are free
text): info["admissible_actions"] lists candidate searches (the question, the capitalised
names in it and in the passages retrieved so far) and candidate answers (names and
numbers in those passages), for constrained decoding by small policies, as WebShop-mini's
listed searches. `actions="free"` (default) lists nothing.
"""

from __future__ import annotations

import re
from typing import Any

import gymnasium as gym

from env_servers import base
from env_servers.retriever import client as client_lib
from env_servers.search import dataset
from env_servers.search import reward

ACTIONS = ("free", "listed")
MAX_QUERY_CHARS = 1000
NO_RESULTS = "No search results found."
ACTION_VALID = "action_valid"
_SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Runs of capitalised words (names), and 3-4 digit numbers (years), for the listed variant.
_NAME = re.compile(r"\b[A-Z][a-z0-9]+(?:\s+[A-Z][a-z0-9]+)*\b")
_NUMBER = re.compile(r"\b\d{3,4}\b")
_NOT_NAMES = frozenset("In Who What Which When Where How Its It The A An Doc Title".split())


def format_information(hits: list[client_lib.Retrieved], passage_words: int) -> tuple[str, bool]:
  """Search-R1's `<information>` block of a hit list, and whether a passage was cut."""
  if not hits:
    return f"<information>{NO_RESULTS}</information>", False
  lines, cut = [], False
  for n, hit in enumerate(hits, 1):
    words = hit.passage.text.split()
    text = hit.passage.text
    if len(words) > passage_words:
      text, cut = " ".join(words[:passage_words]) + " ...", True
    lines.append(f"Doc {n}(Title: {hit.passage.title}) {text}")
  return "<information>" + "\n".join(lines) + "</information>", cut


def _names(text: str) -> list[str]:
  out = []
  for m in _NAME.finditer(text):
    words = m.group(0).split()
    while words and words[0] in _NOT_NAMES:
      words = words[1:]
    if words:
      out.append(" ".join(words))
  return out


def _mentions(text: str) -> list[str]:
  """Names and numbers of `text` in the order they appear."""
  found = [(m.start(), name) for m in _NAME.finditer(text) for name in _names(m.group(0))]
  found += [(m.start(), m.group(0)) for m in _NUMBER.finditer(text)]
  return [x for _, x in sorted(found, key=lambda f: f[0])]


def _unique(items) -> list[str]:
  return list(dict.fromkeys(items))


class SearchEnv(gym.Env):
  """See the module docstring; constructor values may be strings (`--env-arg`)."""

  metadata = {"render_modes": []}

  def __init__(self, data_dir: str = "", corpus: str = "", retriever: str = "",
               retriever_token_file: str = "", retriever_tls_cert: str = "",
               retriever_timeout_s: float | str = 10.0, retriever_tries: int | str = 3,
               retriever_model: str = "", topk: int | str = 3, max_steps: int | str = 4, passage_words: int | str = 200,
               actions: str = "free", max_candidates: int | str = 12):
    try:
      self.topk, self.max_steps = int(topk), int(max_steps)
      self.passage_words, self.max_candidates = int(passage_words), int(max_candidates)
    except ValueError as e:
      raise ValueError(f"SearchEnv: topk, max_steps, passage_words and max_candidates must be "
                       f"integers ({e})") from None
    if min(self.topk, self.max_steps, self.passage_words, self.max_candidates) < 1:
      raise ValueError("SearchEnv: topk, max_steps, passage_words and max_candidates must be "
                       ">= 1")
    if actions not in ACTIONS:
      raise ValueError(f"SearchEnv: actions must be one of {ACTIONS}, got {actions!r}")
    self.actions = actions
    corpus = dataset.corpus_path(data_dir, corpus)
    data_dir = data_dir or str(dataset.SYNTHETIC_DIR)
    self._files = dataset.question_files(data_dir)
    self._questions = {split: _questions(str(path)) for split, path in self._files.items()}
    self._by_id = {q.id: q for qs in self._questions.values() for q in qs}
    self.retriever = client_lib.make_retriever(
        retriever, corpus, token_file=retriever_token_file, tls_cert=retriever_tls_cert,
        timeout_s=float(retriever_timeout_s), tries=int(retriever_tries),
        dense_model=retriever_model)
    self.question: dataset.Question | None = None

  def splits(self) -> list[str]:
    return sorted(self._questions)

  def task_ids(self, split: str) -> list[str]:
    if split not in self._questions:
      raise ValueError(f"unknown search split {split!r}; splits: {self.splits()}")
    return [q.id for q in self._questions[split]]

  def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
    super().reset(seed=seed)
    options = options or {}
    task_id = options.get("task_id")
    if task_id is None:
      ids = self.task_ids(options.get("split", "train"))
      task_id = ids[int(self.np_random.integers(len(ids)))]
    if task_id not in self._by_id:
      raise ValueError(f"unknown search task id {task_id!r}; list them with task_ids(split)")
    self.question = self._by_id[task_id]
    self._turns, self._over = 0, False
    self._information: list[str] = []
    self._searched: list[str] = []
    info = self._info(valid=True)
    info["task"] = self.question.question
    return self.question.question, info

  def step(self, action: str):
    if self.question is None or self._over:
      raise RuntimeError("SearchEnv.step() before reset() or after the episode ended; reset first")
    self._turns += 1
    extra: dict[str, Any] = {}
    obs, score, valid, answered = "", 0.0, True, False
    if "<answer>" in action and "</answer>" in action:
      match = _ANSWER.search(action)
      answer = match.group(1).strip() if match else ""
      answered = True
      score = reward.exact_match(answer, self.question.golds)
      extra = {"answer": answer, "f1": reward.f1(answer, self.question.golds)}
    elif self._turns < self.max_steps:
      match = _SEARCH.search(action)
      query = match.group(1).strip()[:MAX_QUERY_CHARS] if match else ""
      if not query:
        valid = False
        extra["invalid_reason"] = ("empty search query" if match else
                                   "no <search>...</search> or <answer>...</answer> block")
      else:
        hits = self.retriever.search([query], self.topk)[0]
        obs, cut = format_information(hits, self.passage_words)
        self._information.append(obs)
        self._searched.append(query)
        extra.update(query=query, num_hits=len(hits), passage_truncated=cut)
    terminated = answered
    truncated = not terminated and self._turns >= self.max_steps
    self._over = terminated or truncated
    info = self._info(valid=valid, won=score == 1.0, f1=extra.get("f1", 0.0))
    info.update(extra)
    return obs, score, terminated, truncated, info

  def _info(self, valid: bool, won: bool = False, f1: float = 0.0) -> dict[str, Any]:
    q = self.question
    return {
        base.ANCHOR_OBS: "\n".join([q.question, *self._information]),
        base.ADMISSIBLE: self._candidates() if self.actions == "listed" and not self._over else [],
        base.WON: won,
        base.SCORE: f1,
        base.TASK_TYPE: q.source or "search",
        ACTION_VALID: valid,
        "task_id": q.id,
        "turns": self._turns,
    }

  def _candidates(self) -> list[str]:
    """The listed variant's actions: searches, then answers, `max_candidates` of each, the
    latest retrieval's mentions first (in text order), as a reader would follow them."""
    retrieved = "\n".join(reversed(self._information))
    searches = _unique(s for s in [self.question.question, *_names(self.question.question),
                                   *_names(retrieved)] if s not in self._searched)
    in_question = set(_names(self.question.question))
    answers = _unique(a for a in _mentions(retrieved) if a not in in_question)
    return ([f"<search>{s}</search>" for s in searches[:self.max_candidates]] +
            [f"<answer>{a}</answer>" for a in answers[:self.max_candidates]])


_CACHE: dict[str, list[dataset.Question]] = {}


def _questions(path: str) -> list[dataset.Question]:
  """A question file, read once per process (all slots of a server share it)."""
  if path not in _CACHE:
    _CACHE[path] = dataset.load_questions(path)
  return _CACHE[path]
