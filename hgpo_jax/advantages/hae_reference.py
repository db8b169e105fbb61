"""Readable references for the critic-based estimators: HAE and GAE.

HAE is HiPER's hierarchical advantage estimation (arXiv 2602.16165; released code
JonP07/HiPER-agent `hiper_hae/core_hae.py`), GAE is Schulman et al.'s generalized
advantage estimation (arXiv 1506.02438) over response tokens. Plain Python loops
over trajectories, segments, turns and tokens, independent of the jit kernels
(`hgpo_jax.advantages.hae`, `hgpo_jax.advantages.gae`: no scans, no sorting tricks). They
are the baseline of the equivalence tests (tests/advantages/test_hae.py, test_gae.py) and
of the benchmark launch/benchmarks/hae.py; they are not used in training.

Inputs are dicts of numpy arrays in row order with the RowBatch field names; rows of a
trajectory may sit anywhere and padding rows (mask False) are skipped. `random_fields`
and `row_batch` build such inputs for the tests and the benchmark.
"""

from __future__ import annotations

import collections

import jax.numpy as jnp
import numpy as np

from hgpo_jax.advantages.batch import RowBatch

TAG_SWITCH, TAG_SUBGOAL, TAG_ACTION = 1, 2, 3
BLOCK_TAGS = {  # TAG_* code -> the blocks (switch, subgoal, action) the token is in
    0: (0, 0, 0), 1: (1, 0, 0), 2: (0, 1, 0), 3: (0, 0, 1), 4: (1, 1, 0), 5: (0, 1, 1), 6: (1, 0, 1),
    7: (1, 1, 1)}
CODE_OF_BLOCKS = {v: k for k, v in BLOCK_TAGS.items()}


def trajectories(fields):
  """{traj id: [row indices in chronological order]} over real rows."""
  by_traj = collections.defaultdict(list)
  for row in range(len(fields["mask"])):
    if fields["mask"][row]:
      by_traj[int(fields["traj"][row])].append(row)
  return {t: sorted(rows, key=lambda r: int(fields["step"][r])) for t, rows in by_traj.items()}


def hae_trajectory(reward, valid, done, switch_start, changed, v_low, v_high, v_term, opt):
  """HAE of one trajectory (lists indexed by turn). Returns a dict of per-turn lists."""
  n = len(reward)
  g = opt.gamma
  # switch_start: the parsed switch flags; turn 0 starts a segment whatever it says.
  starts = [t for t in range(n) if t == 0 or switch_start[t]]
  segs = []
  for k, s in enumerate(starts):
    nxt = starts[k + 1] if k + 1 < len(starts) else None
    e = nxt - 1 if nxt is not None else n - 1
    segs.append((s, e, nxt))

  r = []
  for t in range(n):
    x = reward[t] - opt.invalid_penalty * (0.0 if valid[t] else 1.0)
    keep = not switch_start[t] if opt.first_turn_keep == "penalised" else t not in starts
    if keep:
      if opt.keep_penalty_mode == "fixed":
        x += opt.keep_penalty
      elif n > 1:  # normalised: one-turn trajectories get no keep penalty
        x += opt.keep_penalty / n
      if changed[t] and t > 0:
        x += opt.keep_consistency_penalty
    r.append(x)

  a_low = [0.0] * n
  a_high = [0.0] * n
  ret_term = [0.0] * n
  for s, e, nxt in segs:
    carry = 0.0
    for t in range(e, s - 1, -1):
      alive = 0.0 if done[t] else 1.0
      if t < e:
        v_next = v_low[t + 1]
      elif nxt is not None:
        v_next = v_high[nxt]
      else:
        v_next = v_low[t] if opt.bootstrap_truncated else 0.0
      delta = r[t] + g * alive * v_next - v_low[t]
      a_low[t] = delta + g * opt.lambda_turn * alive * carry
      carry = a_low[t]

  next_a_high = 0.0
  for s, e, nxt in reversed(segs):
    alive = 0.0 if done[e] else 1.0
    if nxt is not None:
      boot = v_high[nxt]
    else:
      boot = v_high[s] if opt.bootstrap_truncated else 0.0
    for t in range(s, e + 1):
      ret_term[t] = sum(g ** (u - t) * r[u] for u in range(t, e + 1)) + g ** (e - t + 1) * alive * boot
    d = e - s + 1
    big_g = sum(g ** (t - s) * r[t] for t in range(s, e + 1))
    delta = big_g + g ** d * alive * boot - v_high[s]
    has_next = 1.0 if nxt is not None else 0.0
    a_high[s] = delta + g ** d * opt.lambda_seg * alive * has_next * next_a_high
    next_a_high = a_high[s]

  return {
      "turn_reward": r,
      "segment_start": [t in starts for t in range(n)],
      "a_low": a_low,
      "a_high": a_high,
      "a_term": [ret_term[t] - v_term[t] for t in range(n)],
      "ret_low": [a_low[t] + v_low[t] for t in range(n)],
      "ret_high": [a_high[t] + v_high[t] if t in starts else 0.0 for t in range(n)],
      "ret_term": ret_term,
  }


