r"""What the model sees: the token lengths of a config's per-step prompts, and what left
truncation to `rollout.max_prompt_tokens` keeps of them.

  python -m launch.inspect_prompts --config=configs/alfworld.py:model=smollm2-135m \
      [--config.rollout.max_prompt_tokens=400 ...] [--split valid_unseen] [--tasks 48] \
      [--show 3] [--choices]

Plays uniform-random episodes (one per task, seeded by the task id) of the config's
environment in this process, with the config's env arguments and horizon, renders every
step's prompt as the rollout does (`hgpo_jax.rollout.prompts.render_prompt`, the memory
window `rollout.history_length`) and encodes it as the sampler is given it (the model's
chat template, `rollout.encode_prompt`). It prints the length distribution in the
model's tokens and, at the config's `max_prompt_tokens`, the fraction of prompts that
are cut, that lose the task sentence, and that lose an admissible action. `--show N`
prints the kept text of the N longest prompts. `--choices` also runs the model on every
played action as the constrained sampler writes it: the share of its tokens the trie
forces, and at the others the model's probability on the allowed tokens (the sets that
`train.constrained_logprobs` scores over). The react response format only (the
HiPER prompt is `hgpo_jax.rollout.hiper.render_prompt`'s).

Bad input (a config that does not load, an unknown split) is one line and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from typing import Any, Sequence

PROG = "launch.inspect_prompts"


class BadInput(ValueError):
  """A user error: one line and exit code 2."""


@dataclasses.dataclass(frozen=True)
class StepResult:
  """An in-process env step in the shape the rollout reads from a server's reply."""

  observation: str
  anchor_obs: str
  info: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class PromptStats:
  """Per-step prompts of random play (lengths in the model's tokens)."""

  lengths: tuple[int, ...]
  cut: int  # prompts longer than max_tokens
  task_lost: int  # cut prompts whose kept tokens no longer hold the task sentence
  action_lost: int  # cut prompts whose kept tokens miss an admissible action
  longest: tuple[tuple[int, str], ...]  # (length, kept text), longest first


def random_play_steps(env, env_name: str, tokenizer, task_ids: Sequence[str], *,
                      max_steps: int, history_length: int, history_drop_chars: int = 0,
                      format_instructions: bool = True):
  """Plays one uniform-random episode per task (seeded by its id); yields every step as
  (the task sentence, the prompt's ids untruncated, the admissible actions, the action
  played). The prompt options are `rollout.history_drop_chars` and `.format_instructions`."""
  from hgpo_jax.rollout import prompts
  from hgpo_jax.rollout import rollout as rollout_lib

  for task_id in task_ids:
    rng = random.Random(task_id)
    obs, info = env.reset(options={"task_id": task_id})
    result = StepResult(obs, info.get("anchor_obs", obs), info)
    memory = prompts.EpisodeMemory(rollout_lib.task_description(env_name, result))
    for _ in range(max_steps):
      admissible = [a for a in result.info["admissible_actions"] if a != "help"]
      shown = prompts.observation_text(env_name, result)
      text = prompts.render_prompt(env_name, memory, shown, admissible, history_length,
                                   history_drop_chars, format_instructions)
      action = rng.choice(admissible)
      yield memory.task, rollout_lib.encode_prompt(tokenizer, text, 10**9), admissible, action
      obs, _, terminated, truncated, info = env.step(action)
      result = StepResult(obs, info.get("anchor_obs", obs), info)
      memory.add(prompts.memory_observation(env_name, shown, result), action)
      if terminated or truncated:
        break


def random_play_prompts(env, env_name: str, tokenizer, task_ids: Sequence[str], *,
                        max_steps: int, history_length: int, max_tokens: int,
                        keep_longest: int = 0, **prompt_options) -> PromptStats:
  """Plays one uniform-random episode per task (seeded by its id) and measures every
  step's prompt as the sampler receives it."""
  lengths, cut, task_lost, action_lost, texts = [], 0, 0, 0, []
  for task, ids, admissible, _ in random_play_steps(
      env, env_name, tokenizer, task_ids, max_steps=max_steps, history_length=history_length,
      **prompt_options):
    lengths.append(len(ids))
    if len(ids) > max_tokens:
      cut += 1
      kept = tokenizer.decode(ids[-max_tokens:])
      task_lost += task not in kept
      action_lost += any(f"'{a}'" not in kept for a in admissible)
    if keep_longest:
      texts.append((len(ids), tokenizer.decode(ids[-max_tokens:])))
  texts.sort(key=lambda t: -t[0])
  return PromptStats(tuple(lengths), cut, task_lost, action_lost, tuple(texts[:keep_longest]))


@dataclasses.dataclass(frozen=True)
class ChoiceStats:
  """The constraint's view of random admissible actions (`constraint_choices`)."""

  forced: int  # response tokens the trie forces (one allowed id)
  mass: tuple[float, ...]  # per token with a choice: the model's probability on the allowed ids


