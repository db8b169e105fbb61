"""Seeded product generator: WebShop-format product records from `vocabulary`.

A product is a dict with WebShop's own keys, so the reward, the pages and the loader for
real WebShop files all read one shape:

  asin             str   "B0" + 8 upper-case alphanumerics
  name, Title      str   product title (WebShop keeps both)
  category         str   top-level category, one of vocabulary.CATEGORIES
  query            str   the search query the product was scraped under
  product_category str   category path, levels joined by " › "
  product_type     str   explicit type (replaces spaCy nouns in the type reward);
                         absent for real WebShop data
  Attributes       list[str]
  BulletPoints     list[str]  ("Features" page)
  Description      str
  options          dict[str, list[str]]  option group -> values offered
  brand            str
  price            float dollars; Price: str tag "$12.99"
  Rating           str   "4.3" or "N.A."
  Reviews          list[dict(title, score, body)]

Text is generated so that WebShop's substring fallbacks cannot fire by accident: a
product's title, bullet points and description never contain an attribute of its type
it does not have, nor any option value of its type (`text_conflicts`).

Near-miss distractors (`near_miss`) copy a goal's product and break exactly one term of
the reward: one goal attribute, one goal option value, the price bound, or the product
type (a sibling type with no word in common, so the type factor is 0).
"""

from __future__ import annotations

import math
import random
import string
from typing import Any, Iterable, Mapping

from env_servers.webshop import reward
from env_servers.webshop.vocabulary import (BRANDS, PRODUCT_TYPES, TITLE_ADJECTIVES,
                                            TITLE_FORMATS, TYPES_BY_NAME, ProductType)

NEAR_MISS_KINDS = ("attribute", "option", "price", "type")

_ASIN_CHARS = string.ascii_uppercase + string.digits
_BULLET_FORMATS = ("{A}: designed to be {a} for everyday use.",
                   "{A} - a detail customers ask for, built in.",
                   "{A}. Made to the same standard as every {noun} we sell.")
_GENERIC_BULLETS = ("Satisfaction guaranteed: contact us with any question.",
                    "Ships in recyclable packaging.",
                    "Backed by our customer care team.",
                    "Thoughtfully designed and quality checked.")
_REVIEW_TITLES = ("Great value", "Does the job", "Would buy again", "Not what I expected",
                  "Five stars", "Okay for the price", "Exceeded expectations")
_REVIEW_BODIES = ("I use this {noun} every day and it holds up.",
                  "Arrived quickly; the {noun} looks like the pictures.",
                  "Decent {noun}, but the packaging was damaged.",
                  "Bought a second one for a friend.")


def new_asin(rng: random.Random, taken: set[str]) -> str:
  """A fresh WebShop-style product id, not in `taken` (which it joins)."""
  while True:
    asin = "B0" + "".join(rng.choice(_ASIN_CHARS) for _ in range(8))
    if asin not in taken:
      taken.add(asin)
      return asin


def sample_price(rng: random.Random, ptype: ProductType) -> float:
  """Log-normal around the type's median, as a retail price ending in .99/.95/.49."""
  raw = ptype.price_median * math.exp(ptype.price_sigma * rng.gauss(0.0, 1.0))
  return round(max(1, int(raw)) - 1 + rng.choice((0.99, 0.99, 0.95, 0.49)), 2)


def _sample_options(rng: random.Random, ptype: ProductType,
                    max_groups: int | None = None) -> dict[str, list[str]]:
  """A subset of each of the type's option groups (the first `max_groups` groups only)."""
  options = {}
  for group, values in ptype.options[:max_groups]:
    k = rng.randint(min(2, len(values)), len(values))
    keep = set(rng.sample(range(len(values)), k))
    options[group] = [v for i, v in enumerate(values) if i in keep]
  return options


def text_conflicts(product: Mapping[str, Any], forbidden: Iterable[str]) -> list[str]:
  """Phrases in `forbidden` the product's text mentions (must be empty)."""
  return [p for p in forbidden if reward.mentions(product, p)]


def forbidden_phrases(product: Mapping[str, Any], ptype: ProductType,
                      extra: Iterable[str] = ()) -> list[str]:
  """Attributes it lacks and option values: what the product text must not contain."""
  own = product["Attributes"]
  # A phrase inside one of the product's own attributes cannot be avoided (and is true).
  phrases = [a for a in list(ptype.attributes) + list(extra)
             if not any(a in mine for mine in own)]
  values = [v for _, vals in ptype.options for v in vals]
  values += [v for vals in product["options"].values() for v in vals]
  # The option fallback tests the color-normalised value ("sky blue" -> "blue").
  phrases += values + [reward.normalize_color(v) for v in values]
  return sorted(set(phrases))


