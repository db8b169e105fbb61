"""The project's HiPER path equals the released code's (JonP07/HiPER-agent@9d3c118).

Project path: `hiper.parse_response` (switch) -> `hiper.token_tags` (per-token blocks) ->
`hae.value_readout` (where the three values are read) ->
`hae.hae_fields_from_dump` (switch flags, token-id consistency) -> `hae.hae` (advantages,
token routing, value targets). Released path: `released_hae.compute`, a float64
transcription of hier_mask.py + core_hae.py in ray_trainer.py's order. Random batches of
malformed responses tokenized by a fixture tokenizer whose pieces straddle block
boundaries; every option combination the configs use (docs/algorithms.md §8).
"""

import dataclasses

import numpy as np
import pytest

import released_hae
from hgpo_jax.advantages import hae
from hgpo_jax.advantages import hae_reference as ref
from hgpo_jax.advantages.hae import HaeOptions
from hgpo_jax.models import critic
from hgpo_jax.rollout import hiper

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


@pytest.mark.xfail(strict=True, reason="models/critic.py hiper_readout compares codes with ==, so a "
                   "token that straddles </subgoal> and <action> (TAG_SUBGOAL_ACTION) is not a "
                   "subgoal token for it; it should return hae.value_readout(tags)")
def test_critic_readout_of_multi_block_codes():
  pieces = ["<switch>", "KEEP", "</switch>", "<subgoal>", "find", "</subgoal", "><", "action", ">",
            "look", "</action>"]
  tags = hiper.token_tags(pieces)
  assert tags[6] == hae.TAG_SUBGOAL_ACTION
  released_low = released_hae.value_positions({"ids": list(range(len(pieces)))},
                                              lambda i: pieces[i], True)[0]
  assert released_low == 7 and hae.value_readout(tags) == (7, 0, 0)
  assert critic.hiper_readout(tags)[0] == released_low


def test_value_readout_equals_critic_readout_on_single_block_codes():
  rng = np.random.default_rng(2)
  for _ in range(500):
    tags = rng.integers(0, 4, size=int(rng.integers(1, 12)))
    assert hae.value_readout(tags) == critic.hiper_readout(tags)