def hae_levels(fields, opt):
  """Per-row HAE levels (row order, 0 on padding), looping over trajectories."""
  num_rows = len(fields["mask"])
  out = {k: np.zeros(num_rows) for k in
         ("turn_reward", "a_low", "a_high", "a_term", "ret_low", "ret_high", "ret_term")}
  out["segment_start"] = np.zeros(num_rows, bool)
  changed_all = fields.get("subgoal_changed")
  for rows in trajectories(fields).values():
    col = lambda name: [fields[name][r] for r in rows]
    values = [fields["values"][r] for r in rows]
    changed = [bool(changed_all[r]) if changed_all is not None else False for r in rows]
    res = hae_trajectory(col("reward"), col("action_valid"), col("done"), col("segment_start"), changed,
                         [v[0] for v in values], [v[1] for v in values], [v[2] for v in values], opt)
    for i, row in enumerate(rows):
      for k in out:
        out[k][row] = res[k][i]
  return out


def whiten_population(x, rows):
  """(x - mean) / (pop std + 1e-8) over the listed rows; 0 elsewhere."""
  out = np.zeros(len(x))
  if not rows:
    return out
  vals = [x[r] for r in rows]
  mean = sum(vals) / len(vals)
  std = (sum((v - mean) ** 2 for v in vals) / len(vals)) ** 0.5
  for r in rows:
    out[r] = (x[r] - mean) / (std + 1e-8)
  return out


def hae(fields, opt):
  """Full HAE output: row advantage, token advantage, loss mask, value targets."""
  lv = hae_levels(fields, opt)
  num_rows = len(fields["mask"])
  real = [r for r in range(num_rows) if fields["mask"][r]]
  tags = fields.get("token_tags")
  masks = None
  if tags is not None:
    num_tokens = tags.shape[1]
    masks = {k: np.zeros((num_rows, num_tokens), bool) for k in ("term", "high", "low")}
    for r in real:
      toks = [j for j in range(num_tokens) if fields["response_mask"][r, j]]
      blocks = {j: BLOCK_TAGS.get(int(tags[r, j]), (0, 0, 0)) for j in toks}
      has_action = any(blocks[j][2] for j in toks)
      for j in toks:
        masks["term"][r, j] = bool(blocks[j][0])
        masks["high"][r, j] = bool(blocks[j][1]) and bool(lv["segment_start"][r])
        if has_action:
          masks["low"][r, j] = bool(blocks[j][2])
        elif opt.missing_action == "whole_response":
          masks["low"][r, j] = True
        else:
          masks["low"][r, j] = not masks["term"][r, j] and not masks["high"][r, j]
    low_rows, high_rows, term_rows = ([r for r in real if masks[k][r].any()]
                                      for k in ("low", "high", "term"))
  else:
    low_rows, term_rows = real, real
    high_rows = [r for r in real if lv["segment_start"][r]]
  a_low, a_high, a_term = lv["a_low"], lv["a_high"], lv["a_term"]
  if opt.norm_adv:
    a_low = whiten_population(a_low, low_rows)
    a_high = whiten_population(a_high, high_rows)
    a_term = whiten_population(a_term, term_rows)
  out = {"advantage": np.where(fields["mask"], a_low, 0.0), "levels": lv}
  if masks is not None:
    tok = np.zeros(masks["low"].shape)
    for r in real:
      for j in range(tok.shape[1]):  # overlapping masks sum their levels
        tok[r, j] = (a_term[r] * masks["term"][r, j] + a_high[r] * masks["high"][r, j]
                     + a_low[r] * masks["low"][r, j])
    out["token_advantage"] = tok
    out["loss_mask"] = masks["term"] | masks["high"] | masks["low"]
  return out


