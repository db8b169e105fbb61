"""The exact oracle: hand-solved cases, brute-force enumeration, Monte Carlo, finite differences."""

import itertools

import numpy as np
import pytest

from hgpo_jax.analysis import sampling
from hgpo_jax.analysis import testbed as tb

GAMMA = 0.95
# Three cells in a row: start, middle, goal. E moves right, W left, N/S bump (stay).
CORRIDOR = ("#####", "#S.G#", "#####")
# A small map with a trap, a cue and two starts, for the enumeration and MC checks.
SMALL = ("######", "#S.C.#", "#.#T.#", "#S..G#", "######")
E, W, N, S = 1, 3, 0, 2


def test_corridor_two_steps_by_hand():
  """Uniform Markov policy, horizon 2. Hand solution (pi = 1/4 everywhere):
  t=1, middle: Q(E) = 10, Q(other) = 0, V = 2.5; t=1, start: V = 0.
  t=0, start: Q(E) = 0.95 * 2.5 = 2.375, Q(N) = Q(S) = Q(W) = 0, V = 0.59375,
  A*(E) = 1.78125, A*(N) = -0.59375; P(success) = 1/16, P(timeout) = 15/16."""
  grid = tb.make_grid(CORRIDOR)
  dag = tb.build_dag(grid, k_mem=0, horizon=2)
  sol = tb.solve(dag, np.zeros((len(dag.contexts), 4)), GAMMA)
  start = dag.start_nodes[0]
  np.testing.assert_allclose(sol.q[0][start], [0, 2.375, 0, 0], rtol=1e-12)
  assert sol.v[0][start] == pytest.approx(0.59375, rel=1e-12)
  np.testing.assert_allclose(sol.advantage(0)[start], [-0.59375, 1.78125, -0.59375, -0.59375],
                             rtol=1e-12)
  middle = int(np.flatnonzero(dag.layer_cell[1] == 1)[0])
  np.testing.assert_allclose(sol.q[1][middle], [0, 10, 0, 0], rtol=1e-12)
  assert sol.v[1][middle] == pytest.approx(2.5, rel=1e-12)
  assert sol.success[0] == pytest.approx(1 / 16, rel=1e-12)
  assert sol.timeout[0] == pytest.approx(15 / 16, rel=1e-12)
  assert sol.objective == pytest.approx(0.59375, rel=1e-12)


def test_corridor_history_dependent_policy_by_hand():
  """k_mem = 1, horizon 3. In the middle cell the policy goes E with probability 0.9 if
  it arrived by moving E from the start (window (start, E)), with probability 0.5 if it
  bumped a wall there (windows (middle, N) and (middle, S)), uniform elsewhere.
  Hand solution, last step (t=2): V(start, E) = 0.9 * 10 = 9, V(middle, N) = 0.5 * 10 = 5.
  t=1 after E from the start: Q(E) = 10, Q(N) = Q(S) = 0.95 * 5 = 4.75, Q(W) = 0
  (back at the start with one step left), V = 0.9 * 10 + (0.1 / 3) * 9.5."""
  grid = tb.make_grid(CORRIDOR)
  dag = tb.build_dag(grid, k_mem=1, horizon=3)
  cells, actions, length, cur = tb.decode_windows(dag.contexts, grid, 1)
  logits = np.zeros((len(dag.contexts), 4))
  came_east = (cur == 1) & (length == 1) & (actions[:, 0] == E) & (cells[:, 0] == 0)
  bumped = (cur == 1) & (length == 1) & np.isin(actions[:, 0], [N, S]) & (cells[:, 0] == 1)
  # pi(E) = 0.9 -> logit ln(0.9 / (0.1 / 3)) = ln 27 against three equal others.
  logits[came_east, E] = np.log(27.0)
  logits[bumped, E] = np.log(3.0)  # pi(E) = 3 / (3 + 3) = 0.5
  sol = tb.solve(dag, logits, GAMMA)
  ctx2 = dag.layer_ctx[2]
  v_east = sol.v[2][np.flatnonzero(came_east[ctx2])]
  v_bump = sol.v[2][np.flatnonzero(bumped[ctx2])]
  np.testing.assert_allclose(v_east, [9.0], rtol=1e-12)
  np.testing.assert_allclose(v_bump, [5.0, 5.0], rtol=1e-12)
  node = int(np.flatnonzero(came_east[dag.layer_ctx[1]])[0])
  np.testing.assert_allclose(sol.q[1][node], [4.75, 10.0, 4.75, 0.0], rtol=1e-12)
  assert sol.v[1][node] == pytest.approx(0.9 * 10 + (0.1 / 3) * (4.75 + 4.75), rel=1e-12)


