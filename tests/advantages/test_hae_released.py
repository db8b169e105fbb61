"""The project's HiPER path equals the released code's (JonP07/HiPER-agent@9d3c118).

Project path: `hiper.parse_response` (switch) -> `hiper.token_tags` (per-token blocks) ->
`hae.value_readout` (where the three values are read) ->
`hae.hae_fields_from_dump` (switch flags, token-id consistency) -> `hae.hae` (advantages,
token routing, value targets). Released path: `released_hae.compute`, a float64
transcription of hier_mask.py + core_hae.py in ray_trainer.py's order. Random batches of
malformed responses tokenized by a fixture tokenizer whose pieces straddle block
boundaries; every option combination the configs use (docs/algorithms.md §8). The
trainer's path (`value_targets.critic_targets` on rollout StepRows) is checked the same way.
"""

import dataclasses

import numpy as np
import pytest

import released_hae
from hgpo_jax.advantages import hae
from hgpo_jax.advantages import hae_reference as ref
from hgpo_jax.advantages import registry
from hgpo_jax.advantages.hae import HaeOptions
from hgpo_jax.models import critic
from hgpo_jax.rollout import hiper
from hgpo_jax.rollout import rollout
from hgpo_jax.training import value_targets

# Pieces of the fixture tokenizer: tags whole and split, pieces that straddle two blocks
# ("><", ">\n<", "></"), a piece that runs into a block ("\n<"), words and single chars.
PIECES = ["<switch>", "</switch>", "<subgoal>", "</subgoal>", "<action>", "</action>", "<", ">",
          "</", "><", "></", ">\n<", "\n<", ">\n", "switch", "subgoal", "sub", "goal", "action",
          "KEEP", "SWITCH", "KE", "EP", "find", " apple", "apple", " the", "go to", " desk 1",
          "look", ".</", "]</", "Sure!", "h><", "P><"]


class PieceTokenizer:
  """Tokenizes by random choice among the pieces that match at each position (so the same
  text has several tokenizations, as sampled responses do); decode is per piece."""

  def __init__(self):
    chars = sorted({c for p in PIECES for c in p} | set("abcdefghijklmnopqrstuvwxyz .]\n)MAYBE1"))
    self.vocab = list(dict.fromkeys(PIECES + chars))
    self.ids = {p: i for i, p in enumerate(self.vocab)}

  def encode(self, text, rng):
    out, pos = [], 0
    while pos < len(text):
      fits = [p for p in self.vocab if text.startswith(p, pos)]
      piece = fits[int(rng.integers(len(fits)))] if rng.random() < 0.7 else max(fits, key=len)
      out.append(self.ids[piece])
      pos += len(piece)
    return out

  def decode(self, token_id):
    return self.vocab[token_id]


TOK = PieceTokenizer()
SWITCHES = ["<switch>KEEP</switch>", "<switch>SWITCH</switch>", "<switch> keep </switch>",
            "<switch></switch>", "<switch>MAYBE</switch>", "", "<switch>KEEP"]
SUBGOALS = ["find apple", "find apple ", " find apple", "find  apple", "find the apple", "find apple.",
            "find apple]"]
ACTIONS = ["<action>go to desk 1</action>", "<action>look</action>", "", "<action>go to d",
           "<action>look.</action>"]


def random_response(rng):
  """Three blocks, each possibly missing, unclosed or malformed; random separators; blocks
  sometimes out of order; near-identical subgoals so that KEEP turns often copy "almost"."""
  sw = str(rng.choice(SWITCHES))
  r = rng.random()
  sg = "" if r < 0.1 else "<subgoal>" + str(rng.choice(SUBGOALS)) + ("</subgoal>" if r > 0.2 else "")
  act = str(rng.choice(ACTIONS))
  blocks = [sw, sg, act]
  if rng.random() < 0.1:
    rng.shuffle(blocks)
  seps = [str(rng.choice(["", "", "\n", " "])) for _ in range(3)]
  text = ("Sure!\n" if rng.random() < 0.1 else "") + "".join(s + b for s, b in zip(seps, blocks))
  return text or "look"


