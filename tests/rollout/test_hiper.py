"""HiPER's response format in the rollout: prompts, parser, token span tags, constrained turns."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import rollout_fakes
from hgpo_jax.advantages import hae, segments
from hgpo_jax.models import config, decoder, tokenizer
from hgpo_jax.rollout import hiper, rollout
from hgpo_jax.rollout import params as rollout_params
from hgpo_jax.rollout.tasks import Task
from hgpo_jax.sampling import constrained, sampler
from hgpo_jax.sampling import SamplingParams

OBS0 = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
        "around you, you see a countertop 1, and a fridge 1.\n\nYour task is to: put a cool apple "
        "in countertop.")
OBS1 = "You arrive at fridge 1. The fridge 1 is closed."
OBS2 = "You open the fridge 1. The fridge 1 is open. In it, you see a apple 1."
ADM0 = ["go to countertop 1", "go to fridge 1", "help"]
ADM1 = ["go to countertop 1", "go to fridge 1", "open fridge 1"]
ADM2 = ["take apple 1 from fridge 1", "close fridge 1"]
RESPONSES = [
    "<switch>SWITCH</switch><subgoal>find the apple</subgoal><action>go to fridge 1</action>",
    "<switch>KEEP</switch><subgoal>get the apple</subgoal><action>open fridge 1</action>",
    "<switch>SWITCH</switch>\n<subgoal>take the apple</subgoal>\n<action>Take apple 1 from fridge 1</action>",
]

# The released HiPER-agent "Options" wording (agent_system/environments/prompts/alfworld.py),
# written out here independently of hgpo_jax.rollout.hiper.
INTRO = (
    "You will complete the task by maintaining a SHORT-TERM SUB-GOAL at each step. A sub-goal is a "
    "small high-level objective that can typically be achieved in a few actions. A sub-goal is NOT "
    "the full task and NOT a low-level action.\n\nAt every step, you reconsider your current "
    "sub-goal based on the latest observation, and may continue it or switch to a new short-term "
    "sub-goal.\n\n")
THREE_BLOCKS = (
    "At EVERY step, you MUST output EXACTLY THREE blocks, in the order shown below:\n"
    "1) A <switch> block          (KEEP or SWITCH)\n"
    "2) A <subgoal> block         (the sub-goal to follow next)\n"
    "3) An <action> block         (one admissible action)\n\n")
TAIL = (
    "- <action> MUST contain EXACTLY ONE action verbatim copied AS IS from the admissible actions "
    "list.\n\nNOW RESPOND IN THIS EXACT FORMAT (no extra text):\n\n"
    "<switch>KEEP or SWITCH</switch>\n<subgoal>the sub-goal you will follow next</subgoal>\n"
    "<action>EXACTLY one ADMISSIBLE action</action>\n")
RULES_FIRST = (
    "NO other text, comments, or reasoning is allowed before, after, or between these blocks.\n\n"
    "STRICT FORMAT REQUIREMENTS:\n- <switch> MUST contain ONLY \"KEEP\" or \"SWITCH\".\n"
    "- <subgoal> MUST appear at EVERY step:\n"
    "    * If <switch>KEEP</switch>, you MUST copy the EXACT current sub-goal.\n"
    "    * If <switch>SWITCH</switch>, you MUST write a NEW short sub-goal achievable in a few actions.\n")
RULES_STEP = (
    "NO other text, comments, or reasoning is permitted anywhere in the output.\n\n"
    "STRICT FORMAT REQUIREMENTS:\n- <switch> MUST contain ONLY \"KEEP\" or \"SWITCH\".\n"
    "- <subgoal> MUST appear at EVERY step:\n"
    "    * If you KEEP, copy the EXACT current sub-goal into <subgoal>.\n"
    "    * If you SWITCH, write a NEW short sub-goal achievable in a few actions and NOT the entire task.\n")
ROLE = "\nYou are an expert agent operating in the ALFRED Embodied Environment.\n"
HIST1 = ("[Observation 1: '-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. "
         "Looking quickly around you, you see a countertop 1, and a fridge 1.\n\nYour task is to: put "
         "a cool apple in countertop.', Action 1: 'go to fridge 1']")
EXPECTED_PROMPTS = [
    ROLE + "\n" + INTRO + "Your current observation is:\n" + OBS0 + "\n\n"
    "Your current sub-goal is:\nNone\n(If this is the first step of the episode, this will be "
    "\"None\".)\n\nYour admissible actions are:\n['go to countertop 1'\n 'go to fridge 1']\n\n"
    + THREE_BLOCKS + RULES_FIRST + TAIL,
    ROLE + "Your overall task is: put a cool apple in countertop.\n\n" + INTRO
    + "You have already taken 1 step(s).\nMost recent 1 observations and actions:\n" + HIST1 + "\n\n"
    "Your current observation is:\nYou arrive at fridge 1. The fridge 1 is closed.\n\n"
    "Your current sub-goal is:\nfind the apple\n\n"
    "Your admissible actions are:\n['go to countertop 1'\n 'go to fridge 1'\n 'open fridge 1']\n\n"
    + THREE_BLOCKS + RULES_STEP + TAIL,
    ROLE + "Your overall task is: put a cool apple in countertop.\n\n" + INTRO
    + "You have already taken 2 step(s).\nMost recent 2 observations and actions:\n" + HIST1 + "\n"
    "[Observation 2: 'You arrive at fridge 1. The fridge 1 is closed.', Action 2: 'open fridge 1']\n\n"
    "Your current observation is:\nYou open the fridge 1. The fridge 1 is open. In it, you see a "
    "apple 1.\n\nYour current sub-goal is:\nget the apple\n\n"
    "Your admissible actions are:\n['take apple 1 from fridge 1'\n 'close fridge 1']\n\n"
    + THREE_BLOCKS + RULES_STEP + TAIL,
]


def _three_turn_episode(**kwargs):
  pool = rollout_fakes.ScriptedPool([[(OBS0, ADM0, 0.0, False), (OBS1, ADM1, 0.0, False),
                                      (OBS2, ADM2, 0.0, False), ("You pick up the apple 1.", [], 0.0, False)]])
  tok = rollout_fakes.CharTokenizer()
  smp = rollout_fakes.ScriptedSampler(tok, RESPONSES)
  steps = []
  ro = rollout.collect(pool, smp, tok, [Task("t0", "train", 0, 0)], 1, env_name="alfworld",
                       max_steps=3,
                       params=rollout_params.RolloutParams(history_length=2,
                                                           max_prompt_tokens=100_000,
                                                           response_format="hiper", **kwargs),
                       sampling=None, rng=jax.random.key(0), on_step=lambda *a: steps.append(a))
  return ro, smp, pool, steps


def test_three_turn_episode_prompts_equal_the_expected_text():
  ro, smp, pool, steps = _three_turn_episode()
  prompts = [texts[0] for texts, _, _ in smp.calls]
  for t, (got, want) in enumerate(zip(prompts, EXPECTED_PROMPTS)):
    assert got == want, f"turn {t + 1}"
  assert len(prompts) == 3
  assert steps == [(0, 3, 1), (1, 3, 1), (2, 3, 1)]
  assert [a[0] for a in pool.actions] == ["go to fridge 1", "open fridge 1", "take apple 1 from fridge 1"]


def test_state_only_prompts_drop_exactly_the_instructions():
  _, smp, _, _ = _three_turn_episode(format_instructions=False)
  prompts = [texts[0] for texts, _, _ in smp.calls]
  for t, (got, want) in enumerate(zip(prompts, EXPECTED_PROMPTS)):
    for part in (INTRO, THREE_BLOCKS + RULES_FIRST + TAIL, THREE_BLOCKS + RULES_STEP + TAIL):
      want = want.replace(part, "")
    assert got == want, f"turn {t + 1}"
  assert prompts[0] == (
      ROLE + "\nYour current observation is:\n" + OBS0 + "\n\nYour current sub-goal is:\nNone\n"
      "(If this is the first step of the episode, this will be \"None\".)\n\n"
      "Your admissible actions are:\n['go to countertop 1'\n 'go to fridge 1']\n\n")


def test_left_truncated_released_prompt_is_blind_and_the_state_only_one_is_not():
  """Why `format_instructions=False` exists: with the tiny byte-level tokenizer, the last
  256 tokens of the released step-2 prompt are instruction text only."""
  tok = tokenizer.tiny_tokenizer()
  memory = rollout.prompts.EpisodeMemory("put a cool apple in countertop.")
  memory.records.append((OBS0, "go to fridge 1"))
  tails = {}
  for instructions in (True, False):
    text = hiper.render_prompt("alfworld", memory, OBS1, ADM1, 2, "find the apple", instructions)
    tails[instructions] = tok.decode(tok.encode(text)[-256:])
  assert not any(a in tails[True] for a in ADM1) and OBS1 not in tails[True]
  assert all(a in tails[False] for a in ADM1) and OBS1 in tails[False]
  assert "find the apple" in tails[False]
  with pytest.raises(ValueError, match="needs constrained=True"):
    rollout_params.RolloutParams(format_instructions=False)
  rollout_params.RolloutParams(format_instructions=False, constrained=True)

def test_rows_carry_what_hae_reads():
  ro, *_ = _three_turn_episode()
  assert [(r.switch, r.subgoal, r.valid) for r in ro.rows] == [
      ("SWITCH", "find the apple", True), ("KEEP", "get the apple", True),
      ("SWITCH", "take the apple", True)]
  for r in ro.rows:
    assert len(r.token_tags) == len(r.response_ids) == len(r.response)  # one char per token
  # Row 2 ("\n" between blocks is outside every span): golden tags per character.
  text = RESPONSES[2]
  want = ([hae.TAG_SWITCH] * len("<switch>SWITCH</switch>") + [hae.TAG_OTHER]
          + [hae.TAG_SUBGOAL] * len("<subgoal>take the apple</subgoal>") + [hae.TAG_OTHER]
          + [hae.TAG_ACTION] * len("<action>Take apple 1 from fridge 1</action>"))
  assert len(want) == len(text) and ro.rows[2].token_tags == want
  records = [r.dump_record() for r in ro.rows]
  assert [rec["switch"] for rec in records] == ["SWITCH", "KEEP", "SWITCH"]
  assert records[1]["subgoal"] == "get the apple" and records[2]["token_tags"] == want
  assert [rec["response_ids"] for rec in records] == [r.response_ids for r in ro.rows]
  for rec, v in zip(records, ([1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0])):
    rec["values"] = dict(zip(hae.HEADS, v))
  fields = hae.hae_fields_from_dump(records)
  np.testing.assert_array_equal(fields["segment_start"], [True, False, True])
  # KEEP turn whose subgoal differs from the previous one: the consistency penalty applies.
  np.testing.assert_array_equal(fields["subgoal_changed"], [False, True, False])
  assert fields["token_tags"].shape == (3, max(len(w) for w in RESPONSES))
  np.testing.assert_array_equal(fields["token_tags"][2, :len(want)], want)


def test_react_rows_have_no_hiper_fields():
  pool = rollout_fakes.ScriptedPool([[(OBS0, ADM0, 0.0, False), (OBS1, ADM1, 10.0, True)]])
  tok = rollout_fakes.CharTokenizer()
  smp = rollout_fakes.ScriptedSampler(tok, ["<think>x</think><action>go to fridge 1</action>"])
  ro = rollout.collect(pool, smp, tok, [Task("t0", "train", 0, 0)], 1, env_name="alfworld",
                       max_steps=3,
                       params=rollout_params.RolloutParams(history_length=2,
                                                           max_prompt_tokens=100_000),
                       sampling=None, rng=jax.random.key(0))
  (row,) = ro.rows
  assert (row.switch, row.subgoal, row.token_tags) == (None, None, None)
  assert not {"switch", "subgoal", "token_tags"} & set(row.dump_record())
  with pytest.raises(ValueError, match="response_format='options'"):
    rollout.collect(pool, smp, tok, [Task("t0", "train", 0, 0)], 1, env_name="alfworld",
                    max_steps=3,
                    params=rollout_params.RolloutParams(history_length=2, max_prompt_tokens=100,
                                                        response_format="options"),
                    sampling=None, rng=jax.random.key(0))


def test_webshop_prompt_uses_instruction_page_parts_and_released_action_list():
  obs = "WebShop [SEP] Instruction: [SEP] i need a red lamp [SEP] Search"
  pool = rollout_fakes.ScriptedPool([[(obs, ["search[<your query>]"], 0.0, False)] * 2])
  pool._result = lambda slot, base=pool._result: _with_anchor(base(slot), "'Search'")
  tok = rollout_fakes.CharTokenizer()
  smp = rollout_fakes.ScriptedSampler(tok, ["<switch>SWITCH</switch><subgoal>find lamp</subgoal>"
                                            "<action>search[red lamp]</action>"])
  rollout.collect(pool, smp, tok, [Task("t0", "train", 0, 0)], 1, env_name="webshop",
                  max_steps=1,
                  params=rollout_params.RolloutParams(history_length=2, max_prompt_tokens=100_000,
                                                      response_format="hiper"),
                  sampling=None, rng=jax.random.key(0))
  text = smp.calls[0][0][0]
  assert text.startswith("\nYou are an expert autonomous agent operating in the WebShop "
                         "e\u2011commerce environment. Your task is to: i need a red lamp.\n\n" + INTRO)
  assert ("Your current observation is: 'Search'.\n\nYour current sub-goal is: None.\n\n"
          "Your admissible actions of the current situation are: \n[\n'search[<your query>]',\n].\n\n"
          + THREE_BLOCKS) in text


def _with_anchor(result, anchor):
  result.anchor_obs = anchor
  return result


WEB_TASK = "i need a red lamp"
WEB_ACTIONS = ["search[<your query>]", "click[b01]"]


def _page_for_length(subgoal, length, instructions=True):
  """A one-record WebShop memory and a page whose step-2 prompt is `length` characters."""
  def prompt(page_chars):
    memory = rollout.prompts.EpisodeMemory(WEB_TASK)
    memory.add("p" * page_chars, "click[b01]")
    return memory, hiper.render_prompt("webshop", memory, "'Search'", WEB_ACTIONS, 2, subgoal,
                                       instructions)
  _, empty = prompt(0)
  return prompt(length - len(empty))


@pytest.mark.parametrize("instructions", [True, False])
def test_webshop_prompt_drops_its_history_above_13000_characters(instructions):
  """The released `WebshopEnvironmentManagerOptions.build_text_obs`: a prompt with history
  of more than 13,000 characters (`len(obs) > 13000`) becomes the no-history template with
  the same current subgoal (`current_subgoal=subgoals[i]`, not "None")."""
  subgoal = "find the red lamp"
  no_history = hiper.render_prompt("webshop", rollout.prompts.EpisodeMemory(WEB_TASK),
                                   "'Search'", WEB_ACTIONS, 2, subgoal, instructions)
  for length, dropped in ((12_999, False), (13_000, False), (13_001, True)):
    memory, full = _page_for_length(subgoal, length, instructions)
    assert len(full) == length and "[Observation 1: 'ppp" in full
    got = hiper.render_prompt("webshop", memory, "'Search'", WEB_ACTIONS, 2, subgoal,
                              instructions, history_drop_chars=13_000)
    assert got == (no_history if dropped else full), length
    assert ("[Observation 1:" in got) is not dropped
    assert ("You have already taken 1 step(s)" in got) is not dropped
    # what stays either way: task, current observation, current subgoal, actions
    assert f"Your task is to: {WEB_TASK}." in got
    assert "current observation is: 'Search'." in got
    assert f"Your current sub-goal is: {subgoal}." in got
    assert "'search[<your query>]',\n'click[b01]',\n]" in got
    # 0 (the base default; the WebShop configs but HGPO's set 13,000) never drops
    assert hiper.render_prompt("webshop", memory, "'Search'", WEB_ACTIONS, 2, subgoal,
                               instructions) == full
  # the dropped prompt is the first-step one: 1,584 characters (307 without instructions)
  assert len(no_history) == (1_584 if instructions else 307)


def test_collect_passes_the_history_drop_to_hiper_prompts():
  page = "'" + "x" * 7_000 + "'"  # two pages (history + current) are over 13,000 characters
  obs = f"WebShop [SEP] Instruction: [SEP] {WEB_TASK} [SEP] {page}"
  prompts_by_drop = {}
  for drop in (0, 13_000):
    pool = rollout_fakes.ScriptedPool([[(obs, WEB_ACTIONS, 0.0, False)] * 3])
    pool._result = lambda slot, base=pool._result: _with_anchor(base(slot), page)
    tok = rollout_fakes.CharTokenizer()
    smp = rollout_fakes.ScriptedSampler(tok, [
        "<switch>SWITCH</switch><subgoal>open b01</subgoal><action>click[b01]</action>"] * 2)
    rollout.collect(pool, smp, tok, [Task("t0", "train", 0, 0)], 1, env_name="webshop",
                    max_steps=2,
                    params=rollout_params.RolloutParams(history_length=2,
                                                        max_prompt_tokens=100_000,
                                                        response_format="hiper",
                                                        history_drop_chars=drop),
                    sampling=None, rng=jax.random.key(0))
    prompts_by_drop[drop] = [texts[0] for texts, _, _ in smp.calls]
  kept, dropped = prompts_by_drop[0][1], prompts_by_drop[13_000][1]
  assert len(kept) > 14_000 and "[Observation 1:" in kept
  assert len(dropped) < 10_000 and "[Observation 1:" not in dropped
  assert "Your current sub-goal is: open b01." in dropped and page in dropped
  assert prompts_by_drop[0][0] == prompts_by_drop[13_000][0]  # step 1 has no history


@pytest.mark.parametrize("response,want", [
    ("<switch>SWITCH</switch><subgoal> find apple </subgoal><action>Go To Desk 1</action>",
     ("go to desk 1", True, "SWITCH", "find apple")),
    ("<switch> keep </switch>\n<subgoal>Find Apple</subgoal>\n<action>look</action>",
     ("look", True, "KEEP", "Find Apple")),
    # missing switch: no switch (HAE counts the turn as KEEP), invalid
    ("<subgoal>find apple</subgoal><action>look</action>", ("look", False, None, "find apple")),
    # switch content other than KEEP/SWITCH, or empty: invalid
    ("<switch>MAYBE</switch><subgoal>a</subgoal><action>look</action>", ("look", False, "MAYBE", "a")),
    ("<switch></switch><subgoal>a</subgoal><action>look</action>", ("look", False, "", "a")),
    # missing subgoal tags: invalid, no subgoal
    ("<switch>KEEP</switch><action>look</action>", ("look", False, "KEEP", None)),
    # truncated mid-tag: action falls back to the last 30 characters
    ("<switch>KEEP</switch><subgoal>find apple</sub",
     ("<switch>keep</switch><subgoal>find apple</sub"[-30:], False, "KEEP", None)),
    ("<switch>KEEP</switch><subgoal>a</subgoal><action>go to des",
     ("subgoal>a</subgoal><action>go to des", False, "KEEP", "a")),
    ("go to desk 1", ("go to desk 1", False, None, None)),  # no tags
    ("   \n ", ("   \n ", False, None, None)),  # whitespace only
    # repeated blocks: the first of each counts
    ("<switch>KEEP</switch><switch>SWITCH</switch><subgoal>a</subgoal><subgoal>b</subgoal>"
     "<action>look</action><action>inventory</action>", ("look", True, "KEEP", "a")),
    # wrong order: the released parser does not check order
    ("<action>look</action><subgoal>a</subgoal><switch>SWITCH</switch>", ("look", True, "SWITCH", "a")),
    # an empty subgoal is present, hence valid
    ("<switch>SWITCH</switch><subgoal></subgoal><action>look</action>", ("look", True, "SWITCH", "")),
    # CJK characters invalidate the response
    ("<switch>SWITCH</switch><subgoal>找苹果</subgoal><action>look</action>", ("look", False, "SWITCH", "找苹果")),
])
def test_parser_cases(response, want):
  action, valid, switch, subgoal = want
  if len(action) > 30:
    action = action[-30:]
  got = hiper.parse_response(response)
  assert (got.action, got.valid, got.switch, got.subgoal) == (action, valid, switch, subgoal)


def test_missing_or_empty_switch_keeps_and_turn_one_is_a_boundary():
  switches = [hiper.parse_response(r).switch for r in (
      "<switch>KEEP</switch>", "<subgoal>x</subgoal>", "<switch> </switch>", "<switch>SWITCH</switch>",
      "<switch>MAYBE</switch>")]
  assert switches == ["KEEP", None, "", "SWITCH", "MAYBE"]
  np.testing.assert_array_equal(segments.segment_start_flags([0, 1, 2, 3, 4], switches),
                                [True, False, False, True, True])


@pytest.fixture(scope="module")
def smollm2_tokenizer():
  from hgpo_jax.models.gguf_file import GGUFFile
  from hgpo_jax.models.loading import smollm2_gguf_path
  return GGUFFile(smollm2_gguf_path()).tokenizer()


def test_token_tags_on_the_smollm2_tokenizer(smollm2_tokenizer):
  tok = smollm2_tokenizer
  S, G, A, O = hae.TAG_SWITCH, hae.TAG_SUBGOAL, hae.TAG_ACTION, hae.TAG_OTHER
  ids = tok.encode("<switch>KEEP</switch><subgoal>find the apple</subgoal><action>go to countertop 1</action>")
  assert hiper.token_texts(tok, ids) == [
      "<", "switch", ">", "KE", "EP", "</", "switch", "><", "sub", "goal", ">", "find", " the", " apple",
      "</", "sub", "goal", "><", "action", ">", "go", " to", " counter", "top", " ", "1", "</", "action", ">"]
  # "><" holds the end of one block and the start of the next: it is in both (released
  # hier_mask.py computes each block's token range on its own).
  SG, GA = hae.TAG_SWITCH_SUBGOAL, hae.TAG_SUBGOAL_ACTION
  assert hiper.token_tags(hiper.token_texts(tok, ids)) == [S] * 7 + [SG] + [G] * 9 + [GA] + [A] * 11
  ids = tok.encode("Sure!\n<switch>SWITCH</switch>\n<subgoal> heat egg</subgoal>\n"
                   "<action>search[red shoes]</action>") + [tok.eos_ids[0]]
  texts = hiper.token_texts(tok, ids)
  assert texts[:4] == ["Sure", "!", "\n", "<"] and texts[-1] == ""  # EOS decodes to ""
  assert hiper.token_tags(texts) == ([O] * 3 + [S] * 9 + [O] + [G] * 10 + [O] + [A] * 11 + [O])
  ids = tok.encode("<switch>KEEP</switch><subgoal>find the app")  # truncated: no subgoal span
  assert hiper.token_tags(hiper.token_texts(tok, ids)) == [S] * 8 + [O] * 6
  # The read-out: V_low after the subgoal block's last token (the straddling "><" at 17).
  ids = tok.encode("<switch>KEEP</switch><subgoal>find the apple</subgoal><action>look</action>")
  assert hae.value_readout(hiper.token_tags(hiper.token_texts(tok, ids))) == (18, 0, 0)


def test_token_tags_match_a_character_reference_on_random_responses():
  """A token is in exactly the blocks its characters overlap (released hier_mask.py:
  tokens from the one holding the block's first character to the one holding its last)."""
  tok = tokenizer.tiny_tokenizer()
  rng = np.random.default_rng(0)
  words = ["KEEP", "SWITCH", "find", " the apple", "go to desk 1", "\n", " ", "ok", "<", ">"]
  checked = 0
  for _ in range(200):
    parts = []
    for open_tag, close_tag, _ in hiper.BLOCKS:
      if rng.random() < 0.9:
        parts.append(str(rng.choice(words)))
        body = open_tag + "".join(rng.choice(words, size=rng.integers(0, 3))) + close_tag
        parts.append(body[:len(body) if rng.random() < 0.8 else rng.integers(1, len(body))])
    if rng.random() < 0.2:
      rng.shuffle(parts)  # blocks out of order
    text = "".join(parts)
    texts = hiper.token_texts(tok, tok.encode(text))
    assert "".join(texts) == text
    spans = hiper.block_spans(text)
    tags, pos = hiper.token_tags(texts), 0
    for piece, tag in zip(texts, tags):
      lo, hi = pos, pos + len(piece)
      pos = hi
      overlapping = {t for a, b, t in spans if lo < b and a < hi}
      assert {t for t in (hae.TAG_SWITCH, hae.TAG_SUBGOAL, hae.TAG_ACTION)
              if hae.tag_in(np.array([tag]), t)[0]} == overlapping
      checked += bool(overlapping)
  assert checked > 1000


@pytest.mark.slow
def test_constrained_hiper_rollout_on_the_tiny_model():
  """Every turn parses valid with KEEP/SWITCH and an admissible action; a KEEP turn copies
  the current subgoal, so no KEEP turn changes it; the next prompt shows the parsed subgoal."""
  tok = tokenizer.tiny_tokenizer()
  model = decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(0))
  smp = sampler.Sampler(model, tok, prompt_buckets=(2048,), batch_buckets=(4,))
  admissible = ["go to desk 1", "open drawer 1", "look"]
  episode = [(f"You see room {k}.", admissible, 0.0, False) for k in range(5)]
  pool = rollout_fakes.ScriptedPool([episode] * 4)
  prompts_seen = []
  real_generate = smp.generate

  def recording_generate(prompts, *args, **kwargs):
    prompts_seen.append([tok.decode(p) for p in prompts])
    return real_generate(prompts, *args, **kwargs)

  smp.generate = recording_generate
  ro = rollout.collect(pool, smp, tok, [Task("t0", "train", 0, 0), Task("t1", "train", 1, 1)], 2,
                       env_name="sokoban", max_steps=4,
                       params=rollout_params.RolloutParams(history_length=2,
                                                           max_prompt_tokens=2048,
                                                           constrained=True,
                                                           response_format="hiper",
                                                           subgoal_tokens=6),
                       sampling=SamplingParams(temperature=1.0, max_new_tokens=96),
                       rng=jax.random.key(0))
  assert len(ro.rows) == 16
  by_traj = {}
  for r in ro.rows:
    assert r.valid and r.switch in ("KEEP", "SWITCH") and r.action in admissible, r.response
    assert 0 < len(r.subgoal) and len(r.token_tags) == len(r.response_ids)
    assert set(r.token_tags) == {hae.TAG_SWITCH, hae.TAG_SUBGOAL, hae.TAG_ACTION}
    by_traj.setdefault(r.traj, []).append(r)
  for rows in by_traj.values():
    for prev, cur in zip(rows, rows[1:]):
      if cur.switch == "KEEP":
        assert cur.subgoal == prev.subgoal
      # The prompt of turn cur.step shows the previous turn's parsed subgoal.
      assert f"Your current sub-goal is:\n{prev.subgoal}\n" in prompts_seen[cur.step][cur.traj]
  assert {r.switch for r in ro.rows} == {"KEEP", "SWITCH"}
  records = [dict(r.dump_record(), values={"low": 0.0, "high": 0.0, "term": 0.0}) for r in ro.rows]
  assert all("response_ids" in rec for rec in records)
  assert not hae.hae_fields_from_dump(records, subgoal_compare="text")["subgoal_changed"].any()
  # Token ids (the default on these dumps, as released): the KEEP copy is the previous
  # turn's sampled ids, so no KEEP turn is flagged either.
  assert not hae.hae_fields_from_dump(records)["subgoal_changed"].any()
  # ...and some copies are ids the copied text does not encode to (the case that needs them)
  copies = [(prev, cur) for rows in by_traj.values() for prev, cur in zip(rows, rows[1:])
            if cur.switch == "KEEP"]
  assert copies
  recoded = [tuple(tok.encode(prev.subgoal)) != hiper.subgoal_content_ids(
      hiper.token_texts(tok, prev.response_ids), prev.response_ids) for prev, _ in copies]
  assert any(recoded), "no non-canonical subgoal sampled: the test no longer covers the copy"


