"""Step-wise rollouts: G tasks x N trajectories through the env pool and the sampler.

For t = 1..T_max, every still-active slot gets a fresh single-turn prompt (memory
window, current observation, admissible actions), the jit sampler answers all
active slots in one batched call, the projection extracts the action, and the pool
steps all slots in one batched call. Every executed step becomes one row (docs/algorithms.md §1),
recorded with the anchor observation the action was taken at.

Strings stay on the host; `advantage_columns` hands the estimator only the step-row schema
(`hgpo_jax.advantages.rows.ROW_FIELDS`, which StepRow's field names follow), per-row results
join back to the StepRows by their (traj, step) key (`GroupedRows.rejoin(rows, values)`), and
`StepRow.dump_record` is the JSONL format of `python -m hgpo_jax.advantages`.

Response formats: "react" (verl-agent's `<think>` + `<action>` prompt and projection; on
Search its `<search>`/`<answer>` projection, `projection.project_search_action`) and
"hiper" (HiPER's `<switch>`/`<subgoal>`/`<action>` blocks, `hgpo_jax.rollout.hiper`): its
rows also carry the parsed switch and subgoal and one span tag per response token, which
the `hae` estimator reads (`hae_fields_from_dump`), and the parsed subgoal becomes the
current subgoal of the trajectory's next prompt.

Constrained decoding (`constrained=True`): the response must pick an admissible action; an
action with WebShop's `<your query>` placeholder becomes a free query of at most
`free_query_tokens` tokens, so the policy writes its own search (the placeholder itself is
never sent); with "hiper" the whole three-block response is constrained
(`hiper.constrained_responses`).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np

from hgpo_jax import progress
from hgpo_jax.advantages import rows as rows_lib
from hgpo_jax.rollout import hiper
from hgpo_jax.rollout import projection
from hgpo_jax.rollout import prompts
from hgpo_jax.rollout.params import RolloutParams
from hgpo_jax.rollout.tasks import Task
from hgpo_jax.sampling import constrained as constrained_lib


@dataclasses.dataclass
class StepRow:
  """One executed env step of one trajectory; the fields named in `rows_lib.ROW_FIELDS`
  (group, traj, step, anchor_obs, reward, valid, done) are that schema's."""

  group: int  # index of the task group within the rollout
  traj: int  # trajectory index within the rollout (slot)
  step: int  # 0-based step index
  task_id: str
  task_type: str
  anchor_obs: str  # raw env observation the action was taken at (grouping key)
  prompt_ids: list[int]
  response_ids: list[int]
  response: str
  action: str
  valid: bool
  reward: float = 0.0
  done: bool = False  # terminated (success/failure), not truncation by a step limit
  won: bool = False
  # HiPER rows only (response_format="hiper"); None for "react" rows.
  switch: str | None = None  # parsed <switch> content (stripped, upper-cased); None = missing
  subgoal: str | None = None  # parsed <subgoal> content (stripped); None = missing
  token_tags: list[int] | None = None  # one hae.TAG_* code per response token
  # the sampler's log-prob of each response token (its raw distribution at temperature 1:
  # `SampleOutput.logprobs`), for the rollout correction and its mismatch metrics
  response_logprobs: list[float] | None = None
  # constrained rows: the token ids the constraint allowed at each response token
  # (`constrained.response_choices`; () = the whole vocabulary), for the learner's
  # constrained log-probs (`train.constrained_logprobs`); None for unconstrained rows
  response_choices: list[tuple[int, ...]] | None = None

  def dump_record(self) -> dict[str, Any]:
    """The JSONL record (`python -m hgpo_jax.advantages` format + extras); HiPER rows add
    `switch`, `subgoal`, `token_tags` and `response_ids` as `hae.hae_fields_from_dump` reads
    them (with both lists the consistency penalty compares token ids, as the trainer does)."""
    record = rows_lib.record(self)
    record.update(won=self.won, task_id=self.task_id, task_type=self.task_type,
                  response=self.response, action=self.action)
    if self.token_tags is not None:
      record.update(switch=self.switch, subgoal=self.subgoal, token_tags=list(self.token_tags),
                    response_ids=[int(x) for x in self.response_ids])
    return record


