"""The search env in process: Search-R1's reward against a readable reference, the data
loaders (synthetic frozen files, Search-R1's formats, one-line errors), episodes, anchor
states and bad inputs."""

import json
import string

import pytest

from env_servers import base
from env_servers import registry
from env_servers.search import dataset
from env_servers.search import env as search_env
from env_servers.search import reward
from env_servers.search import synthetic


# -- reward --------------------------------------------------------------------------------
def _reference_normalize(s: str) -> str:
  """Search-R1's qa_em.normalize_answer, step by step: lower, remove punctuation, replace
  whole-word articles by a space, then split/join on whitespace."""
  s = s.lower()
  s = "".join(ch for ch in s if ch not in set(string.punctuation))
  words = []
  for word in s.split(" "):  # whole-word articles; spaces kept as separators
    words.append(" " if word in ("a", "an", "the") else word)
  return " ".join(" ".join(words).split())


def _reference_f1(pred: str, gold: str) -> float:
  p, g = _reference_normalize(pred).split(), _reference_normalize(gold).split()
  remaining, common = list(g), 0
  for token in p:
    if token in remaining:
      remaining.remove(token)
      common += 1
  if common == 0:
    return 0.0
  precision, recall = common / len(p), common / len(g)
  return 2 * precision * recall / (precision + recall)


CASES = ["The Eiffel Tower", "  eiffel   tower!! ", "an apple a day", "Theater", "A.B.C.",
         "the the", "Paris, France", "U.S.A", "Kelmar-Dovin", "annex", "1987", "",
         "A  Tale\tof Two\nCities", "l'Oréal", "Thea and the ant"]


@pytest.mark.parametrize("text", CASES)
def test_normalisation_equals_the_reference(text):
  assert reward.normalize_answer(text) == _reference_normalize(text)


def test_normalisation_golden_values():
  assert reward.normalize_answer("The Eiffel Tower!") == "eiffel tower"
  assert reward.normalize_answer("Theater of an Annex") == "theater of annex"
  assert reward.normalize_answer("Kelmar-Dovin") == "kelmardovin"  # punctuation removed, not spaced
  assert reward.normalize_answer("l'Oréal") == "loréal"  # only ASCII punctuation


def test_exact_match_over_several_golds():
  golds = ["Ruvin", "Dafil"]
  assert reward.exact_match("dafil", golds) == 1.0
  assert reward.exact_match("The Ruvin.", golds) == 1.0
  assert reward.exact_match("Ruvin city", golds) == 0.0
  assert reward.exact_match("", golds) == 0.0
  assert reward.exact_match("", [""]) == 1.0  # as Search-R1: both normalise to ""


@pytest.mark.parametrize("pred,golds,expected", [
    ("Zethbaex Quimtirsiox", ["Zethbaex Quimtirsiox"], 1.0),
    ("Zethbaex", ["Zethbaex Quimtirsiox"], 2 * 1.0 * 0.5 / 1.5),
    ("the poet Zethbaex", ["Zethbaex Quimtirsiox", "poet Zethbaex"], 1.0),
    ("Paris Paris London", ["Paris London"], 2 * (2 / 3) * 1.0 / (2 / 3 + 1.0)),
    ("nothing", ["Ruvin", "Dafil"], 0.0),
    ("", ["Ruvin"], 0.0),
])
def test_f1_golden_values_and_reference(pred, golds, expected):
  assert reward.f1(pred, golds) == pytest.approx(expected, abs=1e-12)
  assert reward.f1(pred, golds) == pytest.approx(max(_reference_f1(pred, g) for g in golds),
                                                 abs=1e-12)


# -- data ----------------------------------------------------------------------------------
def test_the_frozen_synthetic_files_regenerate_byte_for_byte():
  for name, text in synthetic.files().items():
    assert (dataset.SYNTHETIC_DIR / name).read_text(encoding="utf-8") == text, name
  sizes = sum((dataset.SYNTHETIC_DIR / name).stat().st_size for name in synthetic.files())
  assert sizes < 1_000_000


def test_synthetic_splits_ask_about_disjoint_organisations():
  train = dataset.load_questions(dataset.SYNTHETIC_DIR / "train.jsonl")
  test = dataset.load_questions(dataset.SYNTHETIC_DIR / "test.jsonl")
  assert (len(train), len(test)) == (384, 96)
  org = lambda q: q.question.rstrip("?").split(" of ")[-1].replace("Who founded ", "")
  assert not {org(q) for q in train} & {org(q) for q in test}
  corpus = dataset.load_corpus(dataset.SYNTHETIC_DIR / "corpus.jsonl")
  assert len(corpus) == 420
  # two-hop answers never appear in a passage that names the organisation's founder's org
  q = test[1]
  assert q.golds == ("Ruvin", "Dafil") and q.source == "synthetic-2hop-birth-city"
  assert not any("Liorkexkuth" in p.text and "Ruvin" in p.text for p in corpus)