def random_turns(rng, num_traj=60, max_turns=6):
  turns = []
  for traj in range(num_traj):
    n = int(rng.integers(1, max_turns + 1))
    done_last = rng.random() < 0.6
    for t in range(n):
      ids = TOK.encode(random_response(rng), rng)
      last = t == n - 1
      turns.append({
          "traj": traj, "turn": t, "ids": ids, "done": bool(last and done_last),
          "reward": (10.0 if last and done_last and rng.random() < 0.5 else 0.0)
                    + (float(rng.normal()) if rng.random() < 0.2 else 0.0),
          "valid": bool(rng.random() > 0.2),
          "values": rng.normal(size=(len(ids), 3)) * 3.0})
  order = rng.permutation(len(turns))  # rows of a trajectory anywhere in the batch
  return [turns[i] for i in order]


def project(turns, opt: HaeOptions):
  """The project's path; returns (RowBatch fields, estimator output, read-out positions)."""
  rows, readouts = [], []
  for t in turns:
    pieces = [TOK.decode(i) for i in t["ids"]]
    parsed = hiper.parse_response("".join(pieces))
    tags = hiper.token_tags(pieces)
    pos = hae.value_readout(tags)
    readouts.append(pos)
    values = {h: float(t["values"][p, k]) for k, (h, p) in enumerate(zip(hae.HEADS, pos))}
    rows.append({"traj": t["traj"], "step": t["turn"], "switch": parsed.switch,
                 "subgoal": parsed.subgoal, "values": values, "token_tags": tags,
                 "response_ids": t["ids"]})
  num_tokens = max(len(t["ids"]) for t in turns)
  fields = hae.hae_fields_from_dump(rows, num_tokens=num_tokens)
  n = len(turns)
  fields.update(
      mask=np.ones(n, bool), traj=np.array([t["traj"] for t in turns], np.int32),
      step=np.array([t["turn"] for t in turns], np.int32),
      reward=np.array([t["reward"] for t in turns], np.float32),
      done=np.array([t["done"] for t in turns]), action_valid=np.array([t["valid"] for t in turns]),
      score=np.zeros(n, np.float32))
  return fields, hae.hae(ref.row_batch(fields), opt), readouts


def released_config(opt: HaeOptions) -> released_hae.Config:
  """ray_trainer.py lines 1366-1386 with the project's option values."""
  return released_hae.Config(
      gamma=opt.gamma, lam_turn=opt.lambda_turn, lam_seg=opt.lambda_seg, norm_adv=opt.norm_adv,
      bootstrap_truncated=opt.bootstrap_truncated, keep_penalty=opt.keep_penalty,
      keep_penalty_mode={"normalised": "normalized", "fixed": "fixed"}[opt.keep_penalty_mode],
      invalid_action_penalty_coef=opt.invalid_penalty,
      keep_consistency_penalty=opt.keep_consistency_penalty)


CONFIG_OPTIONS = {  # configs/common.py: PUBLISHED_SETTINGS[env] with the config's eta 0.1
    **{env: HaeOptions(invalid_penalty=0.1, **hae.PUBLISHED_SETTINGS[env])
       for env in ("alfworld", "webshop", "sokoban")},
    "defaults": HaeOptions(),
    "fixed_discounted_raw": HaeOptions(gamma=0.95, lambda_turn=0.9, lambda_seg=0.8, keep_penalty=-0.4,
                                       keep_penalty_mode="fixed", keep_consistency_penalty=-0.2,
                                       norm_adv=False, invalid_penalty=0.3),
}