@dataclasses.dataclass
class Rollout:
  rows: list[StepRow]  # sorted by (group, traj, step)
  won: np.ndarray  # bool[num_trajectories]
  returns: np.ndarray  # f32[num_trajectories]: undiscounted env return
  lengths: np.ndarray  # int[num_trajectories]: executed steps
  task_types: list[str]
  timings: dict[str, float]
  decode_work: tuple[int, int] = (0, 0)
  """(tokens sampled, row-steps the sampler's decode loops ran) over the rollout's
  generate calls (`SampleOutput.decoded_tokens`, `decode_row_steps`)."""
  filter_stats: dict[str, float] = dataclasses.field(default_factory=dict)
  """Dynamic sampling's counts (`dynamic_selection`) when the groups were selected from
  several generation batches; empty otherwise."""

  @property
  def num_trajectories(self) -> int:
    return len(self.won)

  def metrics(self, num_counted: int | None = None) -> dict[str, float]:
    """Episode metrics over the first `num_counted` trajectories (all by default)."""
    n = self.num_trajectories if num_counted is None else num_counted
    rows = [r for r in self.rows if r.traj < n]
    return episode_metrics(rows, self.won[:n], self.returns[:n], self.lengths[:n],
                           self.task_types[:n])


def task_description(env_name: str, first: Any) -> str:
  """The task sentence of an episode from its first step result (`info["task"]`, WebShop's
  instruction, ALFWorld's "Your task is to: ..."), else the first observation."""
  if "task" in first.info:
    return first.info["task"]
  if env_name == "webshop":
    # "WebShop [SEP] Instruction: [SEP] <instruction> [SEP] Search" (the released
    # `extract_task` takes the part after "Instruction:").
    parts = first.observation.split(" [SEP] ")
    if "Instruction:" in parts[:-1]:
      return parts[parts.index("Instruction:") + 1]
  try:
    return prompts.task_from_observation(first.observation)
  except ValueError:
    return first.observation if env_name != "webshop" else first.anchor_obs


def _choices(allowed, constraint, tokenizer, response_ids) -> list[tuple[int, ...]] | None:
  """The allowed token ids at each token of a constrained response (None: a row without
  allowed entries decodes freely)."""
  if not allowed:
    return None
  sequences = constrained_lib.constrained_token_sequences(allowed, constraint, tokenizer.encode)
  return constrained_lib.response_choices(sequences, response_ids, tokenizer.eos_ids)


def encode_prompt(tokenizer, text: str, max_tokens: int) -> list[int]:
  """The token ids the sampler is given for a prompt text: the user message in the
  model's chat template with the generation prompt, its last `max_tokens` tokens."""
  chat = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                       add_generation_prompt=True)
  ids = tokenizer.encode(chat)
  return ids[-max_tokens:]  # truncation=left, as the published scripts


