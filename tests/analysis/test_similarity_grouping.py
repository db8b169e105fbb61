"""GiGPO's similarity grouping equals the published greedy difflib rule; time-aware keys."""

import difflib

import numpy as np
import pytest

from hgpo_jax.advantages import build_row_batch
from hgpo_jax.advantages import GroupingError
from hgpo_jax.advantages import registry
from hgpo_jax.advantages import similarity


def published_rule(texts, thresh):
  """verl-agent build_step_group(enable_similarity=True) for one uid group, restated."""
  clusters = []  # [rep, [positions]]
  for i, obs in enumerate(texts):
    for cluster in clusters:
      if difflib.SequenceMatcher(None, obs, cluster[0]).ratio() >= thresh:
        cluster[1].append(i)
        break
    else:
      clusters.append([obs, [i]])
  return sorted(sorted(c[1]) for c in clusters)


def partition(ids):
  out = {}
  for i, c in enumerate(ids):
    out.setdefault(int(c), []).append(i)
  return sorted(out.values())


def random_texts(rng, n):
  """Near-duplicates of a few base texts (edits, long/short, >= 200 chars where
  difflib's autojunk applies), plus exact repeats."""
  alphabet = list("abcde fghij")
  bases = ["".join(rng.choice(alphabet, rng.integers(5, 260))) for _ in range(rng.integers(1, 6))]
  out = []
  for _ in range(n):
    t = list(bases[rng.integers(len(bases))])
    for _ in range(rng.integers(0, 4)):
      pos = rng.integers(0, len(t) + 1)
      op = rng.integers(3)
      if op == 0:
        t.insert(pos, str(rng.choice(alphabet)))
      elif op == 1 and pos < len(t):
        del t[pos]
      elif pos < len(t):
        t[pos] = str(rng.choice(alphabet))
    out.append("".join(t))
  return out


@pytest.mark.parametrize("thresh", [0.5, 0.8, 0.95])
def test_fast_clusters_equal_the_published_rule(thresh):
  rng = np.random.default_rng(int(thresh * 100))
  merged = 0
  for _ in range(25):
    texts = random_texts(rng, int(rng.integers(1, 30)))
    expected = published_rule(texts, thresh)
    assert partition(similarity.greedy_clusters(texts, thresh)) == expected
    merged += len(texts) - len(expected)
  assert merged > 50  # clusters are not all singletons


def test_library_reference_is_the_published_rule():
  rng = np.random.default_rng(7)
  for _ in range(10):
    texts = random_texts(rng, 20)
    assert partition(similarity.greedy_clusters_reference(texts, 0.8)) == published_rule(texts, 0.8)


def test_ratio_exactly_at_the_threshold_joins():
  """difflib ratio 2 * 6 / 15 = 0.8 exactly: >= joins (rapidfuzz's own score_cutoff
  would drop this pair; the fast matcher must not)."""
  texts = ["acdeh ch", "acdehcc"]
  assert difflib.SequenceMatcher(None, texts[1], texts[0]).ratio() == 0.8
  np.testing.assert_array_equal(similarity.greedy_clusters(texts, 0.8), [0, 0])


def test_cluster_ids_are_in_creation_order_and_memo_does_not_change_them():
  texts = ["the red room", "the red rooms", "a blue hall", "the red room", "a blue halls"]
  np.testing.assert_array_equal(similarity.greedy_clusters(texts, 0.9), [0, 0, 1, 0, 1])
  memo = {}
  for _ in range(2):
    np.testing.assert_array_equal(similarity.greedy_clusters(texts, 0.9, memo), [0, 0, 1, 0, 1])