@pytest.mark.parametrize("name", sorted(CONFIG_OPTIONS))
def test_equals_the_released_code_on_random_malformed_batches(name):
  opt = CONFIG_OPTIONS[name]
  rng = np.random.default_rng(sorted(CONFIG_OPTIONS).index(name))
  turns = random_turns(rng)
  fields, out, readouts = project(turns, opt)
  want = released_hae.compute(turns, TOK.decode, released_config(opt))
  token_adv, loss_mask = np.asarray(out.token_advantage), np.asarray(out.loss_mask)
  targets = {h: np.asarray(out.value_targets[h]) for h in hae.HEADS}
  for i, (t, w) in enumerate(zip(turns, want)):
    n = len(t["ids"])
    np.testing.assert_array_equal(loss_mask[i, :n], w["loss_mask"], err_msg=f"row {i}")
    assert not loss_mask[i, n:].any()
    # float32 kernel vs float64 loops; whitened values are O(1).
    np.testing.assert_allclose(token_adv[i, :n], w["token_adv"], rtol=1e-4, atol=1e-4, err_msg=f"row {i}")
    assert bool(out.value_targets["high_mask"][i]) == w["boundary"]
    for k, h in enumerate(hae.HEADS):
      pos, target = w["returns"][h]
      if pos is None:
        continue
      assert readouts[i][k] == pos, (i, h)
      assert targets[h][i] == pytest.approx(target, rel=1e-4, abs=1e-4), (i, h)

  # The batch holds every case the conventions differ on.
  tags = fields["token_tags"]
  first = fields["step"] == 0
  assert (first & ~fields["segment_start"]).sum() > 5  # KEEP (or no switch) at turn 0
  assert (tags >= hae.TAG_SWITCH_SUBGOAL).sum() > 20  # tokens in two blocks
  no_action = ~hae.tag_in(tags, hae.TAG_ACTION).any(axis=1)
  assert no_action.sum() > 10  # missing or unclosed <action>
  # KEEP turns whose stripped subgoal text equals the previous one but whose ids differ.
  by_key = {(t["traj"], t["turn"]): i for i, t in enumerate(turns)}
  parsed = [hiper.parse_response("".join(TOK.decode(x) for x in t["ids"])) for t in turns]
  subtle = [i for i, t in enumerate(turns) if t["turn"] > 0 and fields["subgoal_changed"][i]
            and parsed[i].subgoal is not None
            and parsed[i].subgoal == parsed[by_key[t["traj"], t["turn"] - 1]].subgoal]
  assert len(subtle) > 3


def test_fixture_tokenizer_makes_straddling_tokens():
  rng = np.random.default_rng(0)
  text = "<switch>KEEP</switch><subgoal>find apple</subgoal><action>look</action>"
  seen = set()
  for _ in range(50):
    pieces = [TOK.decode(i) for i in TOK.encode(text, rng)]
    assert "".join(pieces) == text
    seen.update(t for t in hiper.token_tags(pieces) if t >= hae.TAG_SWITCH_SUBGOAL)
  assert {hae.TAG_SWITCH_SUBGOAL, hae.TAG_SUBGOAL_ACTION} <= seen


def test_project_conventions_differ_from_the_released_ones():
  """The options that keep the project's earlier conventions change the numbers on the
  same batch (so the equivalence above is not vacuous for them)."""
  rng = np.random.default_rng(1)
  turns = random_turns(rng, num_traj=30)
  base = HaeOptions(invalid_penalty=0.1, **hae.PUBLISHED_SETTINGS["alfworld"])
  _, released, _ = project(turns, base)
  for change in (dict(first_turn_keep="exempt"), dict(missing_action="rest")):
    _, other, _ = project(turns, dataclasses.replace(base, **change))
    assert not np.allclose(np.asarray(released.token_advantage), np.asarray(other.token_advantage)), change


def test_critic_readout_of_multi_block_codes():
  pieces = ["<switch>", "KEEP", "</switch>", "<subgoal>", "find", "</subgoal", "><", "action", ">",
            "look", "</action>"]
  tags = hiper.token_tags(pieces)
  assert tags[6] == hae.TAG_SUBGOAL_ACTION
  released_low = released_hae.value_positions({"ids": list(range(len(pieces)))},
                                              lambda i: pieces[i], True)[0]
  assert released_low == 7 and hae.value_readout(tags) == (7, 0, 0)
  assert critic.hiper_readout(tags)[0] == released_low


def test_value_readout_equals_critic_readout_on_every_code():
  rng = np.random.default_rng(2)
  for _ in range(500):
    tags = rng.integers(0, 8, size=int(rng.integers(1, 12)))
    assert hae.value_readout(tags) == critic.hiper_readout(tags)


