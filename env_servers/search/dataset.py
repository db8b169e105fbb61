"""Question sets and passage corpora in Search-R1's released formats.

A data directory holds a corpus and one question file per split:

  corpus.jsonl             one passage a line: {"id": ..., "contents": "title\\ntext"}
                           (Search-R1's wiki-18 format; the first line of `contents` is the
                           title, the rest the text)
  <split>.jsonl            one question a line: {"id", "question", "golden_answers": [...],
  <split>.parquet          "data_source"} (FlashRAG / Search-R1 raw files), or the
                           processed parquet/jsonl rows of Search-R1 and verl-agent, whose
                           golds sit in reward_model.ground_truth.target and whose question
                           sits in env_kwargs / extra_info or a "Question: ..." prompt line

The shipped directory `data/synthetic_v1` (written by `python -m
env_servers.search.synthetic`) is in the same format, so one loader reads both. Every
problem a user can hit (missing file, malformed line, a row without question or golds)
is a one-line `ValueError` naming the file and the line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, Iterable

DATA_DIR = pathlib.Path(__file__).resolve().parent / "data"
SYNTHETIC_DIR = DATA_DIR / "synthetic_v1"
QUESTION_SUFFIXES = (".jsonl", ".parquet")
CORPUS_FILE = "corpus.jsonl"


@dataclasses.dataclass(frozen=True)
class Passage:
  """One corpus passage: `title` is the first line of Search-R1's `contents`."""
  id: str
  title: str
  text: str


@dataclasses.dataclass(frozen=True)
class Question:
  id: str
  question: str
  golds: tuple[str, ...]
  source: str = ""


def corpus_path(data_dir: str = "", corpus: str = "") -> str:
  """The corpus a search env reads: `corpus`, else `data_dir`'s corpus.jsonl, else the
  synthetic set's (the env's `data_dir` / `corpus` arguments)."""
  return corpus or f"{data_dir or SYNTHETIC_DIR}/{CORPUS_FILE}"


def passage_from_contents(pid: str, contents: str) -> Passage:
  title, _, text = contents.partition("\n")
  return Passage(str(pid), title.strip(), text.strip())


def _jsonl_rows(path: pathlib.Path) -> Iterable[tuple[int, dict]]:
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{n}: not a JSON line ({e.msg}); fix or remove the line") from None
      if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: a JSON object is expected, got {type(row).__name__}")
      yield n, row


def load_corpus(path: str | os.PathLike) -> list[Passage]:
  """The passages of a corpus jsonl, in file order (the order is the retriever's doc id)."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"search corpus {path} not found; pass corpus=PATH (Search-R1's "
                     "wiki-18.jsonl) or a data_dir holding corpus.jsonl")
  out = []
  for n, row in _jsonl_rows(path):
    if not isinstance(row.get("contents"), str):
      raise ValueError(f"{path}:{n}: no string field 'contents' (\"title\\ntext\"); is this "
                       "a Search-R1 corpus file?")
    out.append(passage_from_contents(row.get("id", n - 1), row["contents"]))
  if not out:
    raise ValueError(f"search corpus {path} holds no passage")
  return out


def _question_of(row: dict[str, Any]) -> str | None:
  for key in ("question",):
    if isinstance(row.get(key), str):
      return row[key]
  for nest in ("env_kwargs", "extra_info"):
    value = row.get(nest)
    if isinstance(value, dict) and isinstance(value.get("question"), str):
      return value["question"]
  prompt = row.get("prompt")  # Search-R1's processed rows: the template with "Question: ..."
  if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[-1], dict):
    content = str(prompt[-1].get("content", ""))
    at = content.rfind("Question:")
    if at != -1:
      return content[at + len("Question:"):].strip()
  return None


def _golds_of(row: dict[str, Any]) -> list[str] | None:
  candidates = [row.get("golden_answers")]
  for nest in ("reward_model", "env_kwargs"):
    value = row.get(nest)
    if isinstance(value, dict) and isinstance(value.get("ground_truth"), dict):
      candidates.append(value["ground_truth"].get("target"))
  for golds in candidates:
    if isinstance(golds, str):
      return [golds]
    if golds is not None and not isinstance(golds, dict):
      golds = [str(g) for g in list(golds)]
      if golds:
        return golds
  return None


def _question_rows(path: pathlib.Path) -> Iterable[tuple[int, dict]]:
  if path.suffix == ".jsonl":
    yield from _jsonl_rows(path)
    return
  try:
    import pyarrow.parquet as pq
  except ImportError:
    raise ValueError(f"{path}: reading parquet needs pyarrow; pip install pyarrow, or convert "
                     "the file to jsonl") from None
  try:
    table = pq.read_table(path)
  except Exception as e:  # pyarrow raises several types for a corrupt file
    raise ValueError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
  for n, row in enumerate(table.to_pylist(), 1):
    yield n, row


def load_questions(path: str | os.PathLike) -> list[Question]:
  """The questions of one split file (.jsonl or .parquet), ids unique within the file."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"question file {path} not found")
  out, seen = [], set()
  for n, row in _question_rows(path):
    question, golds = _question_of(row), _golds_of(row)
    if question is None or not golds:
      raise ValueError(f"{path}:{n}: row without a question or gold answers (expected "
                       "'question' and 'golden_answers', or Search-R1's processed fields)")
    extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
    qid = str(row.get("id", extra.get("index", n - 1)))
    if qid in seen:
      raise ValueError(f"{path}:{n}: question id {qid!r} appears twice; ids must be unique")
    seen.add(qid)
    out.append(Question(qid, question.strip(), tuple(golds), str(row.get("data_source", ""))))
  if not out:
    raise ValueError(f"question file {path} holds no question")
  return out


def question_files(data_dir: str | os.PathLike) -> dict[str, pathlib.Path]:
  """split name -> question file of a data directory (every *.jsonl / *.parquet but the
  corpus)."""
  data_dir = pathlib.Path(data_dir)
  if not data_dir.is_dir():
    raise ValueError(f"search data_dir {data_dir} is not a directory; give the directory "
                     "holding <split>.jsonl|.parquet (and corpus.jsonl)")
  out = {}
  for path in sorted(data_dir.iterdir()):
    if path.suffix in QUESTION_SUFFIXES and path.name != CORPUS_FILE:
      if path.stem in out:
        raise ValueError(f"split {path.stem!r} has two files in {data_dir}; keep one")
      out[path.stem] = path
  if not out:
    raise ValueError(f"no question file (<split>.jsonl or .parquet) in {data_dir}")
  return out
