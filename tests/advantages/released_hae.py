"""A readable float64 transcription of HiPER's released HAE path, for equivalence tests.

Source: JonP07/HiPER-agent@9d3c118, in the order `verl/trainer/ppo/ray_trainer.py`
(lines 1366-1400) calls it:
  1. `hiper_hae/hier_mask.py` `make_hae_masks_and_switch(batch, tokenizer,
     include_tags_mask=True)`: action / subgoal / switch token masks and the
     is-new-subgoal flag of every turn (written into `batch.non_tensor_batch['switch']`);
  2. `hiper_hae/core_hae.py` `compute_value_mask`: where V_high / V_low / V_term are read;
  3. `hiper_hae/core_hae.py` `compute_hae_advantage` with the HAEConfig of
     ray_trainer.py lines 1366-1386 (assign_high_to_subgoal, assign_term_to_switch,
     keep_consistency_requires_both=True).
Written from the released source, independently of `hgpo_jax` (no imports from it): plain
loops over trajectories, segments and tokens, float64 instead of torch float32.

A turn is a dict: traj, turn (turn_idx), ids (response token ids), reward, done, valid
(is_action_valid), values f64[L, 3] (per-token critic outputs, heads low/high/term).
`decode(id) -> str` is the tokenizer's single-token decode.
"""

from __future__ import annotations

import collections
import dataclasses

# hier_mask.py lines 115-138 (the same lists in core_hae.py lines 576-586).
CLOSE_SWITCH = ["</switch>", "</switch>\n"]
CLOSE_SUBGOAL = ["</subgoal>", "</subgoal>\n", "]</subgoal>", "]</subgoal>\n", ".</subgoal>",
                 ".</subgoal>\n", ")</subgoal>", ")</subgoal>\n"]
CLOSE_ACTION = ["</action>", "</action>\n", "]</action>", "]</action>\n", ".</action>",
                ".</action>\n", ")</action>", ")</action>\n"]


@dataclasses.dataclass(frozen=True)
class Config:
  """core_hae.py HAEConfig (lines 143-163) as ray_trainer.py fills it."""
  gamma: float = 1.0
  lam_turn: float = 1.0
  lam_seg: float = 0.95
  norm_adv: bool = True
  bootstrap_truncated: bool = False
  keep_penalty: float = 0.0
  keep_penalty_mode: str = "normalized"
  invalid_action_penalty_coef: float = 0.0
  keep_consistency_penalty: float = 0.0


def text_and_offsets(ids, decode):
  """hier_mask.py lines 8-20: per-token decode, char offsets."""
  pieces = [decode(i) for i in ids]
  offsets, pos = [], 0
  for p in pieces:
    offsets.append((pos, pos + len(p)))
    pos += len(p)
  return "".join(pieces), offsets


def find_tag_char_span(text, open_tag, close_tags):
  """hier_mask.py lines 37-51: the earliest closing variant after the opening tag."""
  s_open = text.find(open_tag)
  if s_open < 0:
    return None
  s_content = s_open + len(open_tag)
  s_close, close_len = None, 0
  for tag in close_tags:
    idx = text.find(tag, s_content)
    if idx >= 0 and (s_close is None or idx < s_close):
      s_close, close_len = idx, len(tag)
  if s_close is None:
    return None
  return s_open, s_content, s_close, close_len


def char_to_token_start(offsets, s_char):
  """hier_mask.py lines 23-27."""
  for i, (_, e) in enumerate(offsets):
    if e > s_char:
      return i
  return None


def char_to_token_end(offsets, e_char):
  """hier_mask.py lines 30-34 (core_hae.py lines 67-71)."""
  for i, (s, _) in enumerate(offsets):
    if s >= e_char:
      return i
  return len(offsets)


def span_from_tags(text, offsets, open_tag, close_tags):
  """hier_mask.py lines 54-80 with include_tags=True: token range [start, end) or None."""
  sp = find_tag_char_span(text, open_tag, close_tags)
  if sp is None:
    return None
  s_open, _, s_close, close_len = sp
  s_char, e_char = s_open, s_close + close_len
  if s_char >= e_char:
    return None
  t_start = char_to_token_start(offsets, s_char)
  if t_start is None:
    return None
  t_end = char_to_token_end(offsets, e_char)
  return None if t_start >= t_end else (t_start, t_end)


