"""`rollout.collect` with a scripted pool and sampler: an episode that ends in a terminal
state (`done`), one the env server truncates at its own step limit, and one cut by
collect's horizon (`max_steps`) are recorded apart, and the estimators treat them as
docs/algorithms.md §1 and §7 say (returns stop at the last recorded step either way; only
a terminal last turn never bootstraps)."""

import jax
import numpy as np
import pytest

import rollout_fakes
from env_servers import base
from hgpo_jax.advantages import gae
from hgpo_jax.advantages import grouping
from hgpo_jax.advantages import registry
from hgpo_jax.rollout import rollout
from hgpo_jax.rollout.params import RolloutParams
from hgpo_jax.rollout.tasks import Task

ACT = "<think>go</think><action>go north</action>"
ADM = ["go north", "look"]
GAMMA, LAM, ETA = 0.9, 0.8, 0.1

# slot -> [(observation, reward, done, truncated by the server), ...]; entry 0 is the reset.
EPISODES = [
    # slot 0: wins at its second step (terminal)
    [("s0", 0.0, False, False), ("s1", 0.0, False, False), ("won", 10.0, True, False)],
    # slot 1: the server's own step limit ends it after two steps (truncated)
    [("s0", 0.0, False, False), ("s1", 1.0, False, False), ("late", 0.0, True, True)],
    # slot 2: still running when collect's max_steps=3 is reached (truncated by the horizon)
    [("s0", 0.0, False, False), ("s1", 0.0, False, False), ("s2", 2.0, False, False),
     ("s3", 0.0, False, False)],
]


class _Pool(rollout_fakes.ScriptedPool):
  """ScriptedPool whose results carry the server's `truncated` flag as `SlotServer` sends it."""

  def _result(self, slot):
    obs, reward, done, truncated = self.episodes[slot][self.pos[slot]]
    info = {base.TRUNCATED: "true"} if truncated else {}
    return base.StepResult(observation=obs, anchor_obs=obs, admissible_actions=list(ADM),
                           reward=reward, done=done, won=done and not truncated, info=info)


@pytest.fixture(scope="module")
def collected():
  pool = _Pool(EPISODES)
  tok = rollout_fakes.CharTokenizer()
  smp = rollout_fakes.ScriptedSampler(tok, [ACT] * 7)  # 3 + 3 + 1 active slots
  ro = rollout.collect(pool, smp, tok, [Task("t0", "train", 0, 0)], 3, env_name="alfworld",
                       max_steps=3,
                       params=RolloutParams(history_length=2, max_prompt_tokens=100_000),
                       sampling=None, rng=jax.random.key(0))
  return ro, pool


def test_done_and_truncated_rows_are_recorded_apart(collected):
  ro, pool = collected
  assert [(r.traj, r.step, r.reward, r.done, r.won) for r in ro.rows] == [
      (0, 0, 0.0, False, False), (0, 1, 10.0, True, True),  # terminal
      (1, 0, 1.0, False, False), (1, 1, 0.0, False, False),  # server truncation: not done
      (2, 0, 0.0, False, False), (2, 1, 2.0, False, False), (2, 2, 0.0, False, False)]  # horizon
  np.testing.assert_array_equal(ro.lengths, [2, 2, 3])
  np.testing.assert_array_equal(ro.won, [True, False, False])
  np.testing.assert_array_equal(ro.returns, [10.0, 1.0, 2.0])
  # both ended episodes stop receiving actions; the horizon stops the last one
  assert pool.actions == [["go north"] * 3, ["go north"] * 3, [None, None, "go north"]]
  assert all(r.valid and r.action == "go north" for r in ro.rows)


def test_grouping_keeps_done_and_returns_stop_at_the_last_row(collected):
  ro, _ = collected
  grouped = grouping.build_row_batch(rollout.advantage_columns(ro.rows), gamma=GAMMA,
                                     invalid_penalty=ETA)
  np.testing.assert_array_equal(grouped.rejoin(ro.rows, grouped.batch.done),
                                [r.done for r in ro.rows])
  # R_t = r_t + gamma R_{t+1} over the recorded steps, whether the episode ended done or not
  # (docs/algorithms.md §1); float64 on the host, one float32 rounding: 1 ulp.
  want = [GAMMA * 10.0, 10.0, 1.0, 0.0, GAMMA * 2.0, 2.0, 0.0]
  np.testing.assert_allclose(grouped.rejoin(ro.rows, grouped.batch.returns), want, rtol=1.2e-7)


def _multi_turn_reference(rows, values, bootstrap_truncated):
  """Plain multi-turn GAE with one response token per turn (docs/algorithms.md §7)."""
  adv = np.zeros(len(rows))
  for traj in sorted({r.traj for r in rows}):
    idx = [i for i, r in enumerate(rows) if r.traj == traj]
    carry = 0.0
    for pos in reversed(range(len(idx))):
      i = idx[pos]
      if pos + 1 < len(idx):
        nxt = values[idx[pos + 1]]
      else:
        nxt = 0.0 if rows[i].done else (values[i] if bootstrap_truncated else 0.0)
      reward = rows[i].reward - ETA * (1 - rows[i].valid)
      carry = reward + GAMMA * nxt - values[i] + (GAMMA * LAM * carry if pos + 1 < len(idx) else 0.0)
      adv[i] = carry
  return adv


@pytest.mark.parametrize("bootstrap_truncated", [False, True])
def test_only_truncated_last_turns_bootstrap(collected, bootstrap_truncated):
  ro, _ = collected
  values = np.array([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5])
  records = [dict(r.dump_record(), token_values=[float(v)]) for r, v in zip(ro.rows, values)]
  grouped = grouping.build_row_batch(records, gamma=GAMMA, invalid_penalty=ETA,
                                     extra_fields=gae.gae_fields_from_dump(records))
  opts = gae.GaeOptions(gamma=GAMMA, lam=LAM, norm_adv=False, multi_turn=True,
                        invalid_penalty=ETA, bootstrap_truncated=bootstrap_truncated)
  out = registry.get("gae")(grouped.batch, opts)
  got = grouped.rejoin(records, np.asarray(out.token_advantage)[:, 0])
  # float32 kernel vs float64 reference: a few ops on values <= 10, so |error| << 1e-5.
  np.testing.assert_allclose(got, _multi_turn_reference(ro.rows, values, bootstrap_truncated),
                             atol=1e-5)
  # Bootstrapping moves exactly the two truncated trajectories (slots 1 and 2): by
  # (gamma lam)^(T-1-t) gamma V_last at step t; the terminal one (slot 0) never moves.
  off = _multi_turn_reference(ro.rows, values, False)
  shift = [0.0, 0.0, GAMMA * LAM * GAMMA * 3.5, GAMMA * 3.5,
           (GAMMA * LAM) ** 2 * GAMMA * 6.5, GAMMA * LAM * GAMMA * 6.5, GAMMA * 6.5]
  np.testing.assert_allclose(got - off, np.array(shift) * bootstrap_truncated, atol=1e-5)
