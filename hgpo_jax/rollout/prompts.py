"""Per-step prompts: the published verl-agent templates and the memory window.

The step-wise framework (docs/algorithms.md §1) builds a fresh single-turn prompt at every env
step from the task, the last `H` (observation, action) records, the current
observation and the admissible actions; the context does not grow with the episode.
Template wording follows verl-agent's ALFWorld / WebShop / Search prompts so that published
configurations transfer; `{history}` is rendered by `EpisodeMemory.render` (Search:
`EpisodeMemory.render_search`, whose records are (retrieved information, action)).
"""

from __future__ import annotations

import dataclasses

_TURN = "Now it's your turn to take an action.\n"
_REASONING = (
    "You should first reason step-by-step about the current situation. This reasoning "
    "process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for "
    "current step and present it within <action> </action> tags.")

ALFWORLD_FIRST = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
    "Your current observation is: {observation}\n"
    "Your admissible actions of the current situation are: [{actions}].\n\n"
    + _TURN + _REASONING + "\n")

ALFWORLD_STEP = (
    "\nYou are an expert agent operating in the ALFRED Embodied Environment. "
    "Your task is to: {task}\n"
    "Prior to this step, you have already taken {steps_taken} step(s). Below are the most "
    "recent {history_length} observations and the corresponding actions you took: {history}\n"
    "You are now at step {current_step} and your current observation is: {observation}\n"
    "Your admissible actions of the current situation are: [{actions}].\n\n"
    + _TURN + _REASONING + "\n")

_WEBSHOP_TURN = "Now it's your turn to take one action for the current step.\n"
_WEBSHOP_REASONING = (
    "You should first reason step-by-step about the current situation, then think carefully "
    "which admissible action best advances the shopping goal. This reasoning process MUST be "
    "enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current "
    "step and present it within <action> </action> tags.")

WEBSHOP_FIRST = (
    "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment. \n"
    "Your task is to: {task}.\n"
    "Your current observation is: {observation}.\n"
    "Your admissible actions of the current situation are: \n[\n{actions}\n].\n\n"
    + _WEBSHOP_TURN + _WEBSHOP_REASONING + "\n")

WEBSHOP_STEP = (
    "\nYou are an expert autonomous agent operating in the WebShop e\u2011commerce environment.\n"
    "Your task is to: {task}.\n"
    "Prior to this step, you have already taken {steps_taken} step(s). Below are the most "
    "recent {history_length} observations and the corresponding actions you took: {history}\n"
    "You are now at step {current_step} and your current observation is: {observation}.\n"
    "Your admissible actions of the current situation are: \n[\n{actions}\n].\n\n"
    + _WEBSHOP_TURN + _WEBSHOP_REASONING + "\n")

# Generic template for the further environments (Sokoban, ...): same structure.
GENERIC_FIRST = (
    "\nYou are an expert agent. Your task is to: {task}\n"
    "Your current observation is: {observation}\n"
    "Your admissible actions of the current situation are: [{actions}].\n\n"
    + _TURN + _REASONING + "\n")
GENERIC_STEP = (
    "\nYou are an expert agent. Your task is to: {task}\n"
    "Prior to this step, you have already taken {steps_taken} step(s). Below are the most "
    "recent {history_length} observations and the corresponding actions you took: {history}\n"
    "You are now at step {current_step} and your current observation is: {observation}\n"
    "Your admissible actions of the current situation are: [{actions}].\n\n"
    + _TURN + _REASONING + "\n")

# verl-agent's agent_system/environments/prompts/search.py (SEARCH_TEMPLATE_NO_HIS and
# SEARCH_TEMPLATE), word for word: the question and the interaction history, no current
# observation and no action list (the actions are free text).
_SEARCH_INSTRUCTIONS = (
    "Now it's your turn to respond for the current step.\n"
    "You should first conduct reasoning process. This process MUST be enclosed within "
    "<think> </think> tags. \n"
    "After completing your reasoning, choose only one of the following actions (do not perform "
    "both):\n"
    "(1) If you find you lack some knowledge, you can call a search engine to get more external "
    "information using format: <search> your query </search>.\n"
    "(2) If you have enough knowledge to answer the question confidently, provide your final "
    "answer within <answer> </answer> tags, without detailed illustrations. For example, "
    "<answer>Beijing</answer>.\n")
SEARCH_FIRST = (
    "\nYou are an expert agent tasked with answering the given question step-by-step.\n"
    "Your question: {task}\n\n" + _SEARCH_INSTRUCTIONS)
SEARCH_STEP = (
    "\nYou are an expert agent tasked with answering the given question step-by-step.\n"
    "Your question: {task}\n\n"
    "Prior to this step, you have already taken {steps_taken} step(s). Below is the interaction "
    "history where <search> </search> wrapped your past search queries and <information> "
    "</information> wrapped the corresponding search results returned by the external search "
    "engine. History:\n{history}\n\n" + _SEARCH_INSTRUCTIONS)
SEARCH_LISTED = "Your admissible actions of the current situation are: [{actions}].\n"
"""Appended to the search prompt only when the env lists actions (its CPU-scale `listed`
variant, not the published setting)."""

_TEMPLATES = {
    "alfworld": (ALFWORLD_FIRST, ALFWORLD_STEP, "\n ".join),
    # every action, the last one too, ends with a comma (the released
    # `"\n".join(f"'{s}'," for s in available_actions)`)
    "webshop": (WEBSHOP_FIRST, WEBSHOP_STEP, lambda quoted: "\n".join(q + "," for q in quoted)),
}
_GENERIC = (GENERIC_FIRST, GENERIC_STEP, ", ".join)