def masks_and_switch(turn, decode):
  """hier_mask.py lines 147-209 for one response: (action, subgoal, switch) bool lists and
  is_new_subgoal."""
  n = len(turn["ids"])
  action, subgoal, switch = [False] * n, [False] * n, [False] * n
  if n == 0:
    return action, subgoal, switch, False
  text, offsets = text_and_offsets(turn["ids"], decode)
  sp = span_from_tags(text, offsets, "<action>", CLOSE_ACTION)
  if sp is None:  # fallback_action_to_full_response=True
    action = [True] * n
  else:
    for j in range(*sp):
      action[j] = True
  sp = span_from_tags(text, offsets, "<subgoal>", CLOSE_SUBGOAL)
  if sp is not None:
    for j in range(*sp):
      subgoal[j] = True
  content = find_tag_char_span(text, "<switch>", CLOSE_SWITCH)
  switch_text = "KEEP"  # missing or empty content => KEEP
  if content is not None:
    _, s_c, s_e, _ = content
    if s_c < s_e and text[s_c:s_e].strip().upper():
      switch_text = text[s_c:s_e].strip().upper()
  sp = span_from_tags(text, offsets, "<switch>", CLOSE_SWITCH)
  if sp is not None:
    for j in range(*sp):
      switch[j] = True
  return action, subgoal, switch, switch_text not in {"KEEP"}


def token_after_tag(text, offsets, open_tag, close_tags):
  """core_hae.py lines 91-96: the first token after the block's closing tag, or None."""
  sp = find_tag_char_span(text, open_tag, close_tags)
  if sp is None:
    return None
  _, _, s_close, close_len = sp
  return char_to_token_end(offsets, s_close + close_len)


def value_positions(turn, decode, boundary):
  """core_hae.py compute_value_mask lines 598-641: (low, high or None, term) positions.

  V_low after </subgoal>, else after </switch>, else token 0 (a position past the
  response does not count); V_high at token 0 of boundary turns; V_term at token 0."""
  n = len(turn["ids"])
  text, offsets = text_and_offsets(turn["ids"], decode)
  low = token_after_tag(text, offsets, "<subgoal>", CLOSE_SUBGOAL)
  if low is None or low >= n:
    low = token_after_tag(text, offsets, "<switch>", CLOSE_SWITCH)
    if low is None or low >= n:
      low = 0
  return low, (0 if boundary else None), 0