def test_keep_copies_the_sampled_subgoal_ids_not_its_text_encoded_afresh():
  """A subgoal sampled as single bytes ("d", "e", "s", "k") is copied as those ids by the
  KEEP response, so the released token-id comparison sees no change; a text copy would
  encode "desk" afresh with the tiny BPE's merges."""
  tok = tokenizer.tiny_tokenizer()
  content = [tok.encode(ch)[0] for ch in "desk"]
  prefix = tok.encode("<switch>SWITCH</switch><subgoal>")
  tail = tok.encode("</subgoal><action>look</action>")
  ids = prefix + content + tail
  assert hiper.subgoal_content_ids(hiper.token_texts(tok, ids), ids) == tuple(content)
  assert tuple(tok.encode("desk")) != tuple(content)  # the BPE merges "desk"
  allowed = hiper.constrained_responses(["look"], "desk", False, 6, subgoal_ids=content)
  seqs = constrained.constrained_token_sequences(allowed, hiper.RESPONSE_CONSTRAINT, tok.encode)
  keep = seqs[:1]  # per action: the KEEP response, then the SWITCH one (a free span)
  assert all(isinstance(t, int) for t in keep[0])
  assert tok.decode(keep[0]) == "<switch>KEEP</switch><subgoal>desk</subgoal><action>look</action>"
  rows = []
  for i, resp in enumerate([ids, keep[0]]):
    texts = hiper.token_texts(tok, resp)
    rows.append(dict(traj=0, step=i, switch=hiper.parse_response(tok.decode(resp)).switch,
                     response_ids=resp, token_tags=hiper.token_tags(texts),
                     values={"low": 0.0, "high": 0.0, "term": 0.0}))
  assert not hae.hae_fields_from_dump(rows)["subgoal_changed"].any()
  # the text copy (no ids given) changes the ids, which the released rule penalises
  text_copy = hiper.constrained_responses(["look"], "desk", False, 6)
  seq = constrained.constrained_token_sequences(text_copy, hiper.RESPONSE_CONSTRAINT, tok.encode)[0]
  rows[1].update(response_ids=seq, token_tags=hiper.token_tags(hiper.token_texts(tok, seq)))
  assert hae.hae_fields_from_dump(rows)["subgoal_changed"].tolist() == [False, True]


