"""Prompt templates and the memory window (docs/algorithms.md §1)."""

from hgpo_jax.rollout import prompts

OBS0 = ("-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly "
        "around you, you see a cabinet 1, and a fridge 1.\n\nYour task is to: put a cool apple in "
        "countertop.")


def test_task_from_observation():
  assert prompts.task_from_observation(OBS0) == "put a cool apple in countertop."


def test_first_step_uses_the_no_history_template():
  mem = prompts.EpisodeMemory(prompts.task_from_observation(OBS0))
  text = prompts.render_prompt("alfworld", mem, OBS0, ["go to fridge 1", "help", "look"], 2)
  assert "Your current observation is: " + OBS0 in text
  assert "[Observation" not in text
  # 'help' is removed, actions are quoted and joined as the published template does
  assert "Your admissible actions of the current situation are: ['go to fridge 1'\n 'look']." in text
  assert text.count("<think> </think>") == 1 and "<action> </action>" in text


def test_history_window_numbers_are_absolute():
  mem = prompts.EpisodeMemory("put a cool apple in countertop.")
  for i in range(5):
    mem.add(f"obs{i}", f"act{i}")
  history, shown = mem.render(2)
  assert shown == 2
  assert history == "[Observation 4: 'obs3', Action 4: 'act3']\n[Observation 5: 'obs4', Action 5: 'act4']"
  text = prompts.render_prompt("alfworld", mem, "obs5", ["look"], 2)
  assert "you have already taken 5 step(s)" in text
  assert "most recent 2 observations" in text
  assert "You are now at step 6 and your current observation is: obs5" in text
  assert "Your task is to: put a cool apple in countertop." in text


def test_history_shorter_than_window_and_zero_window():
  mem = prompts.EpisodeMemory("t")
  mem.add("o1", "a1")
  assert mem.render(4) == ("[Observation 1: 'o1', Action 1: 'a1']", 1)
  assert mem.render(0) == ("", 0)
  text = prompts.render_prompt("alfworld", mem, "o2", ["look"], 0)
  assert "most recent 0 observations" in text and "[Observation" not in text


def test_webshop_template():
  mem = prompts.EpisodeMemory("i need a red mug under 20 dollars")
  text = prompts.render_prompt("webshop", mem, "'Search'", ["search[<your query>]", "click[x]"], 2)
  assert "WebShop e\u2011commerce environment" in text
  # every action ends with a comma, the last one too (the released env manager's
  # "\n".join(f"'{s}'," for s in available_actions))
  assert "[\n'search[<your query>]',\n'click[x]',\n]" in text


def test_webshop_prompts_show_the_formatted_page():
  """The react prompt and its memory show `anchor_obs` (the released `format_obs`: the page
  after the instruction, parts quoted), not the raw page."""
  class Result:
    observation = "WebShop [SEP] Instruction: [SEP] a red mug [SEP] Back to Search [SEP] B01"
    anchor_obs = "'Back to Search' [SEP] 'B01'"
  assert prompts.observation_text("webshop", Result) == Result.anchor_obs
  assert prompts.observation_text("alfworld", Result) == Result.observation


def test_long_webshop_prompts_drop_their_history_only_when_asked():
  mem = prompts.EpisodeMemory("a red mug")
  mem.add("'page' " * 300, "click[b01]")
  with_history = prompts.render_prompt("webshop", mem, "'Search'", ["click[x]"], 2)
  assert "[Observation 1:" in with_history and len(with_history) > 2000
  assert prompts.render_prompt("webshop", mem, "'Search'", ["click[x]"], 2,
                               history_drop_chars=13000) == with_history
  dropped = prompts.render_prompt("webshop", mem, "'Search'", ["click[x]"], 2,
                                  history_drop_chars=2000)
  first = prompts.render_prompt("webshop", prompts.EpisodeMemory("a red mug"), "'Search'",
                                ["click[x]"], 2)
  assert dropped == first and "[Observation" not in dropped


def test_prompts_without_format_instructions_end_at_the_admissible_actions():
  """`format_instructions=False` (constrained decoding) removes exactly the closing
  instruction paragraph: the state parts stay, the history drop applies as before."""
  first = prompts.EpisodeMemory("put a cool apple in countertop.")
  step = prompts.EpisodeMemory("a red mug")
  step.add("'page'", "click[b01]")
  search = prompts.EpisodeMemory("who wrote it?")
  search.add("<information>Doc 1</information>", "<search>it</search>")
  cases = [("alfworld", first, OBS0, ["go to fridge 1", "look"], {}),
           ("webshop", step, "'Search'", ["click[x]"], {}),
           ("webshop", step, "'Search'", ["click[x]"], {"history_drop_chars": 50}),
           ("sokoban", first, "#..", ["up", "down"], {}),
           ("search", search, "", [], {})]
  for env_name, memory, obs, actions, kw in cases:
    full = prompts.render_prompt(env_name, memory, obs, actions, 2, **kw)
    short = prompts.render_prompt(env_name, memory, obs, actions, 2, format_instructions=False,
                                  **kw)
    assert full == short + prompts.instructions(env_name), env_name
    assert "<think>" in full and "<think>" not in short and "turn to" not in short, env_name
  # the listed search variant keeps its action list after the cut
  listed = prompts.render_prompt("search", search, "", ["<answer>b</answer>"], 2,
                                 format_instructions=False)
  assert listed.endswith("[''<answer>b</answer>''].\n".replace("''", "'"))
  assert "<think>" not in listed
