"""WebShop's task score for a purchase (web_agent_site/engine/goal.py::get_reward).

  score = (attr_hits + option_hits + price_ok) / (n_goal_attrs + n_goal_options + 1) * r_type

* attr_hits: goal attributes that fuzzy-match one of the product's `Attributes`
  (`token_set_ratio > 85`), or failing that occur as a substring of the product's
  title, bullet points or description.
* option_hits: purchased options (one per option group chosen on the item page) that
  match a goal option: exactly for the group "size", fuzzily otherwise, both after
  WebShop's `normalize_color`; failing that, a purchased value that occurs in the
  product text also counts (WebShop's fallback, kept for fidelity).
* price_ok: product price <= goal price upper bound.
* r_type in {0, 0.1, 0.5, 1}: 1 if the search query matches, or >= 2 levels of the
  category path are shared, or title_score > 0.2; else 0.5; then 0.1 if
  title_score < 0.1 and 0 if title_score == 0.
  title_score = |type tokens of product ∩ type tokens of goal| / |type tokens of goal|.
  WebShop takes the type tokens as the nouns spaCy's `en_core_web_lg` finds in the
  product names (a model that is not on PyPI); the generated catalog states each
  product's type explicitly, so its tokens are used instead. Real WebShop data has no
  explicit type: there the content words of the name stand in for spaCy's nouns.

Fuzzy matching reproduces `thefuzz.fuzz.token_set_ratio` (which WebShop calls) with
`rapidfuzz`: default processing (lowercase, non-alphanumerics to spaces) and the score
rounded to an integer before the `> 85` test.

The environment turns the score into the papers' reward: 10 if score == 1 else 0.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

from rapidfuzz import fuzz
from rapidfuzz import utils as fuzz_utils

FUZZY_THRESHOLD = 85
EXACT_MATCH_OPTIONS = ("size",)

_WORD = re.compile(r"[a-z][a-z'-]+")
# Words that are never product nouns; used only for real WebShop data (no explicit type).
_NON_NOUNS = frozenset(
    "a an and by for from in of on or the to with without pack set count oz fl ounce ounces "
    "inch inches size color new men women mens womens kids".split())


# The color words of the generated catalog's option values, with WebShop's normalisation
# rule (`normalize_color`: the first listed color word contained in the value replaces
# it). Kept in alphabetical order.
COLOR_WORDS = ("beige", "berry", "black", "blue", "burgundy", "caramel", "coral", "espresso",
               "gold", "green", "grey", "honey", "ivory", "khaki", "mauve", "navy", "oak",
               "olive", "pink", "plum", "porcelain", "red", "silver", "teal", "walnut", "white")


def normalize_color(value: str) -> str:
  """WebShop's `normalize_color`: the first color word contained in `value`, else `value`."""
  for color in COLOR_WORDS:
    if color in value:
      return color
  return value


def fuzzy_score(a: str, b: str) -> int:
  """thefuzz-compatible `token_set_ratio`: processed strings, integer 0..100."""
  a, b = fuzz_utils.default_process(a), fuzz_utils.default_process(b)
  if not a or not b:
    return 0
  return int(round(fuzz.token_set_ratio(a, b)))


def fuzzy_match(a: str, b: str) -> bool:
  """WebShop's fuzzy equality: token_set_ratio > 85."""
  return fuzzy_score(a, b) > FUZZY_THRESHOLD


def product_text(product: Mapping[str, Any]) -> tuple[str, str, str]:
  """Lower-cased (title, bullet points, description): where WebShop's fallbacks look."""
  return (product["Title"].lower(), " ".join(product["BulletPoints"]).lower(),
          product["Description"].lower())


def mentions(product: Mapping[str, Any], phrase: str) -> bool:
  """True if `phrase` occurs in the title, bullet points or description (WebShop's test)."""
  return any(phrase in part for part in product_text(product))


def type_tokens(item: Mapping[str, Any]) -> list[str]:
  """Type words of a product or goal: its explicit `product_type`, else the name's nouns."""
  ptype = item.get("product_type")
  if ptype:
    return ptype.lower().split()
  return [w for w in _WORD.findall(item["name"].lower()) if w not in _NON_NOUNS]