def constraint_choices(model, tokenizer, steps, max_tokens: int) -> ChoiceStats:
  """Each step's action as the constrained sampler writes it (`<action>a</action>`),
  teacher-forced after the step's prompt (its last `max_tokens` ids): which tokens the
  trie forces, and at the others how much of the model's full softmax falls on the
  tokens it allows (`constrained.response_choices`: the sets the learner's constrained
  log-probs run over, docs/algorithms.md §9.8)."""
  import jax
  import numpy as np

  from hgpo_jax.sampling import constrained

  @jax.jit
  def logprobs(tokens, positions, segments):
    hidden, _ = model.hidden(tokens, positions, segments)
    return jax.nn.log_softmax(model.logits(hidden).astype("float32"), axis=-1)

  forced, mass = 0, []
  for _, ids, admissible, action in steps:
    sequences = constrained.constrained_token_sequences(
        admissible, constrained.ActionConstraint(), tokenizer.encode)
    response = sequences[admissible.index(action)]
    choices = constrained.response_choices(sequences, response, tokenizer.eos_ids)
    row = list(ids[-max_tokens:]) + list(response)
    width = -(-len(row) // 64) * 64  # a few compiled shapes
    pad = width - len(row)
    logp = np.asarray(logprobs(
        np.asarray([row + [0] * pad], np.int32),
        np.asarray([list(range(len(row))) + [0] * pad], np.int32),
        np.asarray([[1] * len(row) + [0] * pad], np.int32)))[0]
    first = len(row) - len(response)
    for j, allowed in enumerate(choices):
      if len(allowed) == 1:
        forced += 1
      else:
        mass.append(float(np.exp(logp[first + j - 1, list(allowed)]).sum()))
  return ChoiceStats(forced, tuple(mass))


def choice_report(stats: ChoiceStats) -> str:
  total = stats.forced + len(stats.mass)
  s = sorted(stats.mass)
  line = (f"constraint: {total} response tokens of the played actions, {stats.forced} forced "
          f"({100 * stats.forced / max(total, 1):.1f} %), {len(s)} with a choice")
  if s:
    line += (f"; the model's probability on the allowed tokens there: mean "
             f"{sum(s) / len(s):.3f}, p10 {_percentile(s, 0.1):.3f}, p50 {_percentile(s, 0.5):.3f}, "
             f"p90 {_percentile(s, 0.9):.3f}")
  return line


def _percentile(sorted_values: Sequence[int], q: float) -> int:
  return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def report(stats: PromptStats, max_tokens: int) -> str:
  n = len(stats.lengths)
  s = sorted(stats.lengths)
  lines = [f"{n} prompts: mean {sum(s) / n:.1f}, p50 {_percentile(s, 0.5)}, "
           f"p95 {_percentile(s, 0.95)}, max {s[-1]} tokens",
           f"at max_prompt_tokens={max_tokens}: {stats.cut} cut ({100 * stats.cut / n:.1f} %), "
           f"{stats.task_lost} without the task sentence, {stats.action_lost} missing an "
           "admissible action"]
  for length, text in stats.longest:
    lines += ["", f"--- a prompt of {length} tokens, as kept ({min(length, max_tokens)}):", text]
  return "\n".join(lines)


def inspect(config, split: str | None, tasks: int, show: int, choices: bool = False) -> str:
  """The report of `config`'s prompts on `split`'s first `tasks` tasks (with `choices`,
  also `choice_report`'s line)."""
  from env_servers import registry
  from hgpo_jax.models import loading

  if config.rollout.response_format != "react":
    raise BadInput(f"rollout.response_format={config.rollout.response_format!r}: this tool "
                   "renders the react prompt only")
  args = dict(config.env.args.to_dict())
  args.setdefault("max_steps", config.env.max_steps)
  env = registry.make_env(config.env.name, **args)
  try:
    split = split or (config.env.eval_splits[-1] if config.env.eval_splits
                      else config.env.train_split)
    if split not in env.splits():
      raise BadInput(f"--split {split!r}: the env has splits {env.splits()}")
    ids = env.task_ids(split)[:tasks]
    model, tokenizer, _ = loading.load_model(config.model.name, path=config.model.path or None)
    play = dict(max_steps=config.env.max_steps, history_length=config.rollout.history_length,
                history_drop_chars=config.rollout.history_drop_chars,
                format_instructions=config.rollout.format_instructions)
    stats = random_play_prompts(env, config.env.name, tokenizer, ids, **play,
                                max_tokens=config.rollout.max_prompt_tokens, keep_longest=show)
    extra = ""
    if choices:
      steps = random_play_steps(env, config.env.name, tokenizer, ids, **play)
      extra = "\n" + choice_report(constraint_choices(model, tokenizer, steps,
                                                      config.rollout.max_prompt_tokens))
  finally:
    env.close()
  return (f"{config.env.name} {split}, {config.model.name}, H={config.rollout.history_length}, "
          f"uniform-random play, {len(ids)} tasks\n" + report(stats, config.rollout.max_prompt_tokens)
          + extra)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n", 1)[0])
  parser.add_argument("--config", required=True, help="config file[:variant args]")
  parser.add_argument("--split", default=None, help="task split to play (default: the "
                      "config's last eval split, else its train split)")
  parser.add_argument("--tasks", type=int, default=48, help="tasks of the split (the first N)")
  parser.add_argument("--show", type=int, default=0,
                      help="print the kept text of the N longest prompts")
  parser.add_argument("--choices", action="store_true",
                      help="also run the model on each played action: the tokens the "
                      "constraint forces, and its probability on the allowed ones elsewhere")
  overrides = [a for a in argv if a.startswith("--config.")]
  args = parser.parse_args([a for a in argv if not a.startswith("--config.")])
  from configs import common
  try:
    config = common.load(args.config, overrides)
    print(inspect(config, args.split, args.tasks, args.show, args.choices))
  except (BadInput, common.ConfigLoadError, ValueError, KeyError, OSError) as e:
    print(f"{PROG}: error: {e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
