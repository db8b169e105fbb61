"""GiGPO's similarity grouping of anchor observations (host side).

For tasks where exact repeats of an observation are rare, GiGPO (arXiv 2505.10978,
§4.2 and its QA experiments) groups near-identical observations. The released code
(verl-agent `gigpo/core_gigpo.py`, `build_step_group(enable_similarity=True)`) uses a
greedy rule inside each episode group: rows are visited in batch order, and a row
joins the first existing cluster (in creation order) whose representative (its first
member) satisfies `difflib.SequenceMatcher(None, obs, rep).ratio() >= thresh`,
otherwise it opens a new cluster. `greedy_clusters_reference` restates that rule.

`greedy_clusters` returns the same clusters faster, exactly:
  * identical strings always land in the same cluster (the first copy found or opened
    it, and clusters opened later come after it in the scan), so only the distinct
    strings are clustered, in first-appearance order;
  * difflib's ratio is 2M / (|a| + |b|) where its matching blocks are a common
    subsequence, so M <= LCS(a, b) and ratio <= 2 LCS / (|a| + |b|), which is
    rapidfuzz's Indel similarity / (|a| + |b|); and M <= min(|a|, |b|). Both bounds are
    computed in C (rapidfuzz `process.cdist` over the representatives) and only the
    representatives that pass them are confirmed with difflib itself, in creation
    order, so the first confirmed one is the published rule's choice.
"""

from __future__ import annotations

import difflib
from typing import Sequence

import numpy as np
from rapidfuzz import process
from rapidfuzz.distance import Indel

_SLACK = 1e-9
"""The upper bounds are compared with thresh - _SLACK so float round-off never prunes a match."""


def check_threshold(thresh: float) -> None:
  if not 0.0 < thresh < 1.0:
    raise ValueError(f"similarity_thresh={thresh!r} must be in (0, 1) (1 means exact grouping: "
                     "disable the similarity option instead)")


def _check_texts(texts: Sequence) -> None:
  bad = next((t for t in texts if not isinstance(t, str)), None)
  if bad is not None:
    raise ValueError(f"similarity grouping needs text observations, got {type(bad).__name__} "
                     f"{bad!r}; disable the similarity option for non-text anchors")


def greedy_clusters_reference(texts: Sequence[str], thresh: float) -> np.ndarray:
  """The published greedy rule, row by row with difflib: int64[n] cluster index per text."""
  check_threshold(thresh)
  _check_texts(texts)
  reps: list[str] = []
  out = np.empty(len(texts), np.int64)
  for i, obs in enumerate(texts):
    for c, rep in enumerate(reps):
      if difflib.SequenceMatcher(None, obs, rep).ratio() >= thresh:
        out[i] = c
        break
    else:
      out[i] = len(reps)
      reps.append(obs)
  return out


def greedy_clusters(texts: Sequence[str], thresh: float,
                    memo: dict | None = None) -> np.ndarray:
  """Same clusters as `greedy_clusters_reference` (module docstring), int64[n].

  `memo` (optional, shared across calls) caches difflib decisions per (text, rep) pair:
  episode groups of one batch see the same observations again and again.
  """
  check_threshold(thresh)
  _check_texts(texts)
  first = {t: None for t in texts}  # distinct texts in first-appearance order
  reps: list[str] = []
  rep_len: list[int] = []
  for text in first:
    cluster = len(reps)
    if reps:
      lens = np.asarray(rep_len)
      fits = np.flatnonzero(2.0 * np.minimum(lens, len(text)) >= (thresh - _SLACK) *
                            (lens + len(text)))
      if fits.size:
        cand = [reps[c] for c in fits]
        # Indel.similarity = |a| + |b| - indel distance = 2 LCS, an exact integer. (Its
        # normalised form with score_cutoff drops pairs exactly at the cutoff, so the
        # comparison is done here.)
        lcs2 = process.cdist([text], cand, scorer=Indel.similarity, dtype=np.int64)[0]
        upper = lcs2 >= (thresh - _SLACK) * (lens[fits] + len(text))
        for c in fits[upper]:
          if _similar(text, reps[c], thresh, memo):
            cluster = int(c)
            break
    if cluster == len(reps):
      reps.append(text)
      rep_len.append(len(text))
    first[text] = cluster
  return np.fromiter((first[t] for t in texts), np.int64, len(texts))


def _similar(text: str, rep: str, thresh: float, memo: dict | None) -> bool:
  if memo is None:
    return difflib.SequenceMatcher(None, text, rep).ratio() >= thresh
  key = (text, rep)
  if key not in memo:
    memo[key] = difflib.SequenceMatcher(None, text, rep).ratio() >= thresh
  return memo[key]


def cluster_in_groups(texts: Sequence[str], group: np.ndarray, thresh: float, *,
                      reference: bool = False) -> np.ndarray:
  """int64[n] anchor ids: equal iff same episode group and same greedy cluster.

  Rows of each group are clustered in input order (the published rule's batch order).
  """
  memo = {}
  fn = greedy_clusters_reference if reference else (
      lambda t, th: greedy_clusters(t, th, memo))
  group = np.asarray(group)
  order = np.argsort(group, kind="stable")
  bounds = np.flatnonzero(np.r_[True, group[order][1:] != group[order][:-1], True])
  out = np.empty(len(texts), np.int64)
  offset = 0
  for lo, hi in zip(bounds[:-1], bounds[1:]):
    rows = order[lo:hi]
    ids = fn([texts[i] for i in rows], thresh)
    out[rows] = ids + offset
    offset += int(ids.max()) + 1
  return out
