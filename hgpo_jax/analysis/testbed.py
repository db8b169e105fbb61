"""Exact testbed: a gridworld, history-dependent policies and their oracle advantages.

Environment (deterministic): open cells of a character map; actions N, E, S, W; a
move into a wall stays in place (so revisits happen); entering the goal gives
`goal_reward` and ends the episode, entering a trap ends it with 0; an episode that
reaches `horizon` steps is truncated (no reward, not `done`). One task = one start cell.

Policies see a memory window: the last `k_mem` (cell, action) pairs and the current
cell. A window is encoded in one integer "context code" (see `_encode`); the policy is
a softmax over per-context logits, so a policy is a table `logits[num_contexts, 4]`
(the context-tabular softmax policy whose exact gradient `solve` returns).

Because the environment is Markov in the cell and the policy depends on the window
only, the pair (t, window) is a sufficient statistic of the whole history h_t: the
exact values V(h_t) = V_t(window) and Q, A* = Q - V come from one backward pass over
the layered DAG of reachable (t, window) nodes (no Monte Carlo).

Policy families (`policy_logits`), strength `beta` (0 = Markov control):
  * "revisit" (habit-like): avoid cells visited inside the window, keep the last move
    (when it moved);
  * "cue" (information-like): once a cue cell is inside the window, the goal direction
    is known (an extra goal-progress term), before that only the weak base policy acts.
Base logits: `progress` x (goal-distance decrease) + per-seed noise per (cell, action)
+ `tau` x (trap-distance decrease); `calibrate_progress` picks the progress weight for a
target success rate so that difficulty does not drift along a beta sweep.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Sequence

import numpy as np

NUM_ACTIONS = 4
MOVES = ((-1, 0), (0, 1), (1, 0), (0, -1))  # N, E, S, W (row, col)
ACTION_NAMES = ("north", "east", "south", "west")

DEFAULT_LAYOUT = (
    "#########",
    "#S..#..G#",
    "#.#.#.#.#",
    "#.C..S#.#",
    "#.##T##.#",
    "#S.....C#",
    "#.#.#.#T#",
    "#...S...#",
    "#########",
)
"""The study's map: '#' wall, '.' open, 'S' start (one task each), 'G' goal, 'T' trap, 'C' cue."""


@dataclasses.dataclass(frozen=True)
class Grid:
  """A parsed map. Cells are the non-wall squares, indexed in reading order."""

  layout: tuple[str, ...]
  coords: np.ndarray
  """int[C, 2]: (row, col) of each cell."""
  step_to: np.ndarray
  """int[C, 4]: cell reached by each action (itself when blocked)."""
  goal: np.ndarray
  """bool[C]."""
  trap: np.ndarray
  """bool[C]."""
  cue: np.ndarray
  """bool[C]."""
  starts: tuple[int, ...]
  """Start cells, one task each, in reading order."""
  dist_goal: np.ndarray
  """int[C]: shortest-path length to the goal (walls only; traps are passable)."""
  dist_trap: np.ndarray
  """int[C]: shortest-path length to the nearest trap."""

  @property
  def num_cells(self) -> int:
    return len(self.coords)

  @property
  def terminal(self) -> np.ndarray:
    return self.goal | self.trap


def make_grid(layout: Sequence[str] = DEFAULT_LAYOUT) -> Grid:
  """Parses a map; raises ValueError (one line) when it has no goal or no start."""
  layout = tuple(layout)
  if len({len(r) for r in layout}) != 1:
    raise ValueError("every row of the grid layout must have the same length")
  index = {}
  for r, row in enumerate(layout):
    for c, ch in enumerate(row):
      if ch not in "#.SGTC":
        raise ValueError(f"unknown grid character {ch!r} at row {r}, col {c}; use '#.SGTC'")
      if ch != "#":
        index[(r, c)] = len(index)
  coords = np.array(sorted(index, key=index.get), dtype=np.int64).reshape(-1, 2)
  kind = np.array([layout[r][c] for r, c in coords])
  if not (kind == "G").any() or not (kind == "S").any():
    raise ValueError("the grid layout needs at least one goal 'G' and one start 'S'")
  step_to = np.empty((len(coords), NUM_ACTIONS), np.int64)
  for i, (r, c) in enumerate(coords):
    for a, (dr, dc) in enumerate(MOVES):
      step_to[i, a] = index.get((r + dr, c + dc), i)
  return Grid(layout=layout, coords=coords, step_to=step_to, goal=kind == "G", trap=kind == "T",
              cue=kind == "C", starts=tuple(int(i) for i in np.flatnonzero(kind == "S")),
              dist_goal=_bfs(step_to, kind == "G"), dist_trap=_bfs(step_to, kind == "T"))