# ---- GAE (arXiv 1506.02438) ---------------------------------------------------------------


def gae_tokens(rewards, values, gamma, lam, next_value=0.0, next_adv=0.0):
  """Token GAE of one response: V and A after the last token are given (0 = none)."""
  n = len(rewards)
  adv = [0.0] * n
  carry_v, carry_a = next_value, next_adv
  for j in range(n - 1, -1, -1):
    delta = rewards[j] + gamma * carry_v - values[j]
    adv[j] = delta + gamma * lam * carry_a
    carry_v, carry_a = values[j], adv[j]
  return adv


def gae(fields, opt):
  """GAE token advantages (before whitening), returns, and whitened advantages."""
  num_rows, num_tokens = fields["response_mask"].shape
  adv = np.zeros((num_rows, num_tokens))
  for rows in trajectories(fields).values():
    next_value, next_adv = 0.0, 0.0
    for k in range(len(rows) - 1, -1, -1):
      r = rows[k]
      toks = [j for j in range(num_tokens) if fields["response_mask"][r, j]]
      if not toks:
        continue
      values = [float(fields["token_values"][r, j]) for j in toks]
      if opt.multi_turn:
        reward = fields["reward"][r] - opt.invalid_penalty * (0.0 if fields["action_valid"][r] else 1.0)
        if k == len(rows) - 1:
          boot_v = values[0] if (opt.bootstrap_truncated and not fields["done"][r]) else 0.0
          boot_a = 0.0
        elif fields["done"][r]:
          boot_v, boot_a = 0.0, 0.0
        else:
          boot_v, boot_a = next_value, next_adv
      else:
        reward, boot_v, boot_a = fields["score"][r], 0.0, 0.0
      rewards = [0.0] * (len(toks) - 1) + [float(reward)]
      a = gae_tokens(rewards, values, opt.gamma, opt.lam, boot_v, boot_a)
      for i, j in enumerate(toks):
        adv[r, j] = a[i]
      next_value, next_adv = values[0], a[0]
  valid = fields["response_mask"] & fields["mask"][:, None]
  returns = np.where(valid, adv + np.where(valid, fields["token_values"], 0.0), 0.0)
  whitened = adv
  if opt.norm_adv:
    vals = [adv[r, j] for r in range(num_rows) for j in range(num_tokens) if valid[r, j]]
    mean = sum(vals) / len(vals)
    var_unbiased = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    whitened = np.where(valid, (adv - mean) / (var_unbiased + 1e-8) ** 0.5, 0.0)
  return {"raw": adv, "token_advantage": whitened, "returns": returns, "loss_mask": valid}


# ---- synthetic batches (tests and benchmark) -------------------------------------------


def row_batch(fields):
  """A RowBatch from numpy fields; group/anchor ids are trivial (unused by hae/gae)."""
  num_rows = len(fields["mask"])
  zeros_i = np.zeros(num_rows, np.int32)
  optional = ("segment_start", "values", "token_values", "response_mask", "token_tags", "subgoal_changed")
  return RowBatch(
      mask=jnp.asarray(fields["mask"]), group=jnp.asarray(fields["traj"], jnp.int32),
      traj=jnp.asarray(fields["traj"], jnp.int32), step=jnp.asarray(fields["step"], jnp.int32),
      reward=jnp.asarray(fields["reward"], jnp.float32), done=jnp.asarray(fields["done"]),
      action_valid=jnp.asarray(fields["action_valid"]),
      returns=jnp.zeros(num_rows, jnp.float32), score=jnp.asarray(fields["score"], jnp.float32),
      episode_return=jnp.zeros(num_rows, jnp.float32), traj_first=jnp.asarray(fields["step"] == 0),
      anchor_group=jnp.asarray(zeros_i), context_group=jnp.asarray(zeros_i[None]),
      **{k: (jnp.asarray(fields[k]) if fields.get(k) is not None else None) for k in optional})