def _brute_force(grid, horizon, logits_of_history):
  """V_0 per start by enumerating every sequence of `horizon` actions."""
  values = []
  for start in grid.starts:
    value = 0.0
    for seq in itertools.product(range(4), repeat=horizon):
      cell, prob, ret, history, end = start, 1.0, 0.0, [], horizon - 1
      for t, a in enumerate(seq):
        prob *= tb.softmax(logits_of_history(history, cell))[a]
        history.append((cell, a))
        cell = int(grid.step_to[cell, a])
        if grid.terminal[cell]:
          ret = GAMMA**t * (10.0 if grid.goal[cell] else 0.0)
          end = t
          break
      # An episode that ended at step `end` appears once per continuation of the
      # remaining horizon - 1 - end actions: count it once.
      value += prob * ret / 4.0**(horizon - 1 - end)
    values.append(value)
  return np.array(values)


@pytest.mark.parametrize("family,beta", [("revisit", 2.0), ("cue", 3.0)])
def test_dag_values_equal_brute_force_enumeration(family, beta):
  """The DAG's V_0 equals the expectation over all 4^H action sequences, with the policy
  evaluated on the explicit history (window re-encoded from the list of moves)."""
  grid = tb.make_grid(SMALL)
  k_mem, horizon = 2, 5
  dag = tb.build_dag(grid, k_mem, horizon)
  spec = tb.PolicySpec(family, beta=beta, seed=3)
  logits = tb.policy_logits(dag, spec)
  sol = tb.solve(dag, logits, GAMMA)

  def logits_of_history(history, cell):
    window = history[-k_mem:]
    first = window[0][0] if window else cell
    acts = 0
    for _, a in window:
      acts = acts * 4 + a
    code = tb._encode(len(window), first, acts, grid.num_cells, k_mem)
    return logits[np.searchsorted(dag.contexts, code)]

  values = _brute_force(grid, horizon, logits_of_history)
  np.testing.assert_allclose(sol.start_values, values, rtol=1e-10)


def test_windows_decode_what_was_encoded():
  grid = tb.make_grid(SMALL)
  rng = np.random.default_rng(0)
  for k_mem in (1, 2, 3):
    for _ in range(50):
      start = int(rng.choice(grid.starts))
      moves = rng.integers(0, 4, rng.integers(0, 6))
      code = tb._encode(0, start, 0, grid.num_cells, k_mem)
      cells_seen = [start]
      for a in moves:
        code = tb._advance(np.array([code]), np.array([a]), grid, k_mem)[0]
        cells_seen.append(int(grid.step_to[cells_seen[-1], a]))
      cells, actions, length, cur = tb.decode_windows(np.array([code]), grid, k_mem)
      keep = min(k_mem, len(moves))
      assert length[0] == keep and cur[0] == cells_seen[-1]
      assert list(actions[0, k_mem - keep:]) == list(moves[len(moves) - keep:])
      assert list(cells[0, k_mem - keep:]) == cells_seen[len(cells_seen) - keep - 1:]