def test_search_r1_formats_load(tmp_path):
  (tmp_path / "corpus.jsonl").write_text(
      json.dumps({"id": "7", "contents": '"Aaron"\nAaron is a prophet.'}) + "\n")
  (tmp_path / "nq.jsonl").write_text(json.dumps(
      {"id": "q1", "question": "who is aaron?", "golden_answers": ["a prophet", "prophet"]}) + "\n")
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"data_source": "hotpotqa", "prompt": [{"role": "user", "content":
           "Answer the given question. ... Question: where was aaron born?\n"}],
           "reward_model": {"style": "rule", "ground_truth": {"target": ["Egypt"]}},
           "extra_info": {"split": "test", "index": 3}}]
  pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
  corpus = dataset.load_corpus(tmp_path / "corpus.jsonl")
  assert corpus == [dataset.Passage("7", '"Aaron"', "Aaron is a prophet.")]
  assert sorted(dataset.question_files(tmp_path)) == ["nq", "test"]
  assert dataset.load_questions(tmp_path / "nq.jsonl") == [
      dataset.Question("q1", "who is aaron?", ("a prophet", "prophet"))]
  assert dataset.load_questions(tmp_path / "test.parquet") == [
      dataset.Question("3", "where was aaron born?", ("Egypt",), "hotpotqa")]
  env = search_env.SearchEnv(data_dir=str(tmp_path))
  assert env.splits() == ["nq", "test"] and env.task_ids("test") == ["3"]
  env.reset(options={"task_id": "q1"})
  obs, *_ = env.step("<search>aaron</search>")
  assert obs == '<information>Doc 1(Title: "Aaron") Aaron is a prophet.</information>'


@pytest.mark.parametrize("files,message", [
    ({}, "no question file"),
    ({"train.jsonl": "{not json\n"}, "train.jsonl:1: not a JSON line"),
    ({"train.jsonl": '{"question": "q"}\n'}, "train.jsonl:1: row without a question or gold"),
    ({"train.jsonl": '{"id": 1, "question": "q", "golden_answers": ["a"]}\n' * 2},
     "train.jsonl:2: question id '1' appears twice"),
    ({"train.parquet": "garbage"}, "train.parquet: not a readable parquet file"),
    ({"train.jsonl": '{"question": "q", "golden_answers": ["a"]}\n'}, "corpus.jsonl not found"),
    ({"train.jsonl": '{"question": "q", "golden_answers": ["a"]}\n',
      "corpus.jsonl": '{"id": 0, "text": "x"}\n'}, "corpus.jsonl:1: no string field 'contents'"),
])
def test_bad_data_is_a_one_line_error(tmp_path, files, message):
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  with pytest.raises(ValueError, match=message) as e:
    search_env.SearchEnv(data_dir=str(tmp_path))
  assert "\n" not in str(e.value)


def test_missing_data_dir_and_bad_args_are_one_line_errors(tmp_path):
  with pytest.raises(ValueError, match="is not a directory"):
    search_env.SearchEnv(data_dir=str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match="actions must be one of"):
    search_env.SearchEnv(actions="menu")
  with pytest.raises(ValueError, match="must be integers"):
    search_env.SearchEnv(topk="three")


# -- episodes ------------------------------------------------------------------------------
@pytest.fixture(name="env", scope="module")
def fixture_env():
  return registry.make_env("search")


def _play(env, task_id, actions):
  obs, info = env.reset(options={"task_id": task_id})
  out = [(obs, 0.0, False, False, info)]
  for a in actions:
    out.append(env.step(a))
  return out


def test_two_hop_episode_answers_with_either_gold(env):
  q = env._by_id["test-0001"]
  assert q.question == "In which city was the founder of Liorkexkuth Works born?"
  for answer in ["Ruvin", " the  ruvin. ", "DAFIL"]:
    steps = _play(env, "test-0001", ["<search>Liorkexkuth Works</search>",
                                     "<search>Zethbaex Quimtirsiox</search>",
                                     f"<answer>{answer}</answer>"])
    obs1 = steps[1][0]
    assert obs1.startswith("<information>Doc 1(Title: Liorkexkuth Works) Liorkexkuth Works is a "
                           "shipyard founded in 1964 by Zethbaex Quimtirsiox.")
    assert obs1.count("\nDoc ") == 2 and obs1.endswith("</information>")  # top-3
    assert "Ruvin" in steps[2][0]
    _, r, terminated, truncated, info = steps[3]
    assert (r, terminated, truncated, info[base.WON], info["f1"]) == (1.0, True, False, True, 1.0)


def test_wrong_answer_scores_zero_with_f1(env):
  _, r, terminated, _, info = _play(env, "test-0000", ["<answer>Zethbaex</answer>"])[-1]
  assert (r, terminated, info[base.WON]) == (0.0, True, False)
  assert info["f1"] == pytest.approx(2 / 3) and info[base.SCORE] == pytest.approx(2 / 3)


