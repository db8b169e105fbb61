"""Test doubles for `rollout.collect`: a character tokenizer, a scripted sampler, a scripted
env pool, and an in-process pool over a real env (`env_servers.serve.SlotServer`)."""

import numpy as np

from env_servers import base, serve
from hgpo_jax.sampling import SampleOutput


class CharTokenizer:
  """One token per character; the chat template is the bare user message."""

  eos_ids = (0,)

  def apply_chat_template(self, messages, add_generation_prompt=True):
    del add_generation_prompt
    return messages[0]["content"]

  def encode(self, text):
    return [ord(c) for c in text]

  def decode(self, ids, skip_special_tokens=True):
    del skip_special_tokens
    return "".join(chr(int(i)) for i in ids)


class ScriptedSampler:
  """Answers with the given responses in order and records each call's prompt texts."""

  def __init__(self, tok, responses):
    self.tok, self.responses, self.calls = tok, list(responses), []

  def generate(self, prompts, params, rng, allowed=None, **kwargs):
    del params, rng
    self.calls.append(([self.tok.decode(p) for p in prompts], allowed, kwargs))
    texts = [self.responses.pop(0) for _ in prompts]
    tokens = [self.tok.encode(t) for t in texts]
    return SampleOutput(
        tokens=tokens, logprobs=[np.zeros(len(t), np.float32) for t in tokens], texts=texts,
        stop_reason=["stop_string"] * len(texts))


class ScriptedPool:
  """Slot i walks through episodes[i] = [(observation, admissible, reward, done), ...]."""

  def __init__(self, episodes):
    self.episodes = episodes
    self.pos = [0] * len(episodes)
    self.actions = []

  def _result(self, slot):
    obs, admissible, reward, done = self.episodes[slot][self.pos[slot]]
    return base.StepResult(observation=obs, anchor_obs=obs, admissible_actions=list(admissible),
                           reward=reward, done=done, won=reward > 0, info={})

  def reset(self, task_ids, seeds, split):
    del task_ids, seeds, split
    self.pos = [0] * len(self.episodes)
    return [self._result(i) for i in range(len(self.episodes))]

  def step(self, actions):
    self.actions.append(list(actions))
    out = []
    for i, action in enumerate(actions):
      if action is None:
        out.append(None)
        continue
      self.pos[i] += 1
      out.append(self._result(i))
    return out


class LocalPool:
  """`EnvPool`'s reset/step over an in-process `SlotServer`; logs (action, result) pairs."""

  def __init__(self, env_name, num_slots, **env_args):
    self.core = serve.SlotServer(env_name, num_slots, env_args)
    self.num_slots = num_slots
    self.log = []

  def reset(self, task_ids, seeds, split):
    return self.core.reset(list(range(self.num_slots)), list(task_ids), list(seeds), split)

  def step(self, actions):
    slots = [i for i, a in enumerate(actions) if a is not None]
    results = self.core.step(slots, [actions[i] for i in slots])
    out = [None] * self.num_slots
    for i, r in zip(slots, results):
      out[i] = r
      self.log.append((actions[i], r))
    return out
