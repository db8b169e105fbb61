"""WebShop under constrained decoding: the policy writes its own search query inside
`search[...]` (a free span), the `search[<your query>]` template is never sent, and a
constrained policy gets from the search page to an item page (in-process WebShop env)."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import rollout_fakes
from env_servers.webshop.env import WebShopEnv
from hgpo_jax.models import config, decoder, tokenizer
from hgpo_jax.rollout import rollout
from hgpo_jax.rollout.params import RolloutParams
from hgpo_jax.rollout.tasks import Task
from hgpo_jax.sampling import sampler
from hgpo_jax.sampling import SamplingParams

TASKS = ["train-0000", "train-0001"]


def _collect(model, tok, pool, *, max_steps, query_tokens, seed=0):
  smp = sampler.Sampler(model, tok, prompt_buckets=(2048,), batch_buckets=(4,))
  tasks = [Task(t, "train", i, i) for i, t in enumerate(TASKS)]
  params = SamplingParams(temperature=1.0, max_new_tokens=64, stop_strings=("</action>",))
  ro_params = RolloutParams(history_length=2, max_prompt_tokens=2048, constrained=True,
                            fallback_chars=20,  # configs/webshop.py rollout.fallback_chars
                            free_query_tokens=query_tokens)
  return rollout.collect(pool, smp, tok, tasks, 2, env_name="webshop", max_steps=max_steps,
                         params=ro_params, sampling=params, rng=jax.random.key(seed))


def test_random_tiny_policy_writes_free_queries_never_the_template():
  tok = tokenizer.tiny_tokenizer()
  model = decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(0))
  pool = rollout_fakes.LocalPool("webshop", 4)
  ro = _collect(model, tok, pool, max_steps=1, query_tokens=5)
  assert len(ro.rows) == 4 and len(pool.log) == 4
  for row, (action, result) in zip(ro.rows, pool.log):
    assert row.action == action and action.startswith("search[") and action.endswith("]")
    query = action[len("search["):-1]
    assert query.strip() and "<your query>" not in action and not set(query) & set("[]<>")
    # The query is the free span: between "search[" and "]" there are 1..5 tokens.
    ids = row.response_ids
    texts = [tok.decode([t]) for t in ids]
    start = next(j for j in range(len(ids)) if "".join(texts[:j]).endswith("search["))
    end = next(j for j in range(start, len(ids)) if texts[j].startswith("]"))
    assert 1 <= end - start <= 5
    assert row.valid and result.info["action_valid"] == "True"  # the env ran the search
    assert result.info["page"] == "results"


class BigramModel(nnx.Module):
  """A fixed policy on the tiny preset's vocabulary: the next token is `table[previous]`
  with a margin of 30 nats (a stand-in for a trained policy that knows what to search)."""

  def __init__(self, cfg, table):
    self.cfg = cfg
    self.table = nnx.Variable(jnp.asarray(table, jnp.int32))

  def hidden(self, tokens_bt, positions_bt, attn_mask_bts, cache=None, cache_index=None):
    return jnp.zeros(tokens_bt.shape + (self.cfg.hidden_dim,)), cache

  def __call__(self, tokens_bt, positions_bt, attn_mask_bts, cache=None, cache_index=None):
    return 30.0 * jax.nn.one_hot(self.table[...][tokens_bt], self.cfg.vocab_size), cache

  def prefill(self, tokens_bt, positions_bt, segment_ids_bt, cache):
    return self.hidden(tokens_bt, positions_bt, segment_ids_bt, cache)

  def for_decoding(self):
    return self  # no output layer to cast (`Decoder.for_decoding`)

  def decode(self, tokens_bt, positions_bt, cache, cache_index):
    return self(tokens_bt, positions_bt, jnp.ones_like(positions_bt), cache, cache_index)


def test_constrained_policy_reaches_an_item_page():
  tok = tokenizer.tiny_tokenizer()
  cfg = config.get_preset("tiny")
  goal = WebShopEnv().shop.goals[TASKS[0]]
  query = goal["product_type"]  # e.g. "power bank"
  # The policy spells "<action>search[{query}]</action>" after the prompt's last token.
  script = tok.encode("\n") + tok.encode("<action>search[") + tok.encode(query) + tok.encode("]</action>")
  table = np.full(cfg.vocab_size, tok.encode(" egg")[0], np.int32)
  # On a results page it prefers a product: product ids are "b0...", "back to search" is "ba...".
  script_items = tok.encode("b0")
  for prev, nxt in list(zip(script, script[1:])) + [tuple(script_items)]:
    assert table[prev] in (tok.encode(" egg")[0], nxt), "the script needs a unique successor per token"
    table[prev] = nxt
  pool = rollout_fakes.LocalPool("webshop", 4)
  ro = _collect(BigramModel(cfg, table), tok, pool, max_steps=3, query_tokens=16)
  for action, result in pool.log[:4]:
    assert action == f"search[{query}]"
    assert result.info["page"] == "results" and "Total results: 0)" not in result.observation
  # Later steps: "search" is not admissible on a results page, so the trie leaves the page's
  # clickables; after "click[" the policy's wish ("p") is masked and it draws among "n"
  # (next >), "<" (< prev) and "b" (a product or back to search); after "b" it prefers a product.
  later = [(a, r.info["page"]) for a, r in pool.log[4:]]
  assert all(a.startswith("click[") and a != "click[back to search]" for a, _ in later), later
  reached = [a for a, page in later if page == "item"]
  assert reached and all(a.startswith("click[b0") for a in reached), later
  assert all(row.valid for row in ro.rows)