def test_row_batch_similarity_groups_within_episode_groups_only():
  """Rows of two groups; the first row's representative decides (greedy, input order)."""
  obs = ["kitchen, a knife here", "kitchen, a knife here.", "garden", "kitchen, a knife here!",
         "kitchen, a knife here"]
  rows = dict(group=["g1", "g1", "g1", "g2", "g2"], traj=["a", "a", "b", "c", "d"],
              step=[0, 1, 0, 0, 0], anchor_obs=obs, reward=[0.0, 1.0, 0.0, 1.0, 0.0],
              valid=[True] * 5)
  g = build_row_batch(rows, similarity_thresh=0.95)
  anchor = g.to_input_order(g.batch.anchor_group)
  assert anchor[0] == anchor[1] and anchor[0] != anchor[2]
  assert anchor[3] == anchor[4] and anchor[3] != anchor[0]
  exact = build_row_batch(rows).to_input_order(build_row_batch(rows).batch.anchor_group)
  assert len(set(exact.tolist())) == 5


def test_gigpo_option_reaches_the_grouping():
  est = registry.get("gigpo")
  from hgpo_jax.advantages import grouping
  assert grouping.grouping_options(est.options()) == {}
  assert grouping.grouping_options(est.options(enable_similarity=True)) == {
      "similarity_thresh": 0.95}
  with pytest.raises(ValueError, match="must be in"):
    est.options(enable_similarity=True, similarity_thresh=1.0)


def test_similarity_needs_text():
  rows = dict(group=[0, 0], traj=[0, 1], step=[0, 0], anchor_obs=[1, 2], reward=[0.0, 1.0],
              valid=[True, True])
  with pytest.raises(GroupingError, match="needs text observations"):
    build_row_batch(rows, similarity_thresh=0.9)


def test_time_aware_keys():
  """One trajectory visits A at steps 0, 2 and 5 (horizon 6): remaining-step buckets of
  width 2 are (6-1-t)//2 = 2, 1, 0, so all three split; width 4 gives 1, 0, 0."""
  rows = dict(group=[0] * 6, traj=[0] * 6, step=list(range(6)),
              anchor_obs=["A", "B", "A", "B", "B", "A"], reward=[0.0] * 5 + [1.0],
              valid=[True] * 6)
  plain = build_row_batch(rows).to_input_order(build_row_batch(rows).batch.anchor_group)
  assert plain[0] == plain[2] == plain[5]
  g2 = build_row_batch(rows, horizon=6, time_bucket=2)
  a2 = g2.to_input_order(g2.batch.anchor_group)
  assert len({a2[0], a2[2], a2[5]}) == 3
  g4 = build_row_batch(rows, horizon=6, time_bucket=4)
  a4 = g4.to_input_order(g4.batch.anchor_group)
  assert a4[0] != a4[2] and a4[2] == a4[5]
  assert a4[3] == a4[4] and a4[1] != a4[3]  # B at t=1 (bucket 1) vs t=3,4 (bucket 0)
  with pytest.raises(GroupingError, match="beyond horizon"):
    build_row_batch(rows, horizon=5)


def test_cli_similarity_flags(tmp_path, capsys):
  """`python -m hgpo_jax.advantages --estimator gigpo --enable-similarity`: the two
  near-identical observations form one anchor group, so their step terms are
  +-(1 - 0) / 2 = +-0.5 (mean norm) instead of 0 for singletons."""
  import json
  from hgpo_jax.advantages import __main__ as cli
  rows = [dict(group="g", traj="a", step=0, anchor_obs="a red room, one door", reward=1.0,
               valid=True),
          dict(group="g", traj="b", step=0, anchor_obs="a red room, one door.", reward=0.0,
               valid=True)]
  path = tmp_path / "d.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  common = [str(path), "--estimator", "gigpo", "--norm", "mean", "--stats", "trajectories"]
  assert cli.main(common) == 0
  plain = [json.loads(line)["advantage"] for line in capsys.readouterr().out.splitlines()]
  assert cli.main(common + ["--enable-similarity", "--similarity-thresh", "0.9"]) == 0
  sim = [json.loads(line)["advantage"] for line in capsys.readouterr().out.splitlines()]
  np.testing.assert_allclose(np.subtract(sim, plain), [0.5, -0.5], rtol=1e-6)
  assert cli.main(common + ["--enable-similarity", "--similarity-thresh", "1.5"]) == 2
