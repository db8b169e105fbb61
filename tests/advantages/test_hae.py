"""HiPER HAE (docs/algorithms.md §8): golden example §11.5, equivalence with the loop reference,
invariances, sharding and compilation caching."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hgpo_jax.advantages import hae
from hgpo_jax.advantages import hae_reference as ref
from hgpo_jax.advantages import registry
from hgpo_jax.advantages import segments
from hgpo_jax.advantages.hae import HaeOptions

GOLDEN_SETTINGS = [
    # (gamma, lambda_turn, lambda_seg), A_low(t=0..4), (A_high(0), A_high(3)), ret_term(t=0..4)
    ((1.0, 1.0, 0.95), [2.9, 1.9, 0.9, 4.0, 2.0], [8.15, 5.0],
     # segment 1: -0.1 + V_high(3)=5 from every turn; segment 2 ends done with 10.
     [4.9, 4.9, 4.9, 10.0, 10.0]),
    ((0.95, 0.95, 0.95), [2.101429, 1.386625, 0.65, 3.405, 2.0], [6.361903, 4.5],
     # t2: -0.1 + .95*5 = 4.65; t1: .95*4.65; t0: .95^2*4.65; t3: .95*10; t4: 10.
     [4.196625, 4.4175, 4.65, 9.5, 10.0]),
]


# Shared by the invariance, sharding and caching tests so that they reuse one compilation.
SMALL_CAPACITY = 256
SMALL_OPTIONS = HaeOptions(keep_penalty=-0.5, keep_consistency_penalty=-0.3)


def golden_fields():
  """docs/algorithms.md §11.5: switches [start, KEEP, KEEP, SWITCH, KEEP], turn 2 invalid, done at t4."""
  n = 5
  return {
      "mask": np.ones(n, bool), "traj": np.zeros(n, np.int32), "step": np.arange(n, dtype=np.int32),
      "reward": np.array([0, 0, 0, 0, 10], np.float32), "done": np.array([0, 0, 0, 0, 1], bool),
      "action_valid": np.array([1, 1, 0, 1, 1], bool), "score": np.zeros(n, np.float32),
      "segment_start": segments.segment_start_flags(range(n), ["SWITCH", "KEEP", None, "SWITCH", ""]),
      # columns: V_low, V_high (read at segment starts only), V_term
      "values": np.array([[2, 1.5, 0], [3, 0, 0], [4, 0, 0], [6, 5, 0], [8, 0, 0]], np.float32),
      "subgoal_changed": np.zeros(n, bool),
  }


@pytest.mark.parametrize("setting", GOLDEN_SETTINGS, ids=["scripts", "gamma0.95"])
def test_golden_example(setting):
  (gamma, lam_turn, lam_seg), a_low, a_high, ret_term = setting
  opt = HaeOptions(gamma=gamma, lambda_turn=lam_turn, lambda_seg=lam_seg)
  f = golden_fields()
  lv = hae.hae_levels(ref.row_batch(f), opt)
  np.testing.assert_allclose(lv.a_low, a_low, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(lv.a_high)[[0, 3]], a_high, rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(lv.a_high)[[1, 2, 4]], 0.0)
  np.testing.assert_allclose(lv.turn_reward, [0, 0, -0.1, 0, 10], rtol=1e-6)
  np.testing.assert_allclose(lv.ret_low, np.asarray(a_low) + f["values"][:, 0], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(lv.ret_high)[[0, 3]], np.asarray(a_high) + [1.5, 5.0], rtol=1e-5)
  np.testing.assert_allclose(lv.ret_term, ret_term, rtol=1e-5)
  np.testing.assert_allclose(lv.a_term, ret_term, rtol=1e-5)  # V_term = 0


def test_golden_example_from_dump():
  f = golden_fields()
  dump = [{"traj": "t1", "step": t, "switch": sw, "subgoal": "find mug",
           "values": {"low": float(v[0]), "high": float(v[1]), "term": float(v[2])}}
          for t, (sw, v) in enumerate(zip(["SWITCH", "KEEP", None, "SWITCH", ""], f["values"]))]
  fields = hae.hae_fields_from_dump(dump)
  np.testing.assert_array_equal(fields["segment_start"], [True, False, False, True, False])
  np.testing.assert_array_equal(fields["subgoal_changed"], False)
  np.testing.assert_array_equal(fields["values"], f["values"])
  lv = hae.hae_levels(ref.row_batch({**f, **fields}), HaeOptions())
  np.testing.assert_allclose(lv.a_low, GOLDEN_SETTINGS[0][1], rtol=1e-5)


def test_dump_subgoal_changed_only_on_keep_turns_with_both_subgoals():
  dump = [{"traj": 0, "step": s, "switch": sw, "subgoal": sg, "values": {"low": 0, "high": 0, "term": 0}}
          for s, (sw, sg) in enumerate([("SWITCH", "a"), ("KEEP", "b"), ("KEEP", None), ("KEEP", "c"),
                                        ("SWITCH", "d"), ("KEEP", " d ")])]
  fields = hae.hae_fields_from_dump(dump)
  np.testing.assert_array_equal(fields["segment_start"], [1, 0, 0, 0, 1, 0])
  np.testing.assert_array_equal(fields["subgoal_changed"], [0, 1, 0, 0, 0, 0])


def test_switch_parsing():
  assert [segments.switch_is_keep(s) for s in ["KEEP", " keep\n", "", None, "SWITCH", "Keep it", "switch"]] == [
      True, True, True, True, False, False, False]
  np.testing.assert_array_equal(
      segments.segment_start_flags([0, 1, 2, 0, 1], ["KEEP", "SWITCH", None, None, "x"]),
      [True, True, False, True, True])
  with pytest.raises(ValueError, match="3 steps but 2 switches"):
    segments.segment_start_flags([0, 1, 2], ["KEEP", "KEEP"])


def test_segment_table_matches_loop():
  rng = np.random.default_rng(0)
  f = ref.random_fields(rng, num_traj=40, max_turns=9, num_tokens=2, capacity=320)
  tab = segments.segment_table(jnp.asarray(f["traj"]), jnp.asarray(f["step"]), jnp.asarray(f["mask"]),
                               jnp.asarray(f["segment_start"]))
  expect = {k: np.full(len(f["mask"]), -1) for k in ("start", "end", "next_start")}
  seg_rows = []
  for t in sorted(ref.trajectories(f)):
    rows = ref.trajectories(f)[t]
    starts = [i for i, r in enumerate(rows) if i == 0 or f["segment_start"][r]]
    for k, s in enumerate(starts):
      e = starts[k + 1] - 1 if k + 1 < len(starts) else len(rows) - 1
      seg_rows.append(rows[s])
      for i in range(s, e + 1):
        expect["start"][rows[i]] = rows[s]
        expect["end"][rows[i]] = rows[e]
        expect["next_start"][rows[i]] = rows[e + 1] if e + 1 < len(rows) else -1
  for k, v in expect.items():
    np.testing.assert_array_equal(getattr(tab, k), v, err_msg=k)
  seg_id = np.asarray(tab.seg_id)
  assert sorted(seg_id[seg_rows]) == list(range(len(seg_rows)))  # dense, one per segment
  np.testing.assert_array_equal(seg_id, np.where(f["mask"], seg_id[np.maximum(expect["start"], 0)], -1))
  np.testing.assert_array_equal(tab.is_start, np.isin(np.arange(len(f["mask"])), seg_rows))


EQUIVALENCE_OPTIONS = {
    "defaults": HaeOptions(),
    "discounted_no_truncated_bootstrap": HaeOptions(gamma=0.95, lambda_turn=0.9, lambda_seg=0.8,
                                                    bootstrap_truncated=False),
    "fixed_keep_penalties": HaeOptions(gamma=0.97, keep_penalty=-0.3, keep_penalty_mode="fixed",
                                       keep_consistency_penalty=-0.3),
    "normalised_keep_penalty_raw": HaeOptions(keep_penalty=-3.5, keep_consistency_penalty=-0.2,
                                              norm_adv=False, invalid_penalty=0.5),
    "project_conventions": HaeOptions(keep_penalty=-0.3, keep_consistency_penalty=-0.3,
                                      first_turn_keep="exempt", missing_action="rest"),
    "fixed_exempt_first_turn": HaeOptions(keep_penalty=-0.3, keep_penalty_mode="fixed",
                                          first_turn_keep="exempt", norm_adv=False),
}


@pytest.mark.parametrize("name", sorted(EQUIVALENCE_OPTIONS))
def test_matches_reference_on_random_trajectories(name):
  opt = EQUIVALENCE_OPTIONS[name]
  rng = np.random.default_rng(sorted(EQUIVALENCE_OPTIONS).index(name))
  f = ref.random_fields(rng, num_traj=300, max_turns=12, num_tokens=12, capacity=2048)
  out = hae.hae(ref.row_batch(f), opt)
  expect = ref.hae(f, opt)
  np.testing.assert_allclose(out.advantage, expect["advantage"], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(out.token_advantage, expect["token_advantage"], rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(out.loss_mask, expect["loss_mask"])
  for head in ("low", "high", "term"):
    np.testing.assert_allclose(out.value_targets[head], expect["levels"][f"ret_{head}"], rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(out.value_targets["high_mask"], expect["levels"]["segment_start"])
  # The random batch exercises every branch the options can reach.
  assert f["segment_start"][f["mask"] & (f["step"] > 0)].any()
  assert (f["mask"] & (f["step"] == 0) & ~f["segment_start"]).any()  # KEEP at turn 0
  assert (f["token_tags"] >= hae.TAG_SWITCH_SUBGOAL).any()  # tokens in two blocks
  assert (f["mask"] & ~f["done"] & ~np.isin(f["traj"], f["traj"][f["done"]])).any()  # truncated trajs
  assert (f["mask"] & ~f["action_valid"]).any()


def test_without_token_tags_whitens_per_level_over_rows():
  rng = np.random.default_rng(7)
  f = ref.random_fields(rng, num_traj=50, max_turns=8, num_tokens=4, capacity=512)
  f["token_tags"] = None
  out = hae.hae(ref.row_batch(f), HaeOptions())
  expect = ref.hae(f, HaeOptions())
  assert out.token_advantage is None and out.loss_mask is None
  np.testing.assert_allclose(out.advantage, expect["advantage"], rtol=1e-4, atol=1e-5)
  adv = np.asarray(out.advantage)[f["mask"]]
  assert abs(adv.mean()) < 1e-5 and abs(adv.std() - 1.0) < 1e-4


@pytest.mark.parametrize("missing_action", ["whole_response", "rest"])
def test_token_routing_hand_example(missing_action):
  f = golden_fields()
  f["values"][:, 2] = [1, 2, 3, 4, 5]
  s, g, a, o = hae.TAG_SWITCH, hae.TAG_SUBGOAL, hae.TAG_ACTION, hae.TAG_OTHER
  f["token_tags"] = np.array([[s, g, g, a, a, o],     # start turn: all three spans
                              [s, g, a, a, o, o],     # KEEP turn: subgoal tokens get nothing
                              [s, g, g, o, o, o],     # no action tag: see missing_action
                              [g, g, a, o, o, o],     # start turn without a switch tag
                              [a, a, a, a, a, a]], np.int8)
  f["response_mask"] = np.array([[1] * 6, [1] * 6, [1] * 5 + [0], [1] * 3 + [0] * 3, [1] * 6], bool)
  out = hae.hae(ref.row_batch(f), HaeOptions(norm_adv=False, missing_action=missing_action))
  lo, hi, te = [2.9, 1.9, 0.9, 4.0, 2.0], {0: 8.15, 3: 5.0}, np.array([4.9, 4.9, 4.9, 10, 10]) - [1, 2, 3, 4, 5]
  # Row 2 (KEEP, no action): "whole_response" puts A_low on every token, summed with A_term
  # on the switch token (released); "rest" gives A_low to the non-switch tokens only.
  switch_2 = te[2] + lo[2] if missing_action == "whole_response" else te[2]
  expect = np.array([[te[0], hi[0], hi[0], lo[0], lo[0], 0],
                     [te[1], 0, lo[1], lo[1], 0, 0],
                     [switch_2, lo[2], lo[2], lo[2], lo[2], 0],
                     [hi[3], hi[3], lo[3], 0, 0, 0],
                     [lo[4]] * 6])
  np.testing.assert_allclose(out.token_advantage, expect, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out.loss_mask, [[1, 1, 1, 1, 1, 0], [1, 0, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0],
                                                [1, 1, 1, 0, 0, 0], [1] * 6])


@pytest.mark.parametrize("bootstrap_truncated", [True, False])
def test_single_segment_low_level_is_plain_gae(bootstrap_truncated):
  # Two one-segment trajectories of 9 turns: trajectory 0 ends done, trajectory 1 is truncated.
  rng = np.random.default_rng(3)
  n = 9
  f = ref.random_fields(rng, num_traj=1, max_turns=1, num_tokens=1)  # template, then overwrite
  f = {k: np.repeat(v[:1], 2 * n, axis=0) for k, v in f.items()}
  f["traj"] = np.repeat([0, 1], n).astype(np.int32)
  f["step"] = np.tile(np.arange(n), 2).astype(np.int32)
  f["segment_start"] = np.zeros(2 * n, bool)  # only turn 0 (forced) starts a segment
  f["subgoal_changed"] = np.zeros(2 * n, bool)
  f["done"] = np.zeros(2 * n, bool)
  f["done"][n - 1] = True
  f["action_valid"][:] = True
  f["reward"] = rng.normal(size=2 * n).astype(np.float32)
  f["values"] = rng.normal(size=(2 * n, 3)).astype(np.float32)
  opt = HaeOptions(gamma=0.9, lambda_turn=0.8, bootstrap_truncated=bootstrap_truncated, norm_adv=False)
  lv = hae.hae_levels(ref.row_batch(f), opt)
  for traj, done in ((0, True), (1, False)):
    rows = slice(traj * n, (traj + 1) * n)
    reward, values = f["reward"][rows].tolist(), f["values"][rows]
    truncated_boot = bootstrap_truncated and not done
    boot = values[-1, 0] if truncated_boot else 0.0
    expect = ref.gae_tokens(reward, values[:, 0].tolist(), 0.9, 0.8, next_value=boot)
    np.testing.assert_allclose(np.asarray(lv.a_low)[rows], expect, rtol=1e-5, atol=1e-5)
    # One segment: A_high(0) = sum gamma^t r_t + gamma^n B - V_high(0), with B = V_high(0) if truncated.
    boot_high = values[0, 1] if truncated_boot else 0.0
    g = sum(0.9 ** t * reward[t] for t in range(n)) + 0.9 ** n * boot_high - values[0, 1]
    np.testing.assert_allclose(np.asarray(lv.a_high)[rows], [g] + [0] * (n - 1), rtol=1e-5, atol=1e-5)


def test_permuting_trajectories_and_padding_does_not_matter():
  rng = np.random.default_rng(11)
  capacity = SMALL_CAPACITY
  f = ref.random_fields(rng, num_traj=30, max_turns=8, num_tokens=6, capacity=capacity, shuffle=False)
  n = int(f["mask"].sum())  # real rows first, zero padding after them
  opt = SMALL_OPTIONS
  base = hae.hae(ref.row_batch(f), opt)
  # Relabel trajectories, permute rows, fill padding rows with garbage at random places.
  relabel = rng.permutation(30).astype(np.int32)
  perm = rng.permutation(capacity)  # perm[i] = source of row i; sources >= n are padding
  g = {}
  for k, v in f.items():
    garbage = (rng.normal(size=v.shape) * 5).astype(v.dtype)
    g[k] = np.where(np.arange(capacity).reshape((-1,) + (1,) * (v.ndim - 1)) < n, v, garbage)[perm]
  g["mask"] = perm < n
  g["traj"] = np.where(g["mask"], relabel[np.minimum(g["traj"], 29).clip(0)], rng.integers(0, capacity, capacity))
  g["traj"] = g["traj"].astype(np.int32)
  g["step"] = np.abs(g["step"]).astype(np.int32)
  out = hae.hae(ref.row_batch(g), opt)
  real = np.flatnonzero(g["mask"])
  src = perm[real]
  np.testing.assert_allclose(np.asarray(out.advantage)[real], np.asarray(base.advantage)[src], rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out.token_advantage)[real], np.asarray(base.token_advantage)[src],
                             rtol=1e-5, atol=1e-5)
  for k in ("low", "high", "term"):
    np.testing.assert_allclose(np.asarray(out.value_targets[k])[real], np.asarray(base.value_targets[k])[src],
                               rtol=1e-5, atol=1e-5)
  pad = ~g["mask"]
  assert not np.asarray(out.loss_mask)[pad].any()
  np.testing.assert_array_equal(np.asarray(out.advantage)[pad], 0.0)


def _shard_batch(batch, mesh):
  def put(x):
    if x is None:
      return None
    spec = P(None, "data") if x.ndim == 2 and x.shape[0] != batch.capacity else P("data")
    return jax.device_put(x, NamedSharding(mesh, spec))
  return jax.tree.map(put, batch)


def test_sharded_equals_unsharded():
  # all devices of the process (8 by default; the reduction-order variations use 4 and 16)
  mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(5)
  f = ref.random_fields(rng, num_traj=30, max_turns=8, num_tokens=6, capacity=SMALL_CAPACITY)
  batch = ref.row_batch(f)
  opt = SMALL_OPTIONS
  plain = hae.hae(batch, opt)
  sharded_batch = _shard_batch(batch, mesh)
  assert len(sharded_batch.token_tags.sharding.device_set) == jax.device_count() > 1
  sharded = hae.hae(sharded_batch, opt)
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(sharded)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_second_batch_of_same_capacity_does_not_recompile():
  rng = np.random.default_rng(9)
  sizes = []
  for _ in range(3):
    f = ref.random_fields(rng, num_traj=int(rng.integers(5, 30)), max_turns=8, num_tokens=6,
                          capacity=SMALL_CAPACITY)
    jax.block_until_ready(hae.hae(ref.row_batch(f), SMALL_OPTIONS))
    sizes.append(hae.hae._cache_size())
  assert sizes[1] == sizes[0] and sizes[2] == sizes[0]


def test_bad_input_raises_clear_errors():
  f = golden_fields()
  with pytest.raises(ValueError, match="keep_penalty_mode"):
    HaeOptions(keep_penalty_mode="ratio")
  with pytest.raises(ValueError, match="first_turn_keep='x'"):
    HaeOptions(first_turn_keep="x")
  with pytest.raises(ValueError, match="missing_action"):
    HaeOptions(missing_action="none")
  with pytest.raises(ValueError, match="segment_start"):
    hae.hae(ref.row_batch({**f, "segment_start": None}), HaeOptions())
  with pytest.raises(ValueError, match=r"values f32\[R, 3\]"):
    hae.hae(ref.row_batch({**f, "values": f["values"][:, :2]}), HaeOptions())
  with pytest.raises(ValueError, match="subgoal_changed"):
    hae.hae(ref.row_batch({**f, "subgoal_changed": None}), HaeOptions(keep_consistency_penalty=-0.3))
  with pytest.raises(ValueError, match="lacks `values`"):
    hae.hae_fields_from_dump([{"traj": 0, "step": 0, "switch": "KEEP"}])


def test_registered_with_published_defaults():
  est = registry.get("hae")
  assert est.needs_critic and est.options_cls is HaeOptions
  opt = est.options()
  assert (opt.gamma, opt.lambda_turn, opt.lambda_seg, opt.norm_adv) == (1.0, 1.0, 0.95, True)
  assert dataclasses.asdict(est.options(**hae.PUBLISHED_SETTINGS["webshop"]))["bootstrap_truncated"] is False


def test_cli_recomputes_hae_from_dump(tmp_path, capsys):
  import json
  from hgpo_jax.advantages import __main__ as cli

  f = golden_fields()
  # Turn 3 has no action tokens: released, its whole response carries A_low (so every
  # turn is in the whitening set); --missing-action rest leaves it out.
  tags = [[1, 3], [3], [3, 3, 0], [2], [3]]
  lines = [{"group": "g", "traj": "t1", "step": t, "anchor_obs": f"o{t}", "reward": float(f["reward"][t]),
            "valid": bool(f["action_valid"][t]), "done": bool(f["done"][t]), "switch": sw, "subgoal": "s",
            "values": dict(zip(hae.HEADS, map(float, f["values"][t]))), "token_tags": tags[t]}
           for t, sw in enumerate(["SWITCH", "KEEP", None, "SWITCH", ""])]
  path = tmp_path / "dump.jsonl"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines[::-1]))  # any row order
  a_low = np.array([2.9, 1.9, 0.9, 4.0, 2.0])
  for flags, carries in (([], [1, 1, 1, 1, 1]), (["--missing-action", "rest"], [1, 1, 1, 0, 1])):
    assert cli.main([str(path), "--estimator", "hae"] + flags) == 0
    out = capsys.readouterr().out.splitlines()
    got = {json.loads(line)["step"]: json.loads(line)["advantage"] for line in out}
    carries = np.array(carries, bool)
    expect = np.where(carries, (a_low - a_low[carries].mean()) / (a_low[carries].std() + 1e-8), 0.0)
    np.testing.assert_allclose([got[t] for t in range(5)], expect, rtol=1e-5, atol=1e-6)


def test_cli_gamma_and_invalid_penalty_reach_hae(tmp_path, capsys):
  """--gamma / --invalid-penalty set hae's own options, not only the return column's:
  golden example, setting gamma = lambda = 0.95, before whitening."""
  import json
  from hgpo_jax.advantages import __main__ as cli

  f = golden_fields()
  lines = [{"group": "g", "traj": "t1", "step": t, "anchor_obs": f"o{t}", "reward": float(f["reward"][t]),
            "valid": bool(f["action_valid"][t]), "done": bool(f["done"][t]), "switch": sw, "subgoal": "s",
            "values": dict(zip(hae.HEADS, map(float, f["values"][t])))}
           for t, sw in enumerate(["SWITCH", "KEEP", None, "SWITCH", ""])]
  path = tmp_path / "dump.jsonl"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  base = [str(path), "--estimator", "hae", "--norm-adv", "false", "--lambda-turn", "0.95"]
  assert cli.main(base + ["--gamma", "0.95"]) == 0
  got = [json.loads(line)["advantage"] for line in capsys.readouterr().out.splitlines()]
  np.testing.assert_allclose(got, GOLDEN_SETTINGS[1][1], rtol=1e-5)
  # eta 0.5 instead of 0.1 at the invalid turn 2: A_low(2) = -0.5 + 5 - 4 = 0.5, and
  # with gamma = lambda_turn = 1, A_low(1) = 1 + 0.5, A_low(0) = 1 + 1.5.
  assert cli.main([str(path), "--estimator", "hae", "--norm-adv", "false", "--invalid-penalty", "0.5"]) == 0
  got = [json.loads(line)["advantage"] for line in capsys.readouterr().out.splitlines()]
  np.testing.assert_allclose(got, [2.5, 1.5, 0.5, 4.0, 2.0], rtol=1e-5)
  # A KEEP at turn 0 pays the keep penalty (released) unless --first-turn-keep exempt.
  lines[0]["switch"] = "KEEP"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  for flags, a0 in (([], 2.9 - 0.5), (["--first-turn-keep", "exempt"], 2.9)):
    assert cli.main([str(path), "--estimator", "hae", "--norm-adv", "false", "--keep-penalty", "-0.5",
                     "--keep-penalty-mode", "fixed"] + flags) == 0
    got = [json.loads(line)["advantage"] for line in capsys.readouterr().out.splitlines()]
    assert got[0] == pytest.approx(a0 - 0.5 * 2, rel=1e-5)  # turns 1 and 2 are KEEP turns too


def test_tag_codes_name_block_sets():
  blocks = (hae.TAG_SWITCH, hae.TAG_SUBGOAL, hae.TAG_ACTION)
  for code in range(8):
    member = [bool(hae.tag_in(np.array([code]), b)[0]) for b in blocks]
    assert hae.tag_code(*member) == code
  assert hae.tag_code(False, True, True) == hae.TAG_SUBGOAL_ACTION == 5
  # codes 0-3 keep their single-block meaning; out-of-range codes are in no block
  np.testing.assert_array_equal(hae.tag_in(jnp.array([0, 3, 5, 7, 9, -1], jnp.int8), hae.TAG_ACTION),
                                [False, True, True, True, False, False])