def random_fields(rng, num_traj, max_turns, num_tokens, capacity=None, shuffle=True,
                  p_switch=0.3, p_done=0.6, p_invalid=0.15, full=False):
  """Random trajectories with random segments, truncation, invalid turns and spans.

  Rows are trajectory-major and padded at the end to `capacity`; with `shuffle`,
  real and padding rows are permuted together (the kernels must not care). With
  `full`, every trajectory has `max_turns` turns and every response `num_tokens`.
  """
  rows = []
  for t in range(num_traj):
    n = max_turns if full else int(rng.integers(1, max_turns + 1))
    done_last = rng.random() < p_done
    for s in range(n):
      rows.append((t, s, n, done_last))
  capacity = capacity or len(rows)
  assert capacity >= len(rows)
  f = {
      "mask": np.zeros(capacity, bool), "traj": np.zeros(capacity, np.int32),
      "step": np.zeros(capacity, np.int32), "reward": np.zeros(capacity, np.float32),
      "done": np.zeros(capacity, bool), "action_valid": np.ones(capacity, bool),
      "score": np.zeros(capacity, np.float32), "segment_start": np.zeros(capacity, bool),
      "subgoal_changed": np.zeros(capacity, bool), "values": np.zeros((capacity, 3), np.float32),
      "token_values": np.zeros((capacity, num_tokens), np.float32),
      "response_mask": np.zeros((capacity, num_tokens), bool),
      "token_tags": np.zeros((capacity, num_tokens), np.int8),
  }
  for i, (t, s, n, done_last) in enumerate(rows):
    last = s == n - 1
    f["mask"][i], f["traj"][i], f["step"][i] = True, t, s
    f["done"][i] = last and done_last
    f["reward"][i] = (10.0 if (last and done_last and rng.random() < 0.5) else 0.0) + (
        rng.normal() if rng.random() < 0.2 else 0.0)
    f["action_valid"][i] = rng.random() >= p_invalid
    f["segment_start"][i] = rng.random() < (0.5 if s == 0 else p_switch)  # KEEP at turn 0 too
    f["subgoal_changed"][i] = s > 0 and (not f["segment_start"][i]) and rng.random() < 0.3
    f["values"][i] = rng.normal(size=3) * 3.0
    length = num_tokens if full else int(rng.integers(1, num_tokens + 1))
    f["response_mask"][i, :length] = True
    f["token_values"][i, :length] = rng.normal(size=length) * 3.0
    # Spans: [switch][subgoal][action][other]; some rows lack a span (missing tags), and
    # the token at a block boundary may straddle both blocks (a multi-block code).
    cuts = np.sort(rng.integers(0, length + 1, size=3))
    tags = np.zeros(length, np.int8)
    tags[:cuts[0]] = TAG_SWITCH
    tags[cuts[0]:cuts[1]] = TAG_SUBGOAL
    tags[cuts[1]:cuts[2]] = TAG_ACTION
    for c in cuts[:2]:
      if 0 < c < length and tags[c - 1] and tags[c] and tags[c - 1] != tags[c] and rng.random() < 0.5:
        both = np.add(BLOCK_TAGS[int(tags[c - 1])], BLOCK_TAGS[int(tags[c])]) > 0
        tags[c - 1] = CODE_OF_BLOCKS[tuple(int(b) for b in both)]
    f["token_tags"][i, :length] = tags
  # Row score S_t = R(tau) - eta * (1 - valid_t) with R(tau) = sum of the trajectory's rewards.
  ep = collections.defaultdict(float)
  for i in range(len(rows)):
    ep[int(f["traj"][i])] += float(f["reward"][i])
  for i in range(len(rows)):
    f["score"][i] = ep[int(f["traj"][i])] - 0.1 * (0.0 if f["action_valid"][i] else 1.0)
  if shuffle:
    perm = rng.permutation(capacity)
    f = {k: v[perm] for k, v in f.items()}
  return f