def collect(pool, sampler, tokenizer, tasks: Sequence[Task], group_size: int, *, env_name: str,
            max_steps: int, params: RolloutParams, sampling, rng: jax.Array,
            on_step: Callable[[int, int, int], None] | None = None) -> Rollout:
  """Plays `len(tasks) * group_size` trajectories to the end or `max_steps` steps.

  Slot `g * group_size + i` plays trajectory i of group g; all `group_size` slots of
  a group are reset with the group's task and env seed (same initial state).

  Args (beyond the obvious):
    params: the rollout's settings (`config.rollout`): the prompt's memory window, length
      and format instructions, constrained decoding (see the module docstring), the
      response format ("react" or "hiper"), the caps of a constrained free WebShop query
      and HiPER subgoal, the action projection's fallback, and `history_drop_chars`
      (prompts longer than this lose their history; `prompts.render_prompt`).
    sampling: the sampler's parameters (training or evaluation temperature).
    on_step: called as on_step(t, max_steps, active_slots) before each step's generation.
  """
  times = progress.PhaseTimes()  # generation and env seconds, summed over the turns
  decoded = row_steps = 0
  num = len(tasks) * group_size
  task_ids = [t.task_id for t in tasks for _ in range(group_size)]
  seeds = [t.seed for t in tasks for _ in range(group_size)]
  with times.phase("env"):
    first = pool.reset(task_ids, seeds, tasks[0].split)
  if len(first) < num:
    raise RuntimeError(f"env pool returned {len(first)} results for {num} slots")
  ep = _Episodes(env_name, list(first[:num]))
  rows: list[StepRow] = []

  for t in range(max_steps):
    slots = [i for i in range(num) if ep.active[i]]
    if not slots:
      break
    if on_step is not None:
      on_step(t, max_steps, len(slots))
    shown, prompt_ids, allowed, extra = _turn_prompts(ep, slots, t, tokenizer, params)
    with times.phase("generation"):
      out = sampler.generate(prompt_ids, sampling, jax.random.fold_in(rng, t), allowed=allowed,
                             **extra)
    decoded += out.decoded_tokens
    row_steps += out.decode_row_steps
    step_rows = _turn_rows(ep, slots, t, out, prompt_ids, allowed,
                           extra.get("constraint", constrained_lib.ActionConstraint()),
                           tokenizer, params, group_size, task_ids)
    actions: list[str | None] = [None] * num
    for i, row in step_rows.items():
      actions[i] = row.action
    with times.phase("env"):
      results = pool.step(actions)
    for i, row in step_rows.items():
      if results[i] is None:
        raise RuntimeError(f"env pool returned no result for active slot {i}")
      ep.record(i, row, shown[i], results[i])
      rows.append(row)

  rows.sort(key=lambda r: (r.group, r.traj, r.step))
  return Rollout(rows=rows, won=ep.won, returns=ep.returns.astype(np.float32),
                 lengths=ep.lengths, task_types=ep.task_types,
                 timings={f"{k}_s": times.seconds.get(k, 0.0) for k in ("generation", "env")},
                 decode_work=(decoded, row_steps))


class _Episodes:
  """The state of `collect`'s slots between turns: each slot's last env result, memory,
  HiPER subgoal, whether it still plays, and its return, outcome and length so far."""

  def __init__(self, env_name: str, first: list):
    num = len(first)
    self.env_name = env_name
    self.current = first
    self.memories = [prompts.EpisodeMemory(task_description(env_name, r)) for r in first]
    self.subgoals = [hiper.NO_SUBGOAL] * num  # HiPER: current subgoal of each slot
    self.subgoal_ids = [()] * num  # HiPER: its token ids as written (what a KEEP turn copies)
    self.task_types = [r.info.get("task_type", "") for r in first]
    self.active = [not r.done for r in first]
    self.returns = np.zeros(num)
    self.won = np.zeros(num, dtype=bool)
    self.lengths = np.zeros(num, dtype=np.int64)

  def record(self, i: int, row: StepRow, shown: str, res) -> None:
    """Slot `i`'s env result `res` of `row`'s action: the row's reward and flags, then the
    slot's memory, state and totals."""
    # `done` in a row means terminated; a server-side truncation (its own step limit)
    # also ends the episode here but is not a terminal state for bootstrapping.
    truncated = res.info.get("truncated", "false") == "true"
    row.reward, row.won = float(res.reward), bool(res.won)
    row.done = bool(res.done) and not truncated
    self.memories[i].add(prompts.memory_observation(self.env_name, shown, res), row.action)
    self.current[i] = res
    self.returns[i] += row.reward
    self.won[i] |= row.won
    self.lengths[i] += 1
    if res.done:
      self.active[i] = False


def _turn_prompts(ep: _Episodes, slots: list[int], t: int, tokenizer, params: RolloutParams):
  """Turn `t`'s observation text and prompt ids of each active slot, and with constrained
  decoding the responses each may write (`allowed`) and the sampler's extra arguments."""
  env_name, current = ep.env_name, ep.current
  render = hiper if params.response_format == "hiper" else prompts
  shown = {i: render.observation_text(env_name, current[i]) for i in slots}
  if render is hiper:
    texts = [hiper.render_prompt(env_name, ep.memories[i], shown[i],
                                 current[i].admissible_actions, params.history_length,
                                 ep.subgoals[i], params.format_instructions,
                                 params.history_drop_chars)
             for i in slots]
  else:
    texts = [prompts.render_prompt(env_name, ep.memories[i], shown[i],
                                   current[i].admissible_actions, params.history_length,
                                   params.history_drop_chars, params.format_instructions)
             for i in slots]
  prompt_ids = [encode_prompt(tokenizer, x, params.max_prompt_tokens) for x in texts]
  allowed, extra = None, {}
  if params.constrained:
    allowed = [projection.free_query_actions(current[i].admissible_actions,
                                             params.free_query_tokens)
               for i in slots]
    if render is hiper:
      allowed = [hiper.constrained_responses(a, ep.subgoals[i], t == 0, params.subgoal_tokens,
                                             ep.subgoal_ids[i])
                 for a, i in zip(allowed, slots)]
      extra = {"constraint": hiper.RESPONSE_CONSTRAINT}
  return shown, prompt_ids, allowed, extra


