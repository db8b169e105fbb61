"""WebShopEnv: the WebShop-compatible text environment an env server hosts.

  env = WebShopEnv()                           # frozen generated shop, 15 steps
  env = WebShopEnv(max_steps="30")             # HGPO's horizon (strings are parsed)
  env = WebShopEnv(data_dir="DIR")             # a shop written by `generate`
  env = WebShopEnv(real_data_dir="DIR")        # the original WebShop files (real_data)
  env = WebShopEnv(data_dir="env_servers/webshop/data/mini_v6", search_actions="goal")
                                               # WebShop-mini of the CPU suite
  obs, info = env.reset(seed=0, options={"task_id": "test-0003"})
  obs, reward, terminated, truncated, info = env.step("search[sulfate free shampoo]")

Actions are WebShop's: `search[keywords]` (only on the search page, non-empty) and
`click[name]` with `name` one of the page's clickables (case-insensitive, as WebShop
lower-cases the argument). Anything else (unknown verb, unbalanced brackets, empty
search, the listed template `search[<your query>]` itself, a click on a name not on the
page, a string longer than MAX_TEXT_CHARS) is an invalid action: the page does not
change, the step still counts towards `max_steps`, and info["action_valid"] is False.

An episode ends with `Buy Now` (terminated) or after `max_steps` steps (truncated).
Reward: 10 on the `Buy Now` step if the task score is exactly 1, else 0 (the papers'
WebShop wrapper); the score in [0, 1] is info["score"] (0 until a purchase) and
info["won"] = score == 1. info["anchor_obs"] is the page text after the instruction,
each part quoted (`pages.anchor_observation`), info["admissible_actions"] lists
"search[<your query>]" on the search page and "click[<name>]" for every clickable,
info["task_type"] is the goal's product category.

`search_actions` says what the search page lists:
  "template"  WebShop's `search[<your query>]`: the agent writes its own query (default;
              the papers' setting).
  "goal"      one concrete search, `search[<goal attributes> <product type>]` (`goal_query`),
              the keywords a shopper reading the instruction would type. For policies that
              cannot yet write queries (the random-init policy of the CPU suite: with the
              template it never leaves the search page); a typed query is still accepted.

`python -m env_servers.webshop.env --random-play N` measures uniform-random play over the
admissible actions and a scripted "listed search, first result, Buy Now" baseline
(`random_play`), the calibration numbers of a shop.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import re
from typing import Any

import gymnasium as gym

from env_servers.base import ADMISSIBLE, ANCHOR_OBS, MAX_TEXT_CHARS, SCORE, TASK_TYPE, WON
from env_servers.webshop import pages, reward
from env_servers.webshop.dataset import Shop

SEARCH_PLACEHOLDER = "<your query>"
SEARCH_TEMPLATE = f"search[{SEARCH_PLACEHOLDER}]"
WIN_REWARD = 10.0
ACTION_VALID = "action_valid"

SEARCH_ACTIONS = ("template", "goal")

_ACTION = re.compile(r"(search|click)\[(.*)\]", re.DOTALL)


def goal_query(goal: dict[str, Any]) -> str:
  """The search a shopper reading the goal types: its attributes, then its product type."""
  return " ".join([*goal["attributes"], goal["product_type"]])


def _optional_str(value: Any) -> str | None:
  if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
    return None
  return str(value)


@functools.lru_cache(maxsize=8)
def load_shop(data_dir: str | None, real_data_dir: str | None, num_test_goals: int) -> Shop:
  """The shop for these arguments, built once per process and shared by all env slots."""
  if data_dir and real_data_dir:
    raise ValueError("give WebShopEnv either data_dir (a generated shop) or real_data_dir "
                     "(the original WebShop files), not both")
  if real_data_dir:
    from env_servers.webshop import real_data
    return real_data.load_real_shop(real_data_dir, num_test_goals=num_test_goals)
  return Shop.load(data_dir)


class WebShopEnv(gym.Env):
  """WebShop's text mode over a generated (or the real) catalog; see the module docstring."""

  metadata = {"render_modes": []}

  def __init__(self, data_dir: str | None = None, real_data_dir: str | None = None,
               max_steps: int | str = 15, num_test_goals: int | str = 500,
               search_actions: str = "template"):
    try:
      self.max_steps = int(max_steps)
      num_test_goals = int(num_test_goals)
    except ValueError as e:
      raise ValueError(f"WebShopEnv: max_steps and num_test_goals must be integers ({e})") from e
    if self.max_steps < 1:
      raise ValueError(f"WebShopEnv: max_steps must be >= 1, got {self.max_steps}")
    if search_actions not in SEARCH_ACTIONS:
      raise ValueError(f"WebShopEnv: search_actions must be one of {SEARCH_ACTIONS}, "
                       f"got {search_actions!r}")
    self.search_actions = search_actions
    self.shop = load_shop(_optional_str(data_dir), _optional_str(real_data_dir), num_test_goals)
    self.goal: dict[str, Any] | None = None
    self._browser: pages.Browser | None = None
    self._steps = 0
    self._over = False

  def splits(self) -> list[str]:
    """Names of the goal splits this shop has."""
    return sorted(self.shop.split_ids)

  def task_ids(self, split: str) -> list[str]:
    """Goal ids of `split`, in a fixed order."""
    if split not in self.shop.split_ids:
      raise ValueError(f"unknown WebShop split {split!r}; this shop has {self.splits()}")
    return list(self.shop.split_ids[split])

  def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
    """Starts the goal `options["task_id"]` (else one drawn from `options["split"]`)."""
    super().reset(seed=seed)
    options = options or {}
    task_id = options.get("task_id")
    if task_id is None:
      ids = self.task_ids(options.get("split", "train"))
      task_id = ids[int(self.np_random.integers(len(ids)))]
    if task_id not in self.shop.goals:
      raise ValueError(f"unknown WebShop task id {task_id!r}; list them with "
                       f"task_ids(split) for a split in {self.splits()}")
    self.goal = self.shop.goals[task_id]
    self._browser = pages.Browser(self.shop, self.goal["instruction_text"], task_id)
    self._steps, self._over = 0, False
    return self._observe(valid=True, score=0.0)

  def step(self, action: str):
    """One WebShop action; returns (obs, reward, terminated, truncated, info)."""
    if self._browser is None:
      raise RuntimeError("WebShopEnv.step() before reset(): call reset() first")
    if self._over:
      raise RuntimeError("WebShopEnv.step() after the episode ended: call reset() first")
    self._steps += 1
    valid, bought = self._apply(action)
    score, extra = 0.0, {}
    if bought:
      product = self.shop.by_asin[self._browser.asin]
      result = reward.task_score(product, self.goal, product["price"], self._browser.options)
      score = result.score
      self._browser.finish(score)
      extra = {"purchased_asin": product["asin"],
               "purchased_options": json.dumps(self._browser.options, sort_keys=True),
               "reward_info": result.as_info()}
    terminated = bought
    truncated = not terminated and self._steps >= self.max_steps
    self._over = terminated or truncated
    obs, info = self._observe(valid=valid, score=score)
    info.update(extra)
    return obs, WIN_REWARD if score == 1.0 else 0.0, terminated, truncated, info

  def _apply(self, action: Any) -> tuple[bool, bool]:
    """Executes `action` if valid: (valid, bought)."""
    if not isinstance(action, str) or len(action) > MAX_TEXT_CHARS:
      return False, False
    match = _ACTION.fullmatch(action.strip())
    if match is None:
      return False, False
    verb, arg = match.group(1), match.group(2).strip().lower()
    browser = self._browser
    if verb == "search":
      # The listed template `search[<your query>]` is not a query: refused like an empty one.
      if not arg or not browser.has_search_bar or arg == SEARCH_PLACEHOLDER:
        return False, False
      browser.search(arg)
      return True, False
    if arg not in browser.clickables():
      return False, False
    return True, browser.click(arg)

  def _observe(self, valid: bool, score: float) -> tuple[str, dict[str, Any]]:
    browser = self._browser
    obs = browser.render()[:MAX_TEXT_CHARS]
    search = (SEARCH_TEMPLATE if self.search_actions == "template"
              else f"search[{goal_query(self.goal)}]")
    actions = [search] if browser.has_search_bar and not self._over else []
    if not self._over:
      actions += [f"click[{c}]" for c in browser.clickables()]
    info = {
        ANCHOR_OBS: pages.anchor_observation(obs, self.goal["instruction_text"]),
        ADMISSIBLE: actions,
        WON: score == 1.0,
        SCORE: score,
        TASK_TYPE: self.goal["category"],
        ACTION_VALID: valid,
        "task_id": self.goal["task_id"],
        "page": browser.page,
        "steps": self._steps,
    }
    return obs, info