def compute(turns, decode, cfg: Config):
  """The released advantages for a list of turns (any order).

  Returns per turn (same order): dict with `token_adv` f64[L], `loss_mask` bool[L],
  `returns` {head: (position or None, target)} and the masks.
  """
  n_rows = len(turns)
  by_traj = collections.defaultdict(list)
  for i, t in enumerate(turns):
    by_traj[t["traj"]].append(i)
  groups = {k: sorted(v, key=lambda i: turns[i]["turn"]) for k, v in by_traj.items()}

  # 1. hier_mask.py; ray_trainer.py line 1392 overwrites `switch` with is_new_subgoal.
  act_m, sub_m, sw_m, switch = [], [], [], []
  for t in turns:
    a, s, w, new = masks_and_switch(t, decode)
    act_m.append(a)
    sub_m.append(s)
    sw_m.append(w)
    switch.append(new)

  # Boundary turns (core_hae.py lines 466-477): the first turn and every switch turn.
  boundary = [False] * n_rows
  for idxs in groups.values():
    boundary[idxs[0]] = True
    for i in idxs[1:]:
      boundary[i] = boundary[i] or switch[i]

  # 2. compute_value_mask: the first turn and switch turns read V_high at token 0.
  pos = [value_positions(t, decode, boundary[i]) for i, t in enumerate(turns)]
  v_low = [turns[i]["values"][pos[i][0]][0] for i in range(n_rows)]
  # pick_value (lines 246-252): a row without a V_high position reads the last token;
  # its value is used only where V_high matters, i.e. at boundaries, which have one.
  v_high = [turns[i]["values"][pos[i][1] if pos[i][1] is not None else len(turns[i]["ids"]) - 1][1]
            for i in range(n_rows)]
  v_term = [turns[i]["values"][pos[i][2]][2] for i in range(n_rows)]

  # 3. compute_hae_advantage. Rewards (lines 187-243).
  r = [float(t["reward"]) for t in turns]
  if cfg.keep_penalty != 0.0:
    if cfg.keep_penalty_mode == "fixed":
      for i in range(n_rows):
        if not switch[i]:
          r[i] += cfg.keep_penalty
    else:  # "normalized"
      for idxs in groups.values():
        if len(idxs) <= 1:
          continue
        keep_count = sum(1 for i in idxs if not switch[i])
        if keep_count > 0:
          per_keep = cfg.keep_penalty * (keep_count / len(idxs)) / keep_count
          for i in idxs:
            if not switch[i]:
              r[i] += per_keep
  if cfg.invalid_action_penalty_coef != 0.0:
    for i, t in enumerate(turns):
      r[i] -= cfg.invalid_action_penalty_coef * (0.0 if t["valid"] else 1.0)
  if cfg.keep_consistency_penalty != 0.0:
    for idxs in groups.values():
      for k in range(1, len(idxs)):
        i, prev = idxs[k], idxs[k - 1]
        if switch[i]:
          continue
        cur_toks = [x for x, m in zip(turns[i]["ids"], sub_m[i]) if m]
        prev_toks = [x for x, m in zip(turns[prev]["ids"], sub_m[prev]) if m]
        if not cur_toks or not prev_toks:  # keep_consistency_requires_both
          continue
        if cur_toks != prev_toks:
          r[i] += cfg.keep_consistency_penalty

  # Segments (lines 300-318).
  segs = {}
  for tid, idxs in groups.items():
    bpos = sorted({0} | {p for p in range(1, len(idxs)) if switch[idxs[p]]})
    segs[tid] = [(s, bpos[k + 1] - 1 if k + 1 < len(bpos) else len(idxs) - 1,
                  bpos[k + 1] if k + 1 < len(bpos) else None) for k, s in enumerate(bpos)]

  # Low level (lines 324-368).
  adv_low, ret_low = [0.0] * n_rows, [0.0] * n_rows
  for tid, idxs in groups.items():
    for s, e, nxt in segs[tid]:
      next_adv = 0.0
      for p in range(e, s - 1, -1):
        i = idxs[p]
        not_done = 0.0 if turns[i]["done"] else 1.0
        if p < e:
          v_next = v_low[idxs[p + 1]]
        elif not_done > 0 and nxt is not None:
          v_next = v_high[idxs[nxt]]
        elif not_done > 0 and cfg.bootstrap_truncated:
          v_next = v_low[i]
        else:
          v_next = 0.0
        delta = r[i] + cfg.gamma * not_done * v_next - v_low[i]
        adv_low[i] = delta + cfg.gamma * cfg.lam_turn * not_done * next_adv
        ret_low[i] = adv_low[i] + v_low[i]
        next_adv = adv_low[i]

  # High level and termination returns (lines 374-459).
  adv_high, ret_high, ret_term = [0.0] * n_rows, [0.0] * n_rows, [0.0] * n_rows
  for tid, idxs in groups.items():
    next_seg_adv = 0.0
    for s, e, nxt in reversed(segs[tid]):
      start_i, end_i = idxs[s], idxs[e]
      seg_return, disc = 0.0, 1.0
      for p in range(s, e + 1):
        seg_return += disc * r[idxs[p]]
        disc *= cfg.gamma
      d_k = e - s + 1
      not_done_end = 0.0 if turns[end_i]["done"] else 1.0
      if not_done_end > 0 and nxt is not None:
        boot = v_high[idxs[nxt]]
      elif not_done_end > 0 and cfg.bootstrap_truncated:
        boot = v_high[start_i]
      else:
        boot = 0.0
      target = seg_return + cfg.gamma ** d_k * not_done_end * boot
      seg_adv = target - v_high[start_i] + cfg.gamma ** d_k * cfg.lam_seg * not_done_end * next_seg_adv
      adv_high[start_i] = seg_adv
      ret_high[start_i] = seg_adv + v_high[start_i]
      next_seg_adv = seg_adv
      ret_next = boot
      for p in range(e, s - 1, -1):
        ret_next = r[idxs[p]] + cfg.gamma * ret_next
        ret_term[idxs[p]] = ret_next
  adv_term = [ret_term[i] - v_term[i] for i in range(n_rows)]

  # Token masks (lines 479-493) and per-level whitening over the rows carrying tokens
  # (lines 496-513: population std + 1e-8).
  hi_m = [[m and boundary[i] for m in sub_m[i]] for i in range(n_rows)]
  lo_m, te_m = act_m, sw_m

  def whiten(x, masks):
    rows = [i for i in range(n_rows) if any(masks[i])]
    if not rows:
      return x
    mean = sum(x[i] for i in rows) / len(rows)
    std = (sum((x[i] - mean) ** 2 for i in rows) / len(rows)) ** 0.5 + 1e-8
    return [(v - mean) / std for v in x]

  if cfg.norm_adv:
    adv_low, adv_high, adv_term = whiten(adv_low, lo_m), whiten(adv_high, hi_m), whiten(adv_term, te_m)

  out = []
  for i, t in enumerate(turns):
    n = len(t["ids"])
    token_adv = [adv_low[i] * lo_m[i][j] + adv_high[i] * hi_m[i][j] + adv_term[i] * te_m[i][j]
                 for j in range(n)]  # line 549: the levels sum where masks overlap
    out.append({
        "token_adv": token_adv,
        "loss_mask": [lo_m[i][j] or hi_m[i][j] or te_m[i][j] for j in range(n)],
        "returns": {"low": (pos[i][0], ret_low[i]), "high": (pos[i][1], ret_high[i]),
                    "term": (pos[i][2], ret_term[i])},
        "switch": switch[i], "boundary": boundary[i], "reward": r[i],
    })
  return out