def test_switch_and_subgoal_change_rates_count_turns_after_the_first():
  """Turns after the first: (KEEP a), (SWITCH b) in trajectory 0 and (SWITCH x) after x in
  trajectory 1: SWITCH at 2 of 3, a changed subgoal at 1 of 3 (a SWITCH may keep the text)."""
  def row(traj, step, switch, subgoal):
    return rollout.StepRow(group=0, traj=traj, step=step, task_id="t", task_type="", anchor_obs="",
                           prompt_ids=[], response_ids=[], response="", action="look",
                           valid=True, switch=switch, subgoal=subgoal, token_tags=[])
  rows = [row(0, 0, "SWITCH", "a"), row(0, 1, "KEEP", "a"), row(0, 2, "SWITCH", "b"),
          row(1, 0, "KEEP", "x"), row(1, 1, "SWITCH", "x")]
  m = rollout.episode_metrics(rows, [False, True], [0.0, 1.0], [3, 2], ["", ""])
  assert m["switch_rate"] == pytest.approx(2 / 3)
  assert m["subgoal_change_rate"] == pytest.approx(1 / 3)
  react = [dataclasses.replace(r, switch=None, subgoal=None, token_tags=None) for r in rows]
  assert "switch_rate" not in rollout.episode_metrics(react, [False, True], [0.0, 1.0], [3, 2], ["", ""])