def test_monte_carlo_agrees_with_oracle():
  """n = 4 x 2000 sampled episodes (the study's own sampler). For each task the sample
  mean of the discounted return from the start has standard error sigma = sd / sqrt(n);
  |mean - V_0| < 4 sigma (two-sided chance of a false alarm 6e-5 per task). Success
  counts are binomial: |p_hat - p| < 4 sqrt(p (1 - p) / n). Q of the first action is
  checked the same way on the episodes that took it."""
  grid = tb.make_grid(SMALL)
  dag = tb.build_dag(grid, k_mem=2, horizon=12)
  sol = tb.solve(dag, tb.policy_logits(dag, tb.PolicySpec("cue", beta=2.0, seed=1)), GAMMA)
  ro = sampling.sample(dag, sol, num_batches=1, group_size=2000, seed=5)
  first = ro.step == 0
  ret = np.zeros(ro.num_rows)
  for i in reversed(range(ro.num_rows)):  # discounted return-to-go per trajectory
    nxt = ret[i + 1] if i + 1 < ro.num_rows and ro.traj[i + 1] == ro.traj[i] else 0.0
    ret[i] = ro.reward[i] + GAMMA * nxt
  for task in range(len(grid.starts)):
    r0 = ret[first & (ro.task == task)]
    n = len(r0)
    assert n == 2000
    sigma = r0.std(ddof=1) / np.sqrt(n)
    assert abs(r0.mean() - sol.start_values[task]) < 4 * sigma
    wins = ro.done & (ro.reward > 0) & (ro.task == task)
    p = sol.success[task]
    assert abs(wins.sum() / n - p) < 4 * np.sqrt(p * (1 - p) / n)
    node = dag.start_nodes[task]
    for a in range(4):
      took = first & (ro.task == task) & (ro.action == a)
      if took.sum() < 100:
        continue
      q_hat = ret[took]
      assert abs(q_hat.mean() - sol.q[0][node, a]) < 4 * q_hat.std(ddof=1) / np.sqrt(took.sum()) + 1e-12


def test_policy_gradient_equals_finite_differences():
  """dJ/dlogits (discount_states=True) against central differences, h = 1e-5.
  Truncation error O(h^2 J''') ~ 1e-10 and round-off ~ 1e-16 * J / h ~ 1e-10 for J ~ 1,
  so 1e-7 absolute leaves a 1000x margin."""
  grid = tb.make_grid(SMALL)
  dag = tb.build_dag(grid, k_mem=1, horizon=6)
  rng = np.random.default_rng(2)
  logits = rng.normal(0, 1, (len(dag.contexts), 4))
  grad = tb.policy_gradient(dag, tb.solve(dag, logits, GAMMA), GAMMA, discount_states=True)
  h = 1e-5
  fd = np.zeros_like(logits)
  for m in range(len(dag.contexts)):
    for a in range(4):
      up, down = logits.copy(), logits.copy()
      up[m, a] += h
      down[m, a] -= h
      fd[m, a] = (tb.solve(dag, up, GAMMA).objective - tb.solve(dag, down, GAMMA).objective) / (2 * h)
  np.testing.assert_allclose(grad, fd, atol=1e-7, rtol=0)
  assert np.abs(grad).max() > 1e-3  # not vacuous


def test_undiscounted_gradient_is_softmax_centred():
  """Each context's gradient row sums to 0 (softmax logits are shift invariant)."""
  grid = tb.make_grid(SMALL)
  dag = tb.build_dag(grid, k_mem=2, horizon=8)
  sol = tb.solve(dag, tb.policy_logits(dag, tb.PolicySpec("revisit", beta=1.0)), GAMMA)
  g = tb.policy_gradient(dag, sol, GAMMA, discount_states=False)
  np.testing.assert_allclose(g.sum(1), 0.0, atol=1e-12)
  assert np.abs(g).max() > 1e-2


def test_calibration_hits_the_target_success():
  grid = tb.make_grid()
  dag = tb.build_dag(grid, k_mem=2, horizon=40)
  spec = tb.calibrate_progress(dag, tb.PolicySpec("revisit", beta=2.0), 0.5, iters=20)
  assert tb.solve(dag, tb.policy_logits(dag, spec), GAMMA).success.mean() == pytest.approx(
      0.5, abs=1e-4)


def test_bad_grid_raises_one_line():
  with pytest.raises(ValueError, match="needs at least one goal"):
    tb.make_grid(("###", "#S#", "###"))
  with pytest.raises(ValueError, match="unknown grid character"):
    tb.make_grid(("###", "#X#", "###"))
  with pytest.raises(ValueError, match="policy family"):
    tb.PolicySpec("greedy")