def _turn_rows(ep: _Episodes, slots: list[int], t: int, out, prompt_ids, allowed, constraint,
               tokenizer, params: RolloutParams, group_size: int,
               task_ids: list[str]) -> dict[int, StepRow]:
  """Turn `t`'s row of each active slot from the sampler's output `out`: the response
  parsed into the env action (HiPER: its switch, subgoal and token tags, which update the
  slot's subgoal), before the env's result."""
  rows = {}
  for j, i in enumerate(slots):
    hiper_fields = {}
    if params.response_format == "hiper":
      parsed = hiper.parse_response(out.texts[j], params.fallback_chars)
      action, valid = parsed.action, parsed.valid
      pieces = hiper.token_texts(tokenizer, out.tokens[j])
      hiper_fields = dict(switch=parsed.switch, subgoal=parsed.subgoal,
                          token_tags=hiper.token_tags(pieces))
      ep.subgoals[i] = parsed.subgoal if parsed.subgoal is not None else hiper.NO_SUBGOAL
      ep.subgoal_ids[i] = (hiper.subgoal_content_ids(pieces, out.tokens[j])
                           if parsed.subgoal else ())
    elif ep.env_name == "search":
      action, valid = projection.project_search_action(out.texts[j])
    else:
      action, valid = projection.project_action(out.texts[j], params.fallback_chars,
                                                require_think=not params.constrained)
    rows[i] = StepRow(
        group=i // group_size, traj=i, step=t, task_id=task_ids[i],
        task_type=ep.task_types[i], anchor_obs=ep.current[i].anchor_obs,
        prompt_ids=prompt_ids[j], response_ids=list(out.tokens[j]), response=out.texts[j],
        action=action, valid=valid, response_logprobs=[float(x) for x in out.logprobs[j]],
        response_choices=_choices(allowed[j], constraint, tokenizer, out.tokens[j])
        if allowed else None, **hiper_fields)
  return rows


def episode_metrics(rows: Sequence[StepRow], won, returns, lengths,
                    task_types) -> dict[str, float]:
  """Success overall and per task type, return, invalid-action rate, episode length; for
  HiPER rows also `switch_rate` (parsed SWITCH among turns after the first, whose switch
  the estimator forces) and `subgoal_change_rate` (turns after the first whose parsed
  subgoal text differs from the previous turn's)."""
  m = {
      "success": float(np.mean(won)),
      "episode_return": float(np.mean(returns)),
      "episode_length": float(np.mean(lengths)),
      "invalid_rate": float(np.mean([not r.valid for r in rows])) if rows else 0.0,
      "num_rows": float(len(rows)),
  }
  if rows and rows[0].token_tags is not None:
    previous = {(r.traj, r.step): r.subgoal for r in rows}
    later = [r for r in rows if r.step > 0]
    m["switch_rate"] = float(np.mean([r.switch == hiper.SWITCH for r in later])) if later else 0.0
    m["subgoal_change_rate"] = (float(np.mean([r.subgoal != previous.get((r.traj, r.step - 1))
                                               for r in later])) if later else 0.0)
  by_type = collections.defaultdict(list)
  for i in range(len(won)):
    if task_types[i]:
      by_type[task_types[i]].append(won[i])
  for kind, values in sorted(by_type.items()):
    m[f"success/{kind}"] = float(np.mean(values))
  return m


def advantage_columns(rows: Sequence[StepRow]) -> dict[str, list]:
  """The columns `hgpo_jax.advantages.grouping.build_row_batch` reads (the row schema)."""
  return rows_lib.columns(rows)