def _bfs(step_to: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """Shortest path lengths to any target (moves are symmetric on a grid)."""
  n = len(step_to)
  dist = np.full(n, n, np.int64)
  queue = deque(np.flatnonzero(targets).tolist())
  dist[list(queue)] = 0
  while queue:
    i = queue.popleft()
    for j in step_to[i]:
      if dist[j] > dist[i] + 1:
        dist[j] = dist[i] + 1
        queue.append(j)
  return dist


# ---------------------------------------------------------------------------------------
# Observations
# ---------------------------------------------------------------------------------------
def observations(grid: Grid, mode: str) -> np.ndarray:
  """int[C] observation id per cell, or str[C] texts ("noisy" adds per-visit noise later).

  * "exact": one observation per cell.
  * "aliased": the cell's exits (open directions) and whether a cue is painted there:
    several cells share one observation, so state-only keys merge different cells.
  * "text": one distinct sentence per cell (for the similarity grouping; see
    `noisy_observation`).
  """
  if mode == "exact":
    return np.arange(grid.num_cells)
  if mode == "aliased":
    exits = (grid.step_to != np.arange(grid.num_cells)[:, None]) @ (1 << np.arange(NUM_ACTIONS))
    return np.unique(exits * 2 + grid.cue, return_inverse=True)[1].reshape(-1)
  if mode == "text":
    rng = np.random.default_rng(12345)
    letters = np.array(list("bcdfghjklmnpqrstvwz"))
    out = []
    for i in range(grid.num_cells):
      name = "".join(rng.choice(letters, 7))
      exits = ", ".join(ACTION_NAMES[a] for a in range(NUM_ACTIONS) if grid.step_to[i, a] != i)
      cue = " A painted arrow marks the floor." if grid.cue[i] else ""
      out.append(f"You are in the {name} hall. Exits: {exits}.{cue}")
    return np.array(out, dtype=object)
  raise ValueError(f"observation mode {mode!r} is not one of ['exact', 'aliased', 'text']")


def noisy_observation(texts: np.ndarray, cells: np.ndarray, noise: np.ndarray) -> np.ndarray:
  """Per-visit text: the cell's sentence plus a one-digit detail that changes per visit.

  Exact repeats become rare (GiGPO's exact anchor groups fragment) while two visits of
  one cell stay >= 0.95 similar (difflib ratio), which is the case the similarity
  grouping of GiGPO's paper targets.
  """
  return np.array([f"{texts[c]} Dust level {d}." for c, d in zip(cells, noise)], dtype=object)


# ---------------------------------------------------------------------------------------
# Context codes: one integer per memory window
# ---------------------------------------------------------------------------------------
def _encode(length, first_cell, actions, num_cells, k_mem):
  return (length * num_cells + first_cell) * NUM_ACTIONS**k_mem + actions


def decode_windows(codes: np.ndarray, grid: Grid, k_mem: int):
  """Context codes -> (cells int[n, k_mem+1] oldest..current (-1 padded), actions int[n, k_mem]
  oldest..newest (-1 padded), window length int[n], current cell int[n]).

  Padding sits at the *front*: column k_mem is always the current cell.
  """
  codes = np.asarray(codes, np.int64)
  span = NUM_ACTIONS**k_mem
  acts = codes % span
  rest = codes // span
  first = rest % grid.num_cells
  length = rest // grid.num_cells
  n = len(codes)
  actions = np.full((n, k_mem), -1, np.int64)
  cells = np.full((n, k_mem + 1), -1, np.int64)
  for j in range(k_mem):  # j-th action of the window, oldest first (digit length-1-j)
    has = j < length
    digit = (acts // NUM_ACTIONS**np.maximum(length - 1 - j, 0)) % NUM_ACTIONS
    col = k_mem - length + j  # right-aligned position
    rows = np.flatnonzero(has)
    actions[rows, col[rows]] = digit[rows]
  cur = first.copy()
  pos = k_mem - length
  cells[np.arange(n), pos] = first
  for j in range(k_mem):
    col = k_mem - length + j
    rows = np.flatnonzero(j < length)
    cur[rows] = grid.step_to[cur[rows], actions[rows, col[rows]]]
    cells[rows, col[rows] + 1] = cur[rows]
  return cells, actions, length, cur


def _advance(codes: np.ndarray, action: np.ndarray, grid: Grid, k_mem: int) -> np.ndarray:
  """Context code after taking `action` (elementwise)."""
  span = NUM_ACTIONS**k_mem
  acts = codes % span
  rest = codes // span
  first = rest % grid.num_cells
  length = rest // grid.num_cells
  if k_mem == 0:
    return _encode(0, grid.step_to[first, action], 0, grid.num_cells, 0)
  grow = length < k_mem
  oldest = acts // NUM_ACTIONS**(k_mem - 1)
  slid_first = grid.step_to[first, oldest]
  new_len = np.where(grow, length + 1, length)
  new_first = np.where(grow, first, slid_first)
  new_acts = np.where(grow, acts, acts % NUM_ACTIONS**(k_mem - 1)) * NUM_ACTIONS + action
  return _encode(new_len, new_first, new_acts, grid.num_cells, k_mem)


# ---------------------------------------------------------------------------------------
# The layered DAG of reachable (t, window) nodes
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Dag:
  """Reachable nodes per time step; independent of the policy (softmax has full support)."""

  grid: Grid
  k_mem: int
  horizon: int
  contexts: np.ndarray
  """int64[M]: sorted context codes over all layers (the tabular policy's rows)."""
  layer_ctx: tuple[np.ndarray, ...]
  """Per t: int[n_t] index into `contexts` of each node."""
  layer_cell: tuple[np.ndarray, ...]
  """Per t: int[n_t] current cell of each node."""
  layer_next: tuple[np.ndarray, ...]
  """Per t: int[n_t, 4] node index in layer t+1, or -1 (terminal cell or horizon reached)."""
  layer_reward: tuple[np.ndarray, ...]
  """Per t: f64[n_t, 4] reward of each action."""
  layer_done: tuple[np.ndarray, ...]
  """Per t: bool[n_t, 4] the action enters a terminal cell."""
  start_nodes: np.ndarray
  """int[num_tasks]: node index in layer 0 of each task's start."""

  @property
  def num_nodes(self) -> int:
    return sum(len(c) for c in self.layer_ctx)


def build_dag(grid: Grid, k_mem: int, horizon: int, goal_reward: float = 10.0) -> Dag:
  """Enumerates every (t, window) reachable from the start cells within `horizon` steps."""
  if k_mem < 0 or horizon < 1:
    raise ValueError(f"need k_mem >= 0 and horizon >= 1, got k_mem={k_mem}, horizon={horizon}")
  starts = np.asarray(grid.starts, np.int64)
  codes = np.unique(_encode(0, starts, 0, grid.num_cells, k_mem))
  start_nodes = np.searchsorted(codes, _encode(0, starts, 0, grid.num_cells, k_mem))
  layers_codes, layers_cell, layers_next, layers_reward, layers_done = [], [], [], [], []
  for t in range(horizon):
    _, _, _, cell = decode_windows(codes, grid, k_mem)
    nxt_cell = grid.step_to[cell]  # [n, 4]
    done = grid.terminal[nxt_cell]
    reward = np.where(grid.goal[nxt_cell], goal_reward, 0.0)
    nxt_code = _advance(np.repeat(codes, NUM_ACTIONS), np.tile(np.arange(NUM_ACTIONS), len(codes)),
                        grid, k_mem).reshape(-1, NUM_ACTIONS)
    live = ~done & (t + 1 < horizon)
    next_codes = np.unique(nxt_code[live])
    nxt = np.where(live, np.searchsorted(next_codes, nxt_code), -1)
    layers_codes.append(codes)
    layers_cell.append(cell)
    layers_next.append(nxt)
    layers_reward.append(reward)
    layers_done.append(done)
    codes = next_codes
  contexts = np.unique(np.concatenate(layers_codes))
  layer_ctx = tuple(np.searchsorted(contexts, c) for c in layers_codes)
  return Dag(grid=grid, k_mem=k_mem, horizon=horizon, contexts=contexts, layer_ctx=layer_ctx,
             layer_cell=tuple(layers_cell), layer_next=tuple(layers_next),
             layer_reward=tuple(layers_reward), layer_done=tuple(layers_done),
             start_nodes=start_nodes)


# ---------------------------------------------------------------------------------------
# Policy families
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PolicySpec:
  family: str = "revisit"
  """"revisit" (habit-like) or "cue" (information-like)."""
  beta: float = 0.0
  """Strength of the history term; 0 = Markov control."""
  seed: int = 0
  """Seed of the fixed per-(cell, action) logit noise."""
  tau: float = 1.0
  """Trap attraction (traps end wandering episodes early, which keeps timeouts rare)."""
  progress: float = 1.0
  """Weight of the goal-distance decrease (calibrated for a target success rate)."""
  noise: float = 0.7
  """Std of the per-seed logit noise."""

  def __post_init__(self):
    if self.family not in ("revisit", "cue"):
      raise ValueError(f"policy family {self.family!r} is not one of ['revisit', 'cue']")


def policy_logits(dag: Dag, spec: PolicySpec) -> np.ndarray:
  """f64[M, 4] logits of every context of the DAG under a policy family."""
  grid = dag.grid
  cells, actions, length, cur = decode_windows(dag.contexts, grid, dag.k_mem)
  nxt = grid.step_to[cur]  # [M, 4]
  prog = (grid.dist_goal[cur][:, None] - grid.dist_goal[nxt]).astype(np.float64)
  trap = (grid.dist_trap[cur][:, None] - grid.dist_trap[nxt]).astype(np.float64)
  noise = np.random.default_rng(1000 + spec.seed).normal(0.0, spec.noise,
                                                        (grid.num_cells, NUM_ACTIONS))
  logits = spec.progress * prog + noise[cur] + spec.tau * trap
  if spec.beta == 0.0 or dag.k_mem == 0:
    return logits
  past = cells[:, :-1]  # previous cells of the window (-1 = padding)
  if spec.family == "revisit":
    revisit = (nxt[:, :, None] == past[:, None, :]).any(-1) & (nxt != cur[:, None])
    # Momentum only after a real move: a bump leaves no trace in the cells, and a policy
    # that remembered the bumped wall would make contexts differ in actions only (that
    # confound is the aliasing control's, not the main sweep's).
    last = actions[:, -1]
    moved = (length > 0) & (cells[:, -2] != cur)
    momentum = (np.arange(NUM_ACTIONS)[None, :] == last[:, None]) & moved[:, None]
    history = -1.0 * revisit + 0.5 * momentum
  else:
    seen = np.where(cells >= 0, grid.cue[np.maximum(cells, 0)], False).any(-1)
    history = seen[:, None] * prog
  return logits + spec.beta * history


def softmax(logits: np.ndarray) -> np.ndarray:
  z = np.exp(logits - logits.max(-1, keepdims=True))
  return z / z.sum(-1, keepdims=True)


# ---------------------------------------------------------------------------------------
# Exact oracle
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Solution:
  """Exact quantities of one policy on one DAG (per layer lists are indexed by t)."""

  probs: np.ndarray
  """f64[M, 4]: pi(a | context)."""
  q: tuple[np.ndarray, ...]
  """Per t: f64[n_t, 4] Q_t(node, a) = E[discounted return-to-go | h_t, a_t]."""
  v: tuple[np.ndarray, ...]
  """Per t: f64[n_t] V_t(node)."""
  occupancy: tuple[np.ndarray, ...]
  """Per t: f64[num_tasks, n_t] probability that the task's episode is at the node at t."""
  success: np.ndarray
  """f64[num_tasks]: probability of reaching the goal."""
  timeout: np.ndarray
  """f64[num_tasks]: probability of being truncated at the horizon."""
  expected_length: np.ndarray
  """f64[num_tasks]: expected number of steps."""
  start_values: np.ndarray
  """f64[num_tasks]: V_0 at each task's start."""

  def advantage(self, t: int) -> np.ndarray:
    return self.q[t] - self.v[t][:, None]

  @property
  def objective(self) -> float:
    """J = mean over tasks of V_0(start) (the discounted objective)."""
    return float(np.mean(self.start_values))


def solve(dag: Dag, logits: np.ndarray, gamma: float) -> Solution:
  """Backward pass (Q, V) and forward pass (occupancies, success and timeout rates)."""
  probs = softmax(np.asarray(logits, np.float64))
  horizon = dag.horizon
  qs, vs = [None] * horizon, [None] * horizon
  v_next = np.zeros(0)
  for t in reversed(range(horizon)):
    nxt = dag.layer_next[t]
    cont = np.where(nxt >= 0, v_next[np.maximum(nxt, 0)] if v_next.size else 0.0, 0.0)
    q = dag.layer_reward[t] + gamma * cont
    qs[t] = q
    vs[t] = np.sum(probs[dag.layer_ctx[t]] * q, axis=1)
    v_next = vs[t]
  num_tasks = len(dag.start_nodes)
  occ = [None] * horizon
  d = np.zeros((num_tasks, len(dag.layer_ctx[0])))
  d[np.arange(num_tasks), dag.start_nodes] = 1.0
  success = np.zeros(num_tasks)
  timeout = np.zeros(num_tasks)
  length = np.zeros(num_tasks)
  for t in range(horizon):
    occ[t] = d
    flow = d[:, :, None] * probs[dag.layer_ctx[t]][None]  # [tasks, n_t, 4]
    length += d.sum(1)
    success += np.sum(flow * dag.grid.goal[dag.grid.step_to[dag.layer_cell[t]]][None], axis=(1, 2))
    nxt = dag.layer_next[t]
    if t + 1 < horizon:
      d = _propagate(flow, nxt, len(dag.layer_ctx[t + 1]))
    else:
      timeout = np.sum(flow * ~dag.layer_done[t][None], axis=(1, 2))
  sol = Solution(probs=probs, q=tuple(qs), v=tuple(vs), occupancy=tuple(occ), success=success,
                 timeout=timeout, expected_length=length, start_values=vs[0][dag.start_nodes])
  return sol


def _propagate(flow: np.ndarray, nxt: np.ndarray, num_next: int) -> np.ndarray:
  """Occupancy of layer t+1 per task from the action flow [tasks, n_t, 4] of layer t."""
  num_tasks = flow.shape[0]
  live = nxt >= 0
  idx = (np.arange(num_tasks)[:, None] * num_next + nxt[live][None, :]).reshape(-1)
  return np.bincount(idx, weights=flow[:, live].reshape(-1),
                     minlength=num_tasks * num_next).reshape(num_tasks, num_next)


def success_rate(dag: Dag, logits: np.ndarray) -> float:
  """Mean probability of reaching the goal (forward pass only)."""
  probs = softmax(np.asarray(logits, np.float64))
  num_tasks = len(dag.start_nodes)
  d = np.zeros((num_tasks, len(dag.layer_ctx[0])))
  d[np.arange(num_tasks), dag.start_nodes] = 1.0
  success = 0.0
  for t in range(dag.horizon):
    flow = d[:, :, None] * probs[dag.layer_ctx[t]][None]
    success += float(np.sum(flow.sum(0) * dag.grid.goal[dag.grid.step_to[dag.layer_cell[t]]]))
    if t + 1 < dag.horizon:
      d = _propagate(flow, dag.layer_next[t], len(dag.layer_ctx[t + 1]))
  return success / num_tasks


def policy_gradient(dag: Dag, sol: Solution, gamma: float, *, discount_states: bool) -> np.ndarray:
  """f64[M, 4] exact policy gradient w.r.t. the context-tabular logits, tasks averaged.

  g[m, b] = sum_t w_t d_t(m) pi(b|m) A*_t(m, b) with w_t = gamma^t when
  `discount_states` (then g = dJ/dlogits exactly, J = `Solution.objective`) and
  w_t = 1 otherwise: the expectation of the per-batch gradient sum_rows A* grad log pi
  that the step estimators approximate (every step weighted alike, as in training).
  """
  grad = np.zeros_like(sol.probs)
  num_tasks = len(dag.start_nodes)
  for t in range(dag.horizon):
    weight = gamma**t if discount_states else 1.0
    d = sol.occupancy[t].sum(0) / num_tasks
    ctx = dag.layer_ctx[t]
    contrib = weight * d[:, None] * sol.probs[ctx] * sol.advantage(t)
    np.add.at(grad, ctx, contrib)
  return grad


def calibrate_progress(dag: Dag, spec: PolicySpec, target_success: float,
                       lo: float = 0.0, hi: float = 4.0, iters: int = 10) -> PolicySpec:
  """Bisection on the goal-progress weight so that the mean success rate is `target_success`.

  Success rises with the progress weight (checked on the study's map for every family
  and beta); if the target is outside [success(lo), success(hi)] the nearest end is
  returned, and the study reports the success rate it got.
  """
  def success(progress):
    return success_rate(dag, policy_logits(dag, dataclasses.replace(spec, progress=progress)))

  if success(lo) >= target_success:
    return dataclasses.replace(spec, progress=lo)
  if success(hi) <= target_success:
    return dataclasses.replace(spec, progress=hi)
  for _ in range(iters):
    mid = 0.5 * (lo + hi)
    if success(mid) < target_success:
      lo = mid
    else:
      hi = mid
  return dataclasses.replace(spec, progress=0.5 * (lo + hi))
