"""Action projection: model response text -> (env action string, validity flag).

Follows the published verl-agent projection (docs/algorithms.md §1; verl-agent's ALFWorld/WebShop projection functions):
  * the response is lower-cased;
  * the action is the text between the first `<action>` and the next `</action>`;
  * valid iff both action tags exist, both `<think>` and `</think>` exist, and the
    response has no CJK characters;
  * with missing action tags the env receives the last `fallback_chars` characters
    of the response (normally a no-op such as ALFWorld's "Nothing happens.").
Admissibility is deliberately *not* part of validity: an admissible-but-wrong or
inadmissible action is the environment's business; validity only measures format.

The Search environment has its own projection (`project_search_action`, verl-agent's
agent_system/environments/env_package/search/projection.py): the first
`<search>...</search>` block, else the first `<answer>...</answer>` block, is the action.
"""

from __future__ import annotations

import re

from hgpo_jax.sampling import constrained

ALFWORLD_FALLBACK_CHARS = 30
"""The default fallback length (ALFWorld's); each env config sets `rollout.fallback_chars`."""

QUERY_PLACEHOLDER = "<your query>"
"""WebShop lists its search action as `search[<your query>]`: a template, not an action.
The WebShop env refuses it (an invalid action); constrained decoding replaces the
placeholder by a free span (`free_query_actions`)."""
QUERY_FORBIDDEN = "[]<>"
"""Characters a constrained free query may not contain (it ends at "]")."""

# CJK Unified Ideographs (+ extension A), CJK symbols/punctuation, Hiragana/Katakana,
# Hangul, full-width forms: the published check rejects responses that drift into them.
_CJK = re.compile(r"[\u3000-\u303f\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uff00-\uffef]")


def project_action(response: str, fallback_chars: int = ALFWORLD_FALLBACK_CHARS,
                   require_think: bool = True) -> tuple[str, bool]:
  """Returns (action, valid) for one model response (docs/algorithms.md §1).

  `require_think=False` drops the think-tag rule: with constrained decoding the sampler
  emits only `<action>...</action>`, so the format signal is the action tags alone.
  """
  text = response.lower()
  start = text.find("<action>")
  end = text.find("</action>", start + len("<action>")) if start != -1 else -1
  if start == -1 or end == -1:
    return text[-fallback_chars:], False
  action = text[start + len("<action>"):end].strip()
  has_think = "<think>" in text and "</think>" in text
  valid = (has_think or not require_think) and not _CJK.search(text)
  return action, valid


def free_query_actions(admissible, max_tokens: int = 8) -> list:
  """Admissible actions for constrained decoding: an action holding `QUERY_PLACEHOLDER`
  becomes pieces with a free span of at most `max_tokens` tokens in its place, e.g.
  `("search[", FreeSpan(8, "[]<>"), "]")`; other actions stay strings."""
  span = constrained.FreeSpan(max_tokens, QUERY_FORBIDDEN)
  return [constrained.split_placeholder(a, QUERY_PLACEHOLDER, span) for a in admissible]


_SEARCH_BLOCK = re.compile(r"<search>(.*?)</search>", re.IGNORECASE | re.DOTALL)
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.IGNORECASE | re.DOTALL)
_SEARCH_TAG = re.compile(r"<search>", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>", re.IGNORECASE)


def project_search_action(response: str) -> tuple[str, bool]:
  """(action, valid) for one Search response, by verl-agent's rules.

  The response is first cut after its first `</search>` (else its first `</answer>`);
  the action is its first `<search>q</search>` block, else its first `<answer>a</answer>`
  block, re-tagged in lower case with the content stripped, else "" (invalid). The
  response is invalid as well, the action still being sent, when it holds both a
  `<search>` and an `<answer>` tag or more than one of either. No think tags are required
  and the text is not lower-cased (queries and answers keep their case).
  """
  for close in ("</search>", "</answer>"):
    at = response.lower().find(close)
    if at != -1:
      cut = response[:at + len(close)]
      break
  else:
    cut = response
  valid = True
  match = _SEARCH_BLOCK.search(cut)
  if match:
    action = f"<search>{match.group(1).strip()}</search>"
  else:
    match = _ANSWER_BLOCK.search(cut)
    action = f"<answer>{match.group(1).strip()}</answer>" if match else ""
    valid = match is not None
  searches, answers = len(_SEARCH_TAG.findall(response)), len(_ANSWER_TAG.findall(response))
  if (searches and answers) or searches > 1 or answers > 1:
    valid = False
  return action, valid
