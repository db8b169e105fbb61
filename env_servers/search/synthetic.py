"""A generated multi-hop QA corpus on which answers need retrieval (labelled synthetic).

  python -m env_servers.search.synthetic --out env_servers/search/data/synthetic_v1

Invented people, organisations, cities and countries (names from random syllables, so no
pretrained model knows them) are described by one passage each, in Search-R1's corpus
format. Every question names an organisation and asks about something one or two hops
away: "Who founded X?" (one hop), "In which city was the founder of X born?", "In what
year was the founder of X born?" and "In which country is the headquarters city of X?"
(two hops: the organisation's passage names the founder or city, whose own passage holds
the answer; a person's passage never names their organisation, so no single search of
the question finds it). City answers carry the city's second name as a further gold.

The train and test splits ask about disjoint organisations. Everything derives from
`random.Random(SEED)`, so the files are identical on every machine and Python version;
the frozen copy `data/synthetic_v1` is what the configs read, and a test regenerates it
byte for byte. This is not Search-R1's benchmark (NQ/HotpotQA over Wikipedia):
docs/environments.md says what carries over.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

SEED = "hgpo_jax/search/synthetic/v1"
NUM_COUNTRIES, NUM_CITIES, NUM_PEOPLE, NUM_ORGS = 12, 60, 240, 120
TEST_ORGS = 24  # the last organisations' questions form the test split

_ONSETS = ["b", "d", "k", "l", "m", "n", "r", "s", "t", "v", "z", "th", "dr", "gr", "qu", "f"]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "io", "ou"]
_CODAS = ["", "", "n", "r", "s", "l", "th", "m", "x"]
_OCCUPATIONS = ["painter", "chemist", "poet", "engineer", "astronomer", "composer",
                "architect", "botanist", "sculptor", "economist"]
_TOPICS = ["tidal clocks", "glass lenses", "river maps", "folk songs", "salt bridges",
           "wind engines", "paper kites", "copper inks", "silk looms", "ice houses"]
_ORG_KINDS = [("Industries", "manufacturing company"), ("Institute", "research institute"),
              ("Records", "record label"), ("Foundry", "metal foundry"),
              ("Press", "publishing house"), ("Works", "shipyard")]


class _Names:
  """Unique capitalised names from random syllables."""

  def __init__(self, rng: random.Random):
    self.rng, self.used = rng, set()

  def word(self, syllables: tuple[int, int] = (2, 3)) -> str:
    while True:
      n = self.rng.randint(*syllables)
      word = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                     for _ in range(n)).capitalize()
      if word not in self.used and len(word) >= 4:
        self.used.add(word)
        return word


def generate() -> tuple[list[dict], dict[str, list[dict]]]:
  """(corpus rows, {split: question rows}) in the data directory's jsonl formats."""
  rng = random.Random(SEED)
  names = _Names(rng)
  countries = [names.word() + "ia" for _ in range(NUM_COUNTRIES)]
  cities = [{"name": names.word(), "alias": names.word(), "country": rng.choice(countries),
             "population": rng.randrange(20, 900) * 1000} for _ in range(NUM_CITIES)]
  people = [{"name": f"{names.word((1, 2))} {names.word()}", "year": rng.randint(1850, 1990),
             "city": rng.choice(cities)["name"], "occupation": rng.choice(_OCCUPATIONS),
             "topic": rng.choice(_TOPICS)} for _ in range(NUM_PEOPLE)]
  founders = rng.sample(people, NUM_ORGS)
  orgs = []
  for founder in founders:
    suffix, kind = rng.choice(_ORG_KINDS)
    orgs.append({"name": f"{names.word()} {suffix}", "kind": kind, "founder": founder,
                 "year": founder["year"] + rng.randint(20, 45), "city": rng.choice(cities)})
  city_by_name = {c["name"]: c for c in cities}

  corpus = []
  for p in people:
    corpus.append(f"{p['name']}\n{p['name']} is a {p['occupation']} born in {p['year']} in "
                  f"the city of {p['city']}. {p['name']} is known for work on {p['topic']}.")
  for o in orgs:
    corpus.append(f"{o['name']}\n{o['name']} is a {o['kind']} founded in {o['year']} by "
                  f"{o['founder']['name']}. Its headquarters are in {o['city']['name']}.")
  for c in cities:
    corpus.append(f"{c['name']}\n{c['name']}, also known as {c['alias']}, is a city in "
                  f"{c['country']} with about {c['population']} inhabitants.")
  corpus_rows = [{"id": str(i), "contents": text} for i, text in enumerate(corpus)]

  splits = {"train": [], "test": []}
  for n, o in enumerate(orgs):
    split = "test" if n >= NUM_ORGS - TEST_ORGS else "train"
    birth_city = city_by_name[o["founder"]["city"]]
    asks = [
        ("1hop-founder", f"Who founded {o['name']}?", [o["founder"]["name"]]),
        ("2hop-birth-city", f"In which city was the founder of {o['name']} born?",
         [birth_city["name"], birth_city["alias"]]),
        ("2hop-birth-year", f"In what year was the founder of {o['name']} born?",
         [str(o["founder"]["year"])]),
        ("2hop-hq-country", f"In which country is the headquarters city of {o['name']}?",
         [o["city"]["country"]]),
    ]
    for kind, question, golds in asks:
      qid = f"{split}-{len(splits[split]):04d}"
      splits[split].append({"id": qid, "question": question, "golden_answers": golds,
                            "data_source": f"synthetic-{kind}"})
  return corpus_rows, splits


def _jsonl(rows: list[dict]) -> str:
  return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)


def files() -> dict[str, str]:
  """file name -> text of the generated data directory."""
  corpus, splits = generate()
  return {"corpus.jsonl": _jsonl(corpus), **{f"{s}.jsonl": _jsonl(r) for s, r in splits.items()}}


def write(out: pathlib.Path) -> list[pathlib.Path]:
  out.mkdir(parents=True, exist_ok=True)
  written = []
  for name, text in files().items():
    (out / name).write_text(text, encoding="utf-8")
    written.append(out / name)
  return written


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description="Write the synthetic multi-hop search data.")
  parser.add_argument("--out", type=pathlib.Path, required=True)
  args = parser.parse_args(argv)
  for path in write(args.out):
    print(path)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
