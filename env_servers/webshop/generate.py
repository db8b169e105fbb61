"""Generates a WebShop-compatible shop: catalog, goals and near-miss distractors.

  python -m env_servers.webshop.generate --num-products 10000 --seed 0 --out DIR

The same arguments always give byte-identical files. The frozen default shop in
`env_servers/webshop/data/` was written by

  python -m env_servers.webshop.generate --num-products 2000 --seed 0 \
      --num-train-goals 100 --num-test-goals 50 --out env_servers/webshop/data

The WebShop-mini shops of the CPU suite (launch/experiments/suites.py, suite `mini`: mini_v3's from
mini_v3, mini_v6's, with 48 test goals, from mini_v6) have no product options, so a
purchase is scored on the product alone (attributes, price, type):

  python -m env_servers.webshop.generate --num-products 500 --seed 0 \
      --num-train-goals 24 --num-test-goals 24 --max-option-groups 0 \
      --out env_servers/webshop/data/mini_v3
  python -m env_servers.webshop.generate --num-products 740 --seed 1 \
      --num-train-goals 24 --num-test-goals 48 --max-option-groups 0 \
      --out env_servers/webshop/data/mini_v6

Every kept goal is checked here: its product scores exactly 1 when bought with the goal
options; each of its four near-misses scores below 1 in exactly the term it was built
to break; and the product is among the top 50 search results for the instruction text
itself (goals whose product search cannot find are dropped, so more candidates than
goals are drawn).
"""

from __future__ import annotations

import argparse
import math
import random
import time

from env_servers.webshop import catalog, goals as goals_lib, reward
from env_servers.webshop.dataset import Shop
from env_servers.webshop.vocabulary import HELD_OUT_TYPES, PRODUCT_TYPES

# Candidate goals drawn per kept goal: covers goals dropped by the retrieval check.
_OVERDRAW = 2.0


def _check_goal(target, goal, near_misses) -> None:
  """Raises if the goal's product or near-misses do not score as designed (a bug)."""
  s = reward.task_score(target, goal, target["price"], goals_lib.purchase_options(target, goal))
  if s.score != 1.0:
    raise AssertionError(f"goal {goal['instruction_text']!r}: its product scores {s}")
  for kind, product in near_misses:
    s = reward.task_score(product, goal, product["price"],
                          goals_lib.purchase_options(product, goal))
    if reward.failed_terms(s) != [kind]:
      raise AssertionError(f"{kind} near-miss of {goal['instruction_text']!r} fails "
                           f"{reward.failed_terms(s)}")


def base_products(rng: random.Random, n: int, taken: set[str],
                  max_option_groups: int | None = None) -> list[dict]:
  """`n` products cycling through all product types (no goals, no near-misses)."""
  return [catalog.make_product(rng, PRODUCT_TYPES[i % len(PRODUCT_TYPES)],
                               catalog.new_asin(rng, taken), max_option_groups=max_option_groups)
          for i in range(n)]


def generate_shop(num_products: int, seed: int, num_train_goals: int = 100,
                  num_test_goals: int = 50, max_option_groups: int | None = None) -> Shop:
  """A shop of exactly `num_products` products with train/test goals; products offer at
  most `max_option_groups` option groups (None: all of their type's; 0: no options)."""
  if max_option_groups is not None and max_option_groups < 0:
    raise ValueError(f"--max-option-groups must be >= 0, got {max_option_groups}")
  rng = random.Random(seed)
  n_cand = {"train": math.ceil(num_train_goals * _OVERDRAW) + 2,
            "test": math.ceil(num_test_goals * _OVERDRAW) + 2}
  # Every type has an option group, so only a shop without options lacks option near-misses.
  n_kinds = len(catalog.NEAR_MISS_KINDS) - (max_option_groups == 0)
  n_near = n_kinds * sum(n_cand.values())
  n_base = num_products - n_near
  if n_base < 2 * sum(n_cand.values()) or n_base < 2 * len(PRODUCT_TYPES):
    raise ValueError(f"--num-products {num_products} is too small for "
                     f"{num_train_goals}+{num_test_goals} goals; use at least "
                     f"{n_near + max(2 * sum(n_cand.values()), 2 * len(PRODUCT_TYPES))}")
  taken: set[str] = set()
  base = base_products(rng, n_base, taken, max_option_groups)

  seen = [p for p in base if p["product_type"] not in HELD_OUT_TYPES]
  held = [p for p in base if p["product_type"] in HELD_OUT_TYPES]
  train_targets = rng.sample(seen, n_cand["train"])
  train_asins = {p["asin"] for p in train_targets}
  rest = [p for p in seen if p["asin"] not in train_asins]
  n_held = (n_cand["test"] + 1) // 2
  test_targets = [None] * n_cand["test"]
  # Even positions target held-out types, odd positions seen types.
  test_targets[0::2] = rng.sample(held, n_held)
  test_targets[1::2] = rng.sample(rest, n_cand["test"] - n_held)

  candidates = []  # (split, target, goal, near_misses)
  products = list(base)
  for split, targets in (("train", train_targets), ("test", test_targets)):
    for i, target in enumerate(targets):
      goal = goals_lib.make_goal(rng, target, split, i)
      nms = [(k, catalog.near_miss(rng, target, goal, k, catalog.new_asin(rng, taken)))
             for k in catalog.near_miss_kinds(goal)]
      _check_goal(target, goal, nms)
      goal["near_misses"] = {k: p["asin"] for k, p in nms}
      products += [p for _, p in nms]
      candidates.append((split, target, goal))

  rng.shuffle(products)
  probe = Shop(products, [])
  kept = {"train": [], "test": []}
  wanted = {"train": num_train_goals, "test": num_test_goals}
  for split, target, goal in candidates:
    if len(kept[split]) < wanted[split] and target["asin"] in probe.index.search(
        goal["instruction_text"]):
      goal = dict(goal, task_id=f"{split}-{len(kept[split]):04d}")
      kept[split].append(goal)
  for split in goals_lib.SPLITS:
    if len(kept[split]) < wanted[split]:
      raise RuntimeError(f"only {len(kept[split])} of {wanted[split]} {split} goals are "
                         f"findable by search; use more products or fewer goals")
  meta = {"generator": "env_servers.webshop.generate", "seed": seed,
          "num_products": num_products, "num_train_goals": num_train_goals,
          "num_test_goals": num_test_goals,
          "note": "generated catalog, not the published WebShop benchmark"}
  if max_option_groups is not None:  # absent from the default shop's (frozen) metadata
    meta["max_option_groups"] = max_option_groups
  return Shop(products, kept["train"] + kept["test"], meta, index=probe.index)


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--num-products", type=int, default=10000)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--num-train-goals", type=int, default=100)
  parser.add_argument("--num-test-goals", type=int, default=50)
  parser.add_argument("--max-option-groups", type=int, default=None,
                      help="option groups per product, at most (default: all of its type's; "
                           "0: no options)")
  parser.add_argument("--out", required=True, help="directory to write the shop to")
  args = parser.parse_args(argv)
  start = time.perf_counter()
  shop = generate_shop(args.num_products, args.seed, args.num_train_goals, args.num_test_goals,
                       args.max_option_groups)
  shop.save(args.out)
  sizes = {name: len(data) for name, data in shop.to_bytes().items()}
  print(f"wrote {len(shop.products)} products, "
        + ", ".join(f"{len(v)} {k}" for k, v in shop.split_ids.items())
        + f" goals to {args.out} ({sizes}) in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
  main()
