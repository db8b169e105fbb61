"""Search-R1's answer scoring: normalisation, exact match (the reward) and token F1.

Search-R1 (arXiv 2503.09516; PeterGriffinJin/Search-R1 verl/utils/reward_score/qa_em.py,
used unchanged by verl-agent's search env) normalises an answer by lower-casing it,
removing ASCII punctuation, removing the articles a/an/the as whole words and collapsing
whitespace; the reward is 1 when the normalised answer equals any normalised gold answer,
else 0. F1 (SQuAD's token F1 over the same normalisation, best over the golds) is logged as
a metric only: it is not part of the published reward.
"""

from __future__ import annotations

import collections
import re
import string
from typing import Sequence

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
  """lower -> drop punctuation -> articles to spaces -> single spaces (Search-R1's order)."""
  text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Sequence[str]) -> float:
  """1.0 when the normalised prediction equals a normalised gold answer, else 0.0."""
  pred = normalize_answer(prediction)
  return float(any(pred == normalize_answer(g) for g in golds))


def f1(prediction: str, golds: Sequence[str]) -> float:
  """Best token F1 between the normalised prediction and each normalised gold (0 if none)."""
  pred = normalize_answer(prediction).split()
  best = 0.0
  for gold in golds:
    ref = normalize_answer(gold).split()
    common = sum((collections.Counter(pred) & collections.Counter(ref)).values())
    if common:
      precision, recall = common / len(pred), common / len(ref)
      best = max(best, 2 * precision * recall / (precision + recall))
  return best