@dataclasses.dataclass(frozen=True)
class TypeReward:
  r_type: float
  query_match: bool
  category_match: bool
  title_score: float


def type_reward(product: Mapping[str, Any], goal: Mapping[str, Any]) -> TypeReward:
  """goal.py::get_type_reward with explicit type tokens in place of spaCy nouns."""
  query_match = product["query"] == goal["query"]
  p_levels = {x.strip() for x in product["product_category"].split("›")}
  g_levels = {x.strip() for x in goal["product_category"].split("›")}
  category_match = len(p_levels & g_levels) >= 2
  desired = type_tokens(goal)
  if not desired:
    title_score = 0.2  # WebShop's value when the goal name has no noun.
  else:
    title_score = len(set(type_tokens(product)) & set(desired)) / len(set(desired))
  r_type = 1.0 if (query_match or category_match or title_score > 0.2) else 0.5
  if title_score < 0.1:
    r_type = 0.1
  if title_score == 0.0:
    r_type = 0.0
  return TypeReward(r_type, query_match, category_match, title_score)


def attribute_matches(product: Mapping[str, Any], goal_attributes: Sequence[str]) -> int:
  """Number of goal attributes the product has (fuzzy) or mentions (substring)."""
  hits = 0
  for g_attr in goal_attributes:
    if any(fuzzy_match(p_attr, g_attr) for p_attr in product["Attributes"]):
      hits += 1
    elif mentions(product, g_attr):
      hits += 1
  return hits


def goal_option_values(goal: Mapping[str, Any]) -> list[str]:
  """Goal options as a list of values (synthetic goals: dict; human goals: list)."""
  opts = goal["goal_options"]
  return list(opts.values()) if isinstance(opts, Mapping) else list(opts)


def option_matches(product: Mapping[str, Any], goal_options: Sequence[str],
                   purchased: Mapping[str, str]) -> int:
  """Number of purchased options that match a goal option (goal.py::get_option_reward)."""
  goal_norm = [normalize_color(o) for o in goal_options]
  hits = 0
  for group, value in purchased.items():
    value = normalize_color(value)
    if group.lower() in EXACT_MATCH_OPTIONS:
      matched = value in goal_norm
    else:
      matched = any(fuzzy_match(g, value) for g in goal_norm)
    if matched or mentions(product, value):
      hits += 1
  return hits


@dataclasses.dataclass(frozen=True)
class Score:
  """A purchase's task score and the terms it is made of."""

  score: float
  r_type: float
  attr_hits: int
  option_hits: int
  price_ok: bool
  num_attrs: int
  num_options: int
  title_score: float

  def as_info(self) -> dict[str, float]:
    """Flat float terms for logging (info["reward_info"])."""
    return {"r_type": self.r_type, "r_att": self.attr_hits / max(1, self.num_attrs),
            "r_option": self.option_hits / max(1, self.num_options),
            "r_price": float(self.price_ok), "title_score": self.title_score}


def task_score(product: Mapping[str, Any], goal: Mapping[str, Any], price: float,
               purchased_options: Mapping[str, str]) -> Score:
  """WebShop's get_reward(): the task score in [0, 1] of buying `product` at `price`."""
  t = type_reward(product, goal)
  goal_options = goal_option_values(goal)
  price_ok = price <= goal["price_upper"]
  attr_hits = attribute_matches(product, goal["attributes"])
  option_hits = option_matches(product, goal_options, purchased_options)
  n_attrs, n_opts = len(goal["attributes"]), len(goal_options)
  total = (attr_hits + option_hits + int(price_ok)) / (n_attrs + n_opts + 1) * t.r_type
  return Score(total, t.r_type, attr_hits, option_hits, price_ok, n_attrs, n_opts,
               t.title_score)


def failed_terms(score: Score) -> list[str]:
  """Which reward terms fell short: a subset of ["attribute", "option", "price", "type"]."""
  failed = []
  if score.attr_hits < score.num_attrs:
    failed.append("attribute")
  if score.option_hits < score.num_options:
    failed.append("option")
  if not score.price_ok:
    failed.append("price")
  if score.r_type < 1.0:
    failed.append("type")
  return failed