# ---------------------------------------------------------------------------------------
# Dynamic sampling (DAPO's filter_groups): keep the groups whose trajectories differ
# ---------------------------------------------------------------------------------------
FILTER_METRICS = ("score", "success")
"""Episode quantities whose spread within a group decides whether it is kept: "score" the
undiscounted return (verl-agent's `filter_group_data`: episode rewards), "success" the
won flag."""


def varied_groups(ro: Rollout, group_size: int, metric: str) -> list[int]:
  """The groups of `ro` whose `metric` is not the same for every trajectory (in order).

  A group whose trajectories all score alike gets an episode advantage of 0 on every
  trajectory (GRPO, RLOO; GiGPO's and HGPO's episode term), so it carries no outcome signal.
  """
  if metric not in FILTER_METRICS:
    raise ValueError(f"filter metric {metric!r} is unknown; use one of {FILTER_METRICS}")
  values = np.asarray(ro.returns if metric == "score" else ro.won, np.float64)
  values_gn = values.reshape(-1, group_size)
  return [g for g in range(values_gn.shape[0]) if np.any(values_gn[g] != values_gn[g, 0])]


def dynamic_selection(rollouts: Sequence[Rollout], group_size: int, num_groups: int,
                      metric: str) -> tuple[list[tuple[int, int]], dict[str, float]]:
  """Which groups of the generation batches `rollouts` the update trains on.

  The varied groups (`varied_groups`) in generation order, the first `num_groups` of them;
  when fewer exist (the cap on generation batches was reached), the rest is filled with
  the last batch's uniform groups, in order, as verl-agent's last try keeps its whole
  batch: the update always sees `num_groups` groups (fixed shapes).

  Returns:
    ([(batch index, group index)] of the chosen groups, in order; statistics: groups_kept
    (varied groups chosen), groups_dropped (uniform groups generated and not trained on),
    groups_filled (uniform groups trained on), generation_batches, varied_surplus (varied
    groups generated beyond num_groups)).
  """
  varied = [(b, g) for b, ro in enumerate(rollouts) for g in varied_groups(ro, group_size, metric)]
  chosen = varied[:num_groups]
  last = len(rollouts) - 1
  varied_last = set(varied_groups(rollouts[last], group_size, metric))
  uniform_last = [g for g in range(rollouts[last].num_trajectories // group_size)
                  if g not in varied_last]
  filled = [(last, g) for g in uniform_last[:num_groups - len(chosen)]]
  total = sum(ro.num_trajectories // group_size for ro in rollouts)
  stats = {"groups_kept": float(len(chosen)), "groups_filled": float(len(filled)),
           "groups_dropped": float(total - len(varied) - len(filled)),
           "generation_batches": float(len(rollouts)),
           "varied_surplus": float(len(varied) - len(chosen))}
  # in generation order, as one rollout playing them all would lay them out
  return sorted(chosen + filled), stats


def select_groups(rollouts: Sequence[Rollout], picks: Sequence[tuple[int, int]],
                  group_size: int) -> Rollout:
  """One rollout of the groups `picks` ((batch index, group index) pairs) of `rollouts`,
  renumbered 0, 1, ... in the order given, trajectories `group * group_size + i`, as if
  one rollout had played them; timings and decode work are the batches' sums."""
  rows, won, returns, lengths, task_types = [], [], [], [], []
  for new, (b, g) in enumerate(picks):
    ro = rollouts[b]
    first = g * group_size
    for r in ro.rows:
      if r.group == g:
        rows.append(dataclasses.replace(r, group=new, traj=new * group_size + r.traj - first))
    trajs = slice(first, first + group_size)
    won.append(ro.won[trajs])
    returns.append(ro.returns[trajs])
    lengths.append(ro.lengths[trajs])
    task_types += ro.task_types[trajs]
  rows.sort(key=lambda r: (r.group, r.traj, r.step))
  timings = {k: float(sum(ro.timings[k] for ro in rollouts)) for k in rollouts[0].timings}
  work = tuple(int(sum(ro.decode_work[i] for ro in rollouts)) for i in range(2))
  return Rollout(rows=rows, won=np.concatenate(won), returns=np.concatenate(returns),
                 lengths=np.concatenate(lengths), task_types=task_types, timings=timings,
                 decode_work=work)