_INSTRUCTIONS = {"alfworld": _TURN + _REASONING + "\n",
                 "webshop": _WEBSHOP_TURN + _WEBSHOP_REASONING + "\n",
                 "search": _SEARCH_INSTRUCTIONS}
"""The closing format instructions of each template (the generic one ends as ALFWorld's):
what `format_instructions=False` leaves out."""


def instructions(env_name: str) -> str:
  """The format-instruction paragraph that ends `env_name`'s templates."""
  return _INSTRUCTIONS.get(env_name, _INSTRUCTIONS["alfworld"])


def _without_instructions(text: str, env_name: str) -> str:
  suffix = instructions(env_name)
  if not text.endswith(suffix):
    raise ValueError(f"{env_name} prompt does not end with its format instructions")
  return text[:-len(suffix)]

TASK_MARKER = "Your task is to: "


def task_from_observation(observation: str) -> str:
  """ALFWorld's task sentence: the text after "Your task is to: " in the first observation."""
  at = observation.find(TASK_MARKER)
  if at == -1:
    raise ValueError("no 'Your task is to: ' sentence in the initial observation; "
                     "pass the task description explicitly")
  return observation[at + len(TASK_MARKER):].strip()


@dataclasses.dataclass
class EpisodeMemory:
  """Per-trajectory memory (verl-agent `SimpleMemory`): what the agent saw and did.

  One record per executed step: the observation shown in that step's prompt and the
  *parsed* action string. `render(H)` gives the last H records as
  `[Observation n: '<obs>', Action n: '<action>']` with absolute 1-based numbers.
  """

  task: str
  records: list[tuple[str, str]] = dataclasses.field(default_factory=list)

  def add(self, observation: str, action: str) -> None:
    self.records.append((observation, action))

  def render(self, history_length: int) -> tuple[str, int]:
    """Returns (history text, number of records shown)."""
    if history_length <= 0:
      return "", 0
    recent = self.records[-history_length:]
    first = len(self.records) - len(recent) + 1
    parts = [f"[Observation {first + i}: '{obs}', Action {first + i}: '{act}']"
             for i, (obs, act) in enumerate(recent)]
    return "\n".join(parts), len(recent)

  def render_search(self, history_length: int) -> str:
    """The last H records as verl-agent's `SearchMemory.fetch` writes them:
    `Step n:<action> <information>` plus a newline each, joined by newlines."""
    recent = self.records[-history_length:] if history_length > 0 else []
    first = len(self.records) - len(recent) + 1
    return "\n".join(f"Step {first + i}:{act} {obs}\n" for i, (obs, act) in enumerate(recent))


def observation_text(env_name: str, result) -> str:
  """The observation a prompt (and the memory) shows for an env step result: on WebShop
  the page parts after the instruction, each quoted (the released env manager's
  `format_obs`; the server's `anchor_obs`), elsewhere the raw observation."""
  return result.anchor_obs if env_name == "webshop" else result.observation


def memory_observation(env_name: str, shown: str, result) -> str:
  """What the memory records with a step's action: the observation the step was shown, or
  on Search the information the action retrieved (`result`: the step's result;
  verl-agent's search env manager stores the next observation)."""
  return result.observation.strip() if env_name == "search" else shown


def render_search_prompt(memory: EpisodeMemory, admissible: list[str],
                         history_length: int, format_instructions: bool = True) -> str:
  """verl-agent's search prompt (the current observation lives in the history)."""
  if memory.records and history_length > 0:
    text = SEARCH_STEP.format(task=memory.task, steps_taken=len(memory.records),
                              history=memory.render_search(history_length))
  else:
    text = SEARCH_FIRST.format(task=memory.task)
  if not format_instructions:
    text = _without_instructions(text, "search")
  if admissible:
    text += SEARCH_LISTED.format(actions=", ".join(f"'{a}'" for a in admissible))
  return text


def render_prompt(env_name: str, memory: EpisodeMemory, observation: str,
                  admissible: list[str], history_length: int,
                  history_drop_chars: int = 0, format_instructions: bool = True) -> str:
  """The user-message text for the current step of one trajectory.

  Args:
    observation: the current observation as shown (`observation_text`).
    history_drop_chars: if > 0, a prompt with history longer than this many characters is
      replaced by the first-step template (no history), as verl-agent's WebShop env
      manager does at 13,000 characters (the HGPO recipe's has that line commented out).
    format_instructions: False leaves out the closing format instructions (`instructions`):
      for constrained decoding, where the constraint writes the response's format, so the
      instructions only lengthen the prompt (counted after the history drop).
  """
  if env_name == "search":
    return render_search_prompt(memory, admissible, history_length, format_instructions)
  first, step, join = _TEMPLATES.get(env_name, _GENERIC)
  actions = join(f"'{a}'" for a in admissible if a != "help")
  text = first.format(task=memory.task, observation=observation, actions=actions)
  if memory.records:
    history, shown = memory.render(history_length)
    with_history = step.format(task=memory.task, steps_taken=len(memory.records),
                               history_length=shown, history=history,
                               current_step=len(memory.records) + 1,
                               observation=observation, actions=actions)
    if not (history_drop_chars > 0 and len(with_history) > history_drop_chars):
      text = with_history
  return text if format_instructions else _without_instructions(text, env_name)
