"""HiPER's response format: the "Options" prompt, the parser, token span tags, the grammar.

HiPER (arXiv 2602.16165; code JonP07/HiPER-agent) has one LLM answer every turn with
exactly three blocks, `<switch>KEEP|SWITCH</switch><subgoal>...</subgoal><action>...</action>`
(no `<think>` block); see docs/algorithms.md (HiPER section).

* Prompt (`render_prompt`): the released "Options" templates of
  `agent_system/environments/prompts/{alfworld,webshop}.py`: task, step count, the last H
  (observation, action) pairs, the current observation, the current subgoal (the previous
  turn's parsed subgoal; "None" at step 1) and the admissible actions, formatted as the
  released `env_manager.py` does (ALFWorld: actions joined by "\\n " without 'help';
  WebShop: one `'a',` per line, observation = the quoted page parts after the instruction).
  Other environments get the ALFWorld wording with a generic role sentence and the task.
  `format_instructions=False` (`rollout.format_instructions`) keeps only the state parts
  (`state_only`), for small constrained models with short prompt budgets.
  `history_drop_chars` (`rollout.history_drop_chars`; 13,000 in the WebShop paper setting)
  replaces a prompt with history longer than that by the no-history one, as the released
  WebShop env manager does.
* Parser (`parse_response`), after the released `*_projection_options`: the action is the
  lower-cased text between the first `<action>` and the next `</action>` (else the last
  `fallback_chars` characters, invalid); `switch` is the content of the first
  `<switch>...</switch>` (stripped, upper-cased; None when a tag is missing: HAE then counts
  the turn as KEEP, as the released `hier_mask.py` does); `subgoal` is the stripped content of
  the first `<subgoal>...</subgoal>` (None when a tag is missing). Valid iff the action tags,
  the switch tags with content KEEP or SWITCH and the subgoal tags are all present and the
  response has no CJK characters. Block order and repeated blocks are not checked (the
  released parser uses the first occurrence of each tag and does not look at order).
  Differences from the released parser, on purpose: closing tags are searched after their
  opening tag, and when the subgoal tags are missing the next prompt shows "None" as the
  current subgoal (the released ALFWorld code shows the action's last 30 characters when
  the switch is missing and "" when the switch content is invalid).
* Token tags (`token_tags`): one `hgpo_jax.advantages.hae.TAG_*` code per response token.
  A block's span runs from its opening tag to the end of its closing tag (the tag markup
  belongs to the span, as in the `hae` estimator's routing); a block without its closing
  tag has no span. Character offsets come from the per-token decoded texts, as the released
  `hier_mask.py` does (lines 8-80, include_tags=True as `ray_trainer.py` calls it): a
  block covers every token that overlaps it, so a token that straddles two blocks (e.g.
  "><" in "</subgoal><action>") is in both and gets a multi-block code
  (`hae.TAG_SUBGOAL_ACTION`), and a token such as "\\n<" that runs into a block is in it.
* Grammar (`constrained_responses`): constrained decoding for small models. Every response
  is `<switch>` KEEP or SWITCH `</switch><subgoal>` subgoal `</subgoal><action>` admissible
  action `</action>`. After SWITCH (and at step 1, or when there is no current subgoal, after
  either) the subgoal is a free span of at most `subgoal_tokens` tokens without "<" or ">";
  after KEEP it is the current subgoal copied verbatim (the format's rule). The copy is the
  previous turn's subgoal *token ids* (`subgoal_content_ids`, a `constrained.TokenIds`
  piece), not its text encoded afresh: the consistency penalty compares token ids (released,
  and the trainer's rule), and a sampled span's ids need not be the ones its text encodes to
  (a sampled "m", "i" against the merged "mi"), so a re-encoded copy would pay the penalty
  for a subgoal it did not change. With the ids copied, a constrained KEEP turn changes
  neither the subgoal's text nor its ids. (Without the previous ids, e.g. a subgoal given
  as text only, the text is encoded afresh.)
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from hgpo_jax.advantages import hae
from hgpo_jax.advantages.hae import TAG_ACTION, TAG_SUBGOAL, TAG_SWITCH
from hgpo_jax.rollout import projection
from hgpo_jax.rollout.prompts import EpisodeMemory
from hgpo_jax.sampling import constrained

KEEP, SWITCH = "KEEP", "SWITCH"
NO_SUBGOAL = "None"
"""The current subgoal shown at step 1 (and after a turn without subgoal tags)."""

BLOCKS = (("<switch>", "</switch>", TAG_SWITCH), ("<subgoal>", "</subgoal>", TAG_SUBGOAL),
          ("<action>", "</action>", TAG_ACTION))

SUBGOAL_FORBIDDEN = "<>"
"""Characters a constrained free subgoal may not contain (its terminator starts with "<")."""

_OPTIONS_INTRO = (
    "You will complete the task by maintaining a SHORT-TERM SUB-GOAL at each step. A sub-goal "
    "is a small high-level objective that can typically be achieved in a few actions. A sub-goal "
    "is NOT the full task and NOT a low-level action.\n\n"
    "At every step, you reconsider your current sub-goal based on the latest observation, and "
    "may continue it or switch to a new short-term sub-goal.\n\n")

_BLOCKS_LIST = (
    "At EVERY step, you MUST output EXACTLY THREE blocks, in the order shown below:\n"
    "1) A <switch> block          (KEEP or SWITCH)\n"
    "2) A <subgoal> block         (the sub-goal to follow next)\n"
    "3) An <action> block         (one admissible action)\n\n")

_RULES_FIRST = (
    "NO other text, comments, or reasoning is allowed before, after, or between these blocks.\n\n"
    "STRICT FORMAT REQUIREMENTS:\n"
    "- <switch> MUST contain ONLY \"KEEP\" or \"SWITCH\".\n"
    "- <subgoal> MUST appear at EVERY step:\n"
    "    * If <switch>KEEP</switch>, you MUST copy the EXACT current sub-goal.\n"
    "    * If <switch>SWITCH</switch>, you MUST write a NEW short sub-goal achievable in a few "
    "actions.\n")

_RULES_STEP = (
    "NO other text, comments, or reasoning is permitted anywhere in the output.\n\n"
    "STRICT FORMAT REQUIREMENTS:\n"
    "- <switch> MUST contain ONLY \"KEEP\" or \"SWITCH\".\n"
    "- <subgoal> MUST appear at EVERY step:\n"
    "    * If you KEEP, copy the EXACT current sub-goal into <subgoal>.\n"
    "    * If you SWITCH, write a NEW short sub-goal achievable in a few actions and NOT the "
    "entire task.\n")

_RESPOND = (
    "- <action> MUST contain EXACTLY ONE action verbatim copied AS IS from the admissible "
    "actions list.\n\n"
    "NOW RESPOND IN THIS EXACT FORMAT (no extra text):\n\n"
    "<switch>KEEP or SWITCH</switch>\n"
    "<subgoal>the sub-goal you will follow next</subgoal>\n"
    "<action>EXACTLY one ADMISSIBLE action</action>\n")

ALFWORLD_OPTIONS_FIRST = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n\n" + _OPTIONS_INTRO
    + "Your current observation is:\n{observation}\n\n"
    "Your current sub-goal is:\n{subgoal}\n"
    "(If this is the first step of the episode, this will be \"None\".)\n\n"
    "Your admissible actions are:\n[{actions}]\n\n" + _BLOCKS_LIST + _RULES_FIRST + _RESPOND)

ALFWORLD_OPTIONS_STEP = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
    "Your overall task is: {task}\n\n" + _OPTIONS_INTRO
    + "You have already taken {steps_taken} step(s).\n"
    "Most recent {history_length} observations and actions:\n{history}\n\n"
    "Your current observation is:\n{observation}\n\n"
    "Your current sub-goal is:\n{subgoal}\n\n"
    "Your admissible actions are:\n[{actions}]\n\n" + _BLOCKS_LIST + _RULES_STEP + _RESPOND)

_WEBSHOP_ROLE = ("\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce "
                 "environment. Your task is to: {task}.\n\n")
_WEBSHOP_ACTIONS = ("Your admissible actions of the current situation are: \n[\n{actions}\n].\n\n")

WEBSHOP_OPTIONS_FIRST = (
    _WEBSHOP_ROLE + _OPTIONS_INTRO + "Your current observation is: {observation}.\n\n"
    "Your current sub-goal is: {subgoal}.\n\n" + _WEBSHOP_ACTIONS + _BLOCKS_LIST + _RULES_FIRST
    + _RESPOND)

WEBSHOP_OPTIONS_STEP = (
    _WEBSHOP_ROLE + _OPTIONS_INTRO
    + "You have already taken {steps_taken} step(s). Below are the most recent {history_length} "
    "observations and the corresponding actions you took: {history}\n"
    "You are now at step {current_step} and your current observation is: {observation}.\n\n"
    "Your current sub-goal is: {subgoal}.\n\n" + _WEBSHOP_ACTIONS + _BLOCKS_LIST + _RULES_STEP
    + _RESPOND)

# Further environments (Sokoban, ...): the ALFWorld wording with a generic role and the task.
GENERIC_OPTIONS_FIRST = (
    "\nYou are an expert agent.\nYour overall task is: {task}\n\n" + _OPTIONS_INTRO
    + "Your current observation is:\n{observation}\n\n"
    "Your current sub-goal is:\n{subgoal}\n"
    "(If this is the first step of the episode, this will be \"None\".)\n\n"
    "Your admissible actions are:\n[{actions}]\n\n" + _BLOCKS_LIST + _RULES_FIRST + _RESPOND)
GENERIC_OPTIONS_STEP = ALFWORLD_OPTIONS_STEP.replace(
    "You are an expert agent operating in the ALFRED Embodied Environment.",
    "You are an expert agent.")

_TEMPLATES = {
    "alfworld": (ALFWORLD_OPTIONS_FIRST, ALFWORLD_OPTIONS_STEP,
                 lambda acts: "\n ".join(f"'{a}'" for a in acts)),
    "webshop": (WEBSHOP_OPTIONS_FIRST, WEBSHOP_OPTIONS_STEP,
                lambda acts: "\n".join(f"'{a}'," for a in acts)),
}
_GENERIC = (GENERIC_OPTIONS_FIRST, GENERIC_OPTIONS_STEP,
            lambda acts: ", ".join(f"'{a}'" for a in acts))

INSTRUCTION_PARTS = (_OPTIONS_INTRO, _BLOCKS_LIST + _RULES_FIRST + _RESPOND,
                     _BLOCKS_LIST + _RULES_STEP + _RESPOND)
"""The format-instruction paragraphs of the templates (what `format_instructions=False`
removes): the sub-goal introduction and, after the admissible actions, the block list,
the rules and the answer format."""


def state_only(template: str) -> str:
  """`template` without its `INSTRUCTION_PARTS`: role, task, step count, history,
  observation, current subgoal and admissible actions, in the released order."""
  for part in INSTRUCTION_PARTS:
    template = template.replace(part, "")
  return template


def observation_text(env_name: str, result) -> str:
  """The observation HiPER's prompt and memory show: WebShop's quoted page parts after the
  instruction (the released `format_obs`, our `anchor_obs`), else the raw observation."""
  return result.anchor_obs if env_name == "webshop" else result.observation


def render_prompt(env_name: str, memory: EpisodeMemory, observation: str,
                  admissible: Sequence[str], history_length: int, subgoal: str,
                  format_instructions: bool = True, history_drop_chars: int = 0) -> str:
  """The user-message text of one HiPER turn (see the module docstring).

  Args:
    env_name: "alfworld", "webshop" or another env (generic wording).
    memory: the trajectory's (observation, action) records and task.
    observation: the current observation (`observation_text`).
    admissible: the admissible actions ('help' is dropped).
    history_length: H, the number of past (observation, action) pairs shown.
    subgoal: the current subgoal (`NO_SUBGOAL` at step 1).
    format_instructions: False: the template without its `INSTRUCTION_PARTS` (`state_only`).
      The released text puts ~1,000 characters of instructions after the admissible
      actions, so a prompt truncated on the left to a few hundred tokens keeps only them
      (the tiny byte-level tokenizer: the last 256 tokens of an ALFWorld step-1 prompt
      hold no observation and no action). For constrained decoding, which enforces the
      format anyway.
    history_drop_chars: if > 0, a prompt with history longer than this many characters is
      replaced by the first-step template with the same current subgoal, as the released
      `WebshopEnvironmentManagerOptions.build_text_obs` does at 13,000 characters (its
      no-history template gets `current_subgoal=subgoals[i]`, not "None"). The length is
      that of the prompt as rendered (without the instructions when `format_instructions`
      is False), as `prompts.render_prompt` measures its own.
  """
  first, step, join = _TEMPLATES.get(env_name, _GENERIC)
  if not format_instructions:
    first, step = state_only(first), state_only(step)
  actions = join([a for a in admissible if a != "help"])
  without_history = first.format(task=memory.task, observation=observation, subgoal=subgoal,
                                 actions=actions)
  if not memory.records or history_length <= 0:
    return without_history
  history, shown = memory.render(history_length)
  text = step.format(task=memory.task, steps_taken=len(memory.records), history_length=shown,
                     history=history, current_step=len(memory.records) + 1,
                     observation=observation, subgoal=subgoal, actions=actions)
  if history_drop_chars > 0 and len(text) > history_drop_chars:
    return without_history
  return text


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
  """One parsed HiPER response.

  Attributes:
    action: the env action (lower-cased), or the response's last `fallback_chars`
      characters when the action tags are missing.
    valid: the format flag (see the module docstring).
    switch: the `<switch>` content, stripped and upper-cased; None if a tag is missing.
    subgoal: the `<subgoal>` content, stripped; None if a tag is missing.
  """
  action: str
  valid: bool
  switch: str | None
  subgoal: str | None


def _block(text: str, open_tag: str, close_tag: str) -> tuple[int, int, int] | None:
  """(open start, content start, close start) of the first block, or None."""
  start = text.find(open_tag)
  if start == -1:
    return None
  content = start + len(open_tag)
  close = text.find(close_tag, content)
  return None if close == -1 else (start, content, close)


def parse_response(response: str, fallback_chars: int = projection.ALFWORLD_FALLBACK_CHARS
                   ) -> ParsedResponse:
  """Parses one HiPER response (see the module docstring for the rules)."""
  action, valid = projection.project_action(response, fallback_chars, require_think=False)
  switch = subgoal = None
  found = _block(response, "<switch>", "</switch>")
  if found:
    switch = response[found[1]:found[2]].strip().upper()
  found = _block(response, "<subgoal>", "</subgoal>")
  if found:
    subgoal = response[found[1]:found[2]].strip()
  valid = valid and switch in (KEEP, SWITCH) and subgoal is not None
  return ParsedResponse(action=action, valid=valid, switch=switch, subgoal=subgoal)


def block_spans(text: str) -> list[tuple[int, int, int]]:
  """(char start, char end, TAG_*) of each complete block, tags included, in text order."""
  spans = []
  for open_tag, close_tag, tag in BLOCKS:
    found = _block(text, open_tag, close_tag)
    if found:
      spans.append((found[0], found[2] + len(close_tag), tag))
  return sorted(spans)


def token_tags(token_texts: Sequence[str]) -> list[int]:
  """One TAG_* code per token, from the decoded text of each token (module docstring).

  Each complete block covers the tokens from the one holding its first character to the
  one holding its last (hier_mask.py `_span_from_tags_text`, include_tags=True); a token
  covered by several blocks gets the code of that set (`hae.tag_code`).
  """
  ends, pos = [], 0
  for piece in token_texts:
    pos += len(piece)
    ends.append(pos)
  starts = [e - len(p) for e, p in zip(ends, token_texts)]
  member = [[False, False, False] for _ in token_texts]
  for lo, hi, tag in block_spans("".join(token_texts)):
    first = next((i for i, e in enumerate(ends) if e > lo), None)  # _char_to_token_start
    if first is None:
      continue
    stop = next((i for i, s in enumerate(starts) if s >= hi), len(starts))  # _char_to_token_end
    for i in range(first, stop):
      member[i][tag - TAG_SWITCH] = True
  return [hae.tag_code(*m) for m in member]


def token_texts(tokenizer, ids: Sequence[int]) -> list[str]:
  """Decoded text of each token on its own (special tokens such as EOS decode to "")."""
  return [tokenizer.decode([int(i)]) for i in ids]


def subgoal_content_ids(token_texts: Sequence[str], ids: Sequence[int]) -> tuple[int, ...]:
  """The ids of the tokens that lie wholly inside the first complete subgoal block's content
  (between `<subgoal>` and `</subgoal>`), or () without such a block or tokens.

  On a constrained response these are exactly the subgoal's tokens as sampled (the fixed
  tag text is tokenized on its own, so token boundaries fall on the tags' edges); they are
  what the next KEEP turn copies (`constrained_responses`).
  """
  found = _block("".join(token_texts), "<subgoal>", "</subgoal>")
  if found is None:
    return ()
  out, pos = [], 0
  for piece, token in zip(token_texts, ids):
    if pos >= found[1] and pos + len(piece) <= found[2] and piece:
      out.append(int(token))
    pos += len(piece)
  return tuple(out)


def constrained_responses(admissible: Sequence, subgoal: str, first_step: bool,
                          subgoal_tokens: int = 12,
                          subgoal_ids: Sequence[int] = ()) -> list[tuple]:
  """The allowed responses of one HiPER turn for `Sampler.generate(allowed=...)`, to be used
  with `RESPONSE_CONSTRAINT` (the pieces carry all tags).

  Args:
    admissible: admissible actions, as strings or piece tuples (e.g. a WebShop search with
      a free query, `projection.free_query_actions`).
    subgoal: the current subgoal.
    first_step: step 1 (the current subgoal is only the "None" placeholder).
    subgoal_tokens: cap of a free subgoal.
    subgoal_ids: the current subgoal's token ids as the previous turn wrote them
      (`subgoal_content_ids`); a KEEP turn copies them exactly. Empty: the KEEP turn's
      subgoal is `subgoal` encoded afresh.
  """
  free = constrained.FreeSpan(subgoal_tokens, SUBGOAL_FORBIDDEN)
  copy = None if first_step or subgoal in ("", NO_SUBGOAL) else subgoal
  out = []
  for action in admissible:
    tail = ("</subgoal><action>",) + ((action,) if isinstance(action, str) else tuple(action)) + (
        "</action>",)
    if copy is None:
      keep = (f"<switch>{KEEP}</switch><subgoal>", free)
    elif subgoal_ids:
      keep = (f"<switch>{KEEP}</switch><subgoal>", constrained.TokenIds(tuple(subgoal_ids)))
    else:
      keep = (f"<switch>{KEEP}</switch><subgoal>{copy}",)
    out.append(keep + tail)
    out.append((f"<switch>{SWITCH}</switch><subgoal>", free) + tail)
  return out


RESPONSE_CONSTRAINT = constrained.ActionConstraint(prefix="", suffix="")
"""Whole-response constraint for `constrained_responses` (no extra prefix or suffix)."""