def test_turn_limit_truncates(env):
  steps = _play(env, "test-0000", ["<search>Liorkexkuth Works</search>"] * 4)
  assert [s[2:4] for s in steps[1:]] == [(False, False)] * 3 + [(False, True)]
  assert steps[-1][0] == "" and steps[-1][1] == 0.0  # the 4th turn searches nothing
  with pytest.raises(RuntimeError, match="reset first"):
    env.step("<answer>x</answer>")
  # an answer on the last turn still counts
  steps = _play(env, "test-0000",
                ["<search>x</search>"] * 3 + ["<answer>Zethbaex Quimtirsiox</answer>"])
  assert steps[-1][1:4] == (1.0, True, False)


def test_anchor_equal_for_equal_question_and_retrieved_history(env):
  a = _play(env, "test-0001", ["<search>Liorkexkuth Works</search>", "no tags at all"])
  b = _play(env, "test-0001", ["<search>  liorkexkuth works?</search>"])
  c = _play(env, "test-0001", ["<search>Zethbaex Quimtirsiox</search>"])
  d = _play(env, "test-0002", ["<search>Liorkexkuth Works</search>"])
  anchor = lambda step: step[4][base.ANCHOR_OBS]
  assert anchor(a[0]) == b[0][0] == "In which city was the founder of Liorkexkuth Works born?"
  assert anchor(a[1]) == anchor(a[2]) == anchor(b[1])  # invalid turn: same state
  assert anchor(a[1]) == anchor(a[0]) + "\n" + a[1][0]
  assert anchor(c[1]) != anchor(a[1]) and anchor(d[1]) != anchor(a[1])


def test_invalid_actions_as_verl_agent(env):
  _play(env, "test-0000", [])
  obs, r, terminated, truncated, info = env.step("I think the answer is Ruvin")
  assert (obs, r, terminated, truncated, info["action_valid"]) == ("", 0.0, False, False, False)
  assert info["invalid_reason"] == "no <search>...</search> or <answer>...</answer> block"
  obs, _, _, _, info = env.step("<search>   </search>")
  assert (obs, info["action_valid"], info["invalid_reason"]) == ("", False, "empty search query")
  # two tags: an answer ends the episode (verl-agent's _is_done), whatever else is there
  _, r, terminated, _, _ = env.step("<search>a</search><answer>Zethbaex Quimtirsiox</answer>")
  assert (r, terminated) == (1.0, True)
  # two searches: the first one is run
  _play(env, "test-0000", [])
  _, _, _, _, info = env.step("<search>Ruvin</search><search>Kiostel</search>")
  assert info["query"] == "Ruvin"


def test_empty_result_and_over_long_passages(env, tmp_path):
  _play(env, "test-0000", [])
  obs, _, _, _, info = env.step("<search>the of and</search>")  # stop words only
  assert obs == "<information>No search results found.</information>" and info["num_hits"] == 0
  (tmp_path / "corpus.jsonl").write_text(json.dumps(
      {"id": "0", "contents": "Long\n" + " ".join(f"w{i}" for i in range(300))}) + "\n")
  (tmp_path / "train.jsonl").write_text('{"id": "a", "question": "q", "golden_answers": ["x"]}\n')
  small = search_env.SearchEnv(data_dir=str(tmp_path), passage_words="5")
  small.reset(options={"task_id": "a"})
  obs, _, _, _, info = small.step("<search>w3</search>")
  assert obs == "<information>Doc 1(Title: Long) w0 w1 w2 w3 w4 ...</information>"
  assert info["passage_truncated"] is True
  _, _, _, _, info = small.step("<search>" + "w1 " * 2000 + "</search>")
  assert len(info["query"]) == search_env.MAX_QUERY_CHARS  # stripped, then cut


def test_listed_actions_lead_to_the_answer():
  env = search_env.SearchEnv(actions="listed")
  _, info = env.reset(options={"task_id": "test-0001"})
  assert info[base.ADMISSIBLE] == [
      "<search>In which city was the founder of Liorkexkuth Works born?</search>",
      "<search>Liorkexkuth Works</search>"]
  _, _, _, _, info = env.step("<search>Liorkexkuth Works</search>")
  assert "<search>Zethbaex Quimtirsiox</search>" in info[base.ADMISSIBLE]
  assert "<search>Liorkexkuth Works</search>" not in info[base.ADMISSIBLE]  # searched already
  _, _, _, _, info = env.step("<search>Zethbaex Quimtirsiox</search>")
  answers = [a for a in info[base.ADMISSIBLE] if a.startswith("<answer>")]
  assert answers[:3] == ["<answer>Zethbaex Quimtirsiox</answer>", "<answer>1931</answer>",
                         "<answer>Ruvin</answer>"]
  assert len(answers) <= 12
  _, r, terminated, _, info = env.step("<answer>Ruvin</answer>")
  assert (r, terminated, info[base.ADMISSIBLE]) == (1.0, True, [])


def test_reset_is_deterministic_and_needs_known_ids(env):
  assert env.splits() == ["test", "train"]
  assert len(env.task_ids("train")) == 384
  with pytest.raises(ValueError, match="unknown search task id"):
    env.reset(options={"task_id": "nope"})
  with pytest.raises(ValueError, match="unknown search split"):
    env.task_ids("dev")
  a = env.reset(seed=5, options={"split": "train"})
  b = env.reset(seed=5, options={"split": "train"})
  assert a == b