def random_play(env: WebShopEnv, split: str, episodes_per_goal: int = 1) -> dict[str, float]:
  """Calibration of a shop on `split`: success rates (won = score 1) of

    random: uniform-random play over the admissible actions until the horizon (each
      episode's generator seeded by its goal and index, so the numbers are reproducible);
    first_result: the scripted policy "the listed search, the first result, Buy Now".
  """
  wins, first = 0, 0
  ids = env.task_ids(split)
  for task_id in ids:
    for episode in range(episodes_per_goal):
      rng = random.Random(f"random-play/{task_id}/{episode}")
      _, info = env.reset(seed=0, options={"task_id": task_id})
      done = False
      while not done:
        _, _, terminated, truncated, info = env.step(rng.choice(info[ADMISSIBLE]))
        done = terminated or truncated
      wins += bool(info[WON])
    env.reset(seed=0, options={"task_id": task_id})
    env.step(f"search[{goal_query(env.goal)}]")
    results = env._browser.results
    if results:
      env.step(f"click[{results[0].lower()}]")
      _, _, _, _, info = env.step(f"click[{pages.BUY_NOW}]")
      first += bool(info[WON])
  return {"random": wins / (len(ids) * episodes_per_goal), "first_result": first / len(ids)}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description="WebShop-compatible env: calibration by "
                                   "uniform-random play (see random_play)")
  parser.add_argument("--random-play", type=int, required=True, metavar="EPISODES",
                      help="random episodes per goal")
  parser.add_argument("--data-dir", default="", help="a generated shop (default: the frozen one)")
  parser.add_argument("--split", default="train")
  parser.add_argument("--max-steps", type=int, default=15)
  parser.add_argument("--search-actions", default="template", choices=SEARCH_ACTIONS)
  args = parser.parse_args(argv)
  env = WebShopEnv(data_dir=args.data_dir, max_steps=args.max_steps,
                   search_actions=args.search_actions)
  rates = random_play(env, args.split, args.random_play)
  n = len(env.task_ids(args.split))
  print(f"{args.split}: {n} goals, horizon {args.max_steps}, search {args.search_actions}: "
        f"uniform-random play {100 * rates['random']:.1f} % won ({args.random_play} episodes "
        f"per goal), listed search + first result + Buy Now {100 * rates['first_result']:.1f} %")


if __name__ == "__main__":
  main()
