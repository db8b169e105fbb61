"""WebShop-mini, the CPU suite's shop: products without options, one listed goal search."""

import os

import pytest

from env_servers import base
from env_servers.webshop import env as env_lib
from env_servers.webshop import reward
from env_servers.webshop.dataset import Shop
from env_servers.webshop.generate import generate_shop

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(ROOT, "env_servers", "webshop", "data")
MINI_DIR = os.path.join(DATA_DIR, "mini_v6")  # the suite's shop since mini_v6
# The frozen WebShop-mini shops: name -> (products, seed, train goals, test goals), the
# arguments of the commands in env_servers/webshop/generate.py's docstring. mini_v3 stays
# for results/mini_webshop_mini.md, whose runs played it.
SHOPS = {"mini_v3": (500, 0, 24, 24), "mini_v6": (740, 1, 24, 48)}


@pytest.fixture(scope="module")
def mini_env():
  return env_lib.WebShopEnv(data_dir=MINI_DIR, search_actions="goal")


@pytest.mark.parametrize("name", sorted(SHOPS))
def test_frozen_mini_shop_is_what_the_generator_writes(name):
  """The commands in env_servers/webshop/generate.py's docstring rewrite the frozen files."""
  num_products, seed, num_train, num_test = SHOPS[name]
  shop = Shop.load(os.path.join(DATA_DIR, name))
  assert shop.meta["max_option_groups"] == 0 and len(shop.products) == num_products
  assert {k: len(v) for k, v in shop.split_ids.items()} == {"train": num_train, "test": num_test}
  regenerated = generate_shop(num_products, seed, num_train, num_test, max_option_groups=0)
  for file_name, data in regenerated.to_bytes().items():
    with open(os.path.join(DATA_DIR, name, file_name), "rb") as f:
      assert f.read() == data, file_name


def test_shop_without_options_has_no_option_near_misses():
  shop = generate_shop(300, seed=3, num_train_goals=6, num_test_goals=4, max_option_groups=0)
  assert len(shop.products) == 300
  assert all(p["options"] == {} for p in shop.products)
  for goal in shop.goals.values():
    assert goal["goal_options"] == {} and set(goal["near_misses"]) == {"attribute", "price", "type"}
    target = shop.by_asin[goal["asin"]]
    assert reward.task_score(target, goal, target["price"], {}).score == 1.0
    for kind, asin in goal["near_misses"].items():
      product = shop.by_asin[asin]
      assert reward.failed_terms(reward.task_score(product, goal, product["price"], {})) == [kind]


def test_option_groups_are_capped_and_the_default_shop_is_unchanged():
  one = generate_shop(700, seed=5, num_train_goals=10, num_test_goals=6, max_option_groups=1)
  assert max(len(p["options"]) for p in one.products) == 1
  assert "max_option_groups" not in generate_shop(700, 5, 10, 6).meta
  with pytest.raises(ValueError, match="max-option-groups must be >= 0"):
    generate_shop(700, 5, 10, 6, max_option_groups=-1)


def test_goal_search_is_listed_and_leads_to_a_results_page(mini_env):
  _, info = mini_env.reset(options={"task_id": "train-0002"})
  goal = mini_env.goal
  query = " ".join(goal["attributes"] + [goal["product_type"]])
  assert info[base.ADMISSIBLE] == [f"search[{query}]"]
  _, _, _, _, info = mini_env.step(info[base.ADMISSIBLE][0])
  assert info["page"] == "results" and info["action_valid"]
  # Every goal's own product is among the results of its listed search (ranks 0-13).
  shop = mini_env.shop
  ranks = [shop.index.search(env_lib.goal_query(g)).index(g["asin"]) for g in shop.goals.values()]
  assert len(ranks) == 72 and max(ranks) == 13 and sum(r < 10 for r in ranks) == 65
  # A typed query stays valid, and the template is refused as in WebShop's own mode.
  mini_env.reset(options={"task_id": "train-0002"})
  assert mini_env.step("search[lamp]")[4]["action_valid"] is True
  mini_env.reset(options={"task_id": "train-0002"})
  assert mini_env.step("search[<your query>]")[4]["action_valid"] is False


def test_search_actions_are_checked():
  with pytest.raises(ValueError, match="search_actions must be one of"):
    env_lib.WebShopEnv(search_actions="typed")


# (uniform-random, listed search + first result + Buy Now) success in %, train and test
CALIBRATION = {"mini_v3": ((19.0, 58.3), (16.2, 50.0)), "mini_v6": ((23.3, 66.7), (23.4, 60.4))}


@pytest.mark.parametrize("name", sorted(CALIBRATION))
def test_random_play_calibration_numbers(name):
  """The numbers of the WebShop-mini calibration (launch/experiments/suites.py, 20 episodes per goal):
  `python -m env_servers.webshop.env --random-play 20 --data-dir env_servers/webshop/data/
  mini_v6 --search-actions goal --split train` (and --split test; mini_v3 likewise)."""
  env = env_lib.WebShopEnv(data_dir=os.path.join(DATA_DIR, name), search_actions="goal")
  train = env_lib.random_play(env, "train", 20)
  test = env_lib.random_play(env, "test", 20)
  expected_train, expected_test = CALIBRATION[name]
  assert (round(100 * train["random"], 1), round(100 * train["first_result"], 1)) == expected_train
  assert (round(100 * test["random"], 1), round(100 * test["first_result"], 1)) == expected_test
  assert env_lib.random_play(env, "train", 20) == train  # seeded per goal and episode


def test_with_the_template_a_random_policy_never_searches():
  rates = env_lib.random_play(env_lib.WebShopEnv(), "train", 1)
  assert rates["random"] == 0.0