def _write_text(rng: random.Random, product: dict[str, Any], ptype: ProductType,
                brand: str) -> None:
  attrs = product["Attributes"]
  noun = rng.choice(ptype.nouns)
  fmt = rng.choice(TITLE_FORMATS)
  title = fmt.format(brand=brand, adj=rng.choice(TITLE_ADJECTIVES).title(), noun=noun.title(),
                     a1=attrs[0].title(), a2=attrs[1 % len(attrs)].title())
  title = title[0].upper() + title[1:]
  bullets = [rng.choice(_BULLET_FORMATS).format(A=a.upper(), a=a, noun=ptype.nouns[0])
             for a in attrs]
  bullets += rng.sample(_GENERIC_BULLETS, 2)
  description = (f"The {brand} {noun} is {', '.join(attrs[:-1])}"
                 f"{' and ' if len(attrs) > 1 else ''}{attrs[-1]}. "
                 f"{rng.choice(_GENERIC_BULLETS)}")
  product.update(name=title, Title=title, BulletPoints=bullets, Description=description)


def make_product(rng: random.Random, ptype: ProductType, asin: str, *, brand: str | None = None,
                 attributes: list[str] | None = None,
                 options: dict[str, list[str]] | None = None, price: float | None = None,
                 extra_forbidden: Iterable[str] = (),
                 max_option_groups: int | None = None) -> dict[str, Any]:
  """One product of type `ptype`; given fields are kept, the rest sampled from `rng`
  (sampled options: at most `max_option_groups` groups, None = all of the type's)."""
  brand = brand or rng.choice(BRANDS)
  if attributes is None:
    attributes = rng.sample(list(ptype.attributes), rng.randint(3, min(5, len(ptype.attributes))))
  price = sample_price(rng, ptype) if price is None else price
  reviews = [{"title": rng.choice(_REVIEW_TITLES), "score": rng.randint(1, 5),
              "body": rng.choice(_REVIEW_BODIES).format(noun=ptype.nouns[0])}
             for _ in range(rng.choice((0, 0, 1, 2, 3)))]
  rating = (f"{sum(r['score'] for r in reviews) / len(reviews):.1f}" if reviews else "N.A.")
  product = {
      "asin": asin, "brand": brand, "category": ptype.category, "query": ptype.query,
      "product_category": ptype.path, "product_type": ptype.name,
      "Attributes": list(attributes),
      "options": {k: list(v) for k, v in (options if options is not None
                                          else _sample_options(rng, ptype,
                                                               max_option_groups)).items()},
      "price": price, "Price": f"${price:.2f}", "Rating": rating, "Reviews": reviews,
  }
  forbidden = forbidden_phrases(product, ptype, extra_forbidden)
  for _ in range(50):
    _write_text(rng, product, ptype, brand)
    if not text_conflicts(product, forbidden):
      return product
  raise RuntimeError(f"could not write text for a {ptype.name} without mentioning "
                     f"{text_conflicts(product, forbidden)}: fix the vocabulary")


def near_miss_kinds(goal: Mapping[str, Any]) -> tuple[str, ...]:
  """The near-miss kinds a goal can have: no "option" near-miss for a goal without options."""
  return tuple(k for k in NEAR_MISS_KINDS if k != "option" or goal["goal_options"])


def sibling_type(rng: random.Random, ptype: ProductType) -> ProductType:
  """A type of the same category sharing no word with `ptype` (type factor 0)."""
  words = set(ptype.name.split())
  choices = [t for t in PRODUCT_TYPES
             if t.category == ptype.category and t.name != ptype.name
             and not words & set(t.name.split())]
  return rng.choice(choices)


def near_miss(rng: random.Random, target: Mapping[str, Any], goal: Mapping[str, Any], kind: str,
              asin: str) -> dict[str, Any]:
  """A copy of `target` that fails `goal` in exactly one reward term (`kind`)."""
  ptype = TYPES_BY_NAME[target["product_type"]]
  brand = target["brand"]
  attributes = list(target["Attributes"])
  options = {k: list(v) for k, v in target["options"].items()}
  price = target["price"]
  goal_attrs = list(goal["attributes"])
  if kind == "attribute":
    dropped = rng.choice(goal_attrs)
    spare = [a for a in ptype.attributes if a not in attributes]
    attributes[attributes.index(dropped)] = rng.choice(spare)
    return make_product(rng, ptype, asin, brand=brand, attributes=attributes, options=options,
                        price=price, extra_forbidden=goal_attrs)
  if kind == "option":
    group = rng.choice(sorted(goal["goal_options"]))
    wanted = goal["goal_options"][group]
    others = [v for v in dict(ptype.options)[group] if v != wanted]
    kept = [v for v in options[group] if v != wanted] or [rng.choice(others)]
    options[group] = kept
    return make_product(rng, ptype, asin, brand=brand, attributes=attributes, options=options,
                        price=price, extra_forbidden=goal_attrs)
  if kind == "price":
    over = round(goal["price_upper"] + rng.uniform(0.5, 25.0), 2)
    return make_product(rng, ptype, asin, brand=brand, attributes=attributes, options=options,
                        price=over, extra_forbidden=goal_attrs)
  if kind == "type":
    other = sibling_type(rng, ptype)
    return make_product(rng, other, asin, brand=brand, attributes=attributes, options=options,
                        price=price)
  raise ValueError(f"unknown near-miss kind {kind!r}; expected one of {NEAR_MISS_KINDS}")