# ------------------------------------------------------------------ the trainer's path
def step_rows(turns):
  """Rollout StepRows of the turns, as `rollout.collect` builds them for "hiper"."""
  rows = []
  for t in turns:
    pieces = [TOK.decode(i) for i in t["ids"]]
    parsed = hiper.parse_response("".join(pieces))
    rows.append(rollout.StepRow(
        group=t["traj"], traj=t["traj"], step=t["turn"], task_id="t", task_type="pick",
        anchor_obs=f"o{t['turn']}", prompt_ids=[1], response_ids=list(t["ids"]),
        response="".join(pieces), action="", valid=t["valid"], reward=t["reward"], done=t["done"],
        switch=parsed.switch, subgoal=parsed.subgoal, token_tags=hiper.token_tags(pieces)))
  return rows


def trainer_targets(turns, opt: HaeOptions, prompt_len=2):
  """`value_targets.critic_targets` (what train.py's `critic_advantages` calls) on critic
  values laid out on the training batch columns: token j of a response at P + j."""
  num_tokens = max(len(t["ids"]) for t in turns)
  values = np.zeros((len(turns), prompt_len + num_tokens, 3), np.float32)
  for i, t in enumerate(turns):
    values[i, prompt_len:prompt_len + len(t["ids"])] = t["values"]
  rows = step_rows(turns)
  return value_targets.critic_targets(
      rows, rollout.advantage_columns(rows), registry.get("hae"), opt, values,
      prompt_len=prompt_len, num_tokens=num_tokens, gamma=opt.gamma,
      invalid_penalty=opt.invalid_penalty, capacity=512)


def turn(traj, step, pieces, values, reward=0.0, done=False):
  return {"traj": traj, "turn": step, "ids": [TOK.ids[p] for p in pieces], "done": done,
          "reward": reward, "valid": True, "values": np.asarray(values, np.float64)}


@pytest.mark.parametrize("name", ["alfworld", "fixed_discounted_raw"])
def test_trainer_path_equals_the_released_code_on_random_malformed_batches(name):
  """The same random batches through the trainer's critic path: read-out positions, value
  targets, token advantages and loss masks equal the released code's."""
  opt = CONFIG_OPTIONS[name]
  rng = np.random.default_rng(10 + sorted(CONFIG_OPTIONS).index(name))
  turns = random_turns(rng)
  out = trainer_targets(turns, opt)
  want = released_hae.compute(turns, TOK.decode, released_config(opt))
  for i, (t, w) in enumerate(zip(turns, want)):
    n = len(t["ids"])
    np.testing.assert_array_equal(out.loss_mask[i, :n], w["loss_mask"], err_msg=f"row {i}")
    np.testing.assert_allclose(out.token_advantage[i, :n], w["token_adv"], rtol=1e-4, atol=1e-4,
                               err_msg=f"row {i}")
    regressed = np.zeros((out.value_mask.shape[1], 3), bool)
    for k, h in enumerate(hae.HEADS):
      pos, target = w["returns"][h]
      if pos is None:
        continue
      regressed[pos, k] = True
      assert out.returns[i, pos, k] == pytest.approx(target, rel=1e-4, abs=1e-4), (i, h)
      assert out.old_values[i, pos, k] == np.float32(t["values"][pos, k]), (i, h)
    np.testing.assert_array_equal(out.value_mask[i], regressed, err_msg=f"row {i}")
  tags = out.fields["token_tags"]
  assert (tags == hae.TAG_SUBGOAL_ACTION).sum() > 10  # the "><" read-out case is exercised


def test_trainer_reads_v_low_after_a_straddling_token():
  """SmolLM2 writes "</subgoal><action>" as "</", "sub", "goal", "><", ...: the "><" closes
  the subgoal, so V_low is read at the token after it (released position 8), not on it (7,
  where comparing codes with == would read). Two turns [SWITCH, KEEP], reward 10 at the end
  (done), gamma = lambda = 1, no whitening: V_low = [2, 3] at column 8 and 99 at column 7.
  A_low(1) = 10 - 3 = 7, A_low(0) = 0 + 3 - 2 + 7 = 8, ret_low = [10, 10]."""
  pieces = [["<switch>", sw, "</switch>", "<subgoal>", "find", "</", "subgoal", "><", "action",
             ">", "look", "</action>"] for sw in ("SWITCH", "KEEP")]
  turns = []
  for step, v_low in enumerate((2.0, 3.0)):
    values = np.zeros((12, 3))
    values[7, hae.HEAD_LOW], values[8, hae.HEAD_LOW] = 99.0, v_low
    turns.append(turn(0, step, pieces[step], values, reward=10.0 * step, done=step == 1))
  released_low = released_hae.value_positions(turns[0], TOK.decode, True)[0]
  assert released_low == 8
  out = trainer_targets(turns, HaeOptions(norm_adv=False))
  assert list(out.fields["token_tags"][0, 6:9]) == [
      hae.TAG_SUBGOAL, hae.TAG_SUBGOAL_ACTION, hae.TAG_ACTION]
  np.testing.assert_array_equal(out.fields["values"][:, hae.HEAD_LOW], [2.0, 3.0])
  np.testing.assert_allclose(out.advantage, [8.0, 7.0], atol=1e-6)
  for i in range(2):
    assert np.flatnonzero(out.value_mask[i, :, hae.HEAD_LOW]).tolist() == [released_low]
    assert out.returns[i, released_low, hae.HEAD_LOW] == pytest.approx(10.0, abs=1e-6)
    assert out.old_values[i, released_low, hae.HEAD_LOW] == [2.0, 3.0][i]
    np.testing.assert_allclose(out.token_advantage[i, 8:], [8.0, 7.0][i], atol=1e-6)  # action


def test_trainer_penalises_a_keep_subgoal_with_equal_text_and_other_token_ids():
  """Turn 1 (KEEP) writes the subgoal "find apple" as "find", " ", "apple" after turn 0's
  "find", " apple": equal as stripped text, different token ids. Released (token ids) it
  changed, so it pays keep_consistency_penalty -0.3: r = [0, 10 - 0.3], zero values, gamma
  = 1, no whitening -> A_low = [9.7, 9.7]. Comparing text would give [10, 10]."""
  head = ["<switch>", "SWITCH", "</switch>", "<subgoal>", "find", " apple", "</subgoal>"]
  keep = ["<switch>", "KEEP", "</switch>", "<subgoal>", "find", " ", "apple", "</subgoal>"]
  tail = ["<action>", "look", "</action>"]
  turns = [turn(0, 0, head + tail, np.zeros((10, 3))),
           turn(0, 1, keep + tail, np.zeros((11, 3)), reward=10.0, done=True)]
  opt = HaeOptions(norm_adv=False, keep_consistency_penalty=-0.3)
  out = trainer_targets(turns, opt)
  rows = step_rows(turns)
  assert rows[0].subgoal == rows[1].subgoal == "find apple" and rows[1].switch == "KEEP"
  np.testing.assert_array_equal(out.fields["subgoal_changed"], [False, True])
  np.testing.assert_allclose(out.advantage, [9.7, 9.7], atol=1e-5)
  np.testing.assert_allclose(out.returns[:, 7, hae.HEAD_LOW], [9.7, 0.0], atol=1e-5)
  np.testing.assert_allclose(out.returns[1, 8, hae.HEAD_LOW], 9.7, atol=1e-5)
  want = released_hae.compute(turns, TOK.decode, released_config(opt))
  np.testing.assert_allclose([w["returns"]["low"][1] for w in want], [9.7, 9.7], atol=1e-6)
  # The rollout dump carries the ids, so the command line compares them too.
  records = [dict(r.dump_record(), values=dict.fromkeys(hae.HEADS, 0.0)) for r in rows]
  np.testing.assert_array_equal(hae.hae_fields_from_dump(records)["subgoal_changed"], [False, True])
  text = hae.hae_fields_from_dump(records, subgoal_compare="text")["subgoal_changed"]
  np.testing.assert_array_equal(text, [False, False])
