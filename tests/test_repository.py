"""The repository explains itself: no references to documents users cannot see, docs
links that resolve, docstring references that import, and an API reference that builds.
"""

import importlib
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Built by concatenation so that this file does not match itself.
FORBIDDEN = ("spec " + "\u00a7", "research" + "/")

# Modules rendered by `make docs`; the generated protobuf code is left out there too.
API_PACKAGES = ("hgpo_jax", "env_servers", "configs", "launch")
API_EXCLUDED = ("env_servers.protos.env_pb2", "env_servers.protos.env_pb2_grpc")


def tracked_files() -> list[str]:
  """Files git tracks, plus new files not ignored yet (so a check runs before the commit)."""
  out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       cwd=ROOT, capture_output=True, check=False)
  if out.returncode != 0:
    pytest.skip("not a git checkout: the tracked-file checks need `git ls-files`")
  return [p for p in out.stdout.decode().split("\0") if p and os.path.isfile(os.path.join(ROOT, p))]


def tracked_text(suffixes=None) -> dict[str, str]:
  """Text of every tracked file (binary files skipped), optionally only some suffixes."""
  texts = {}
  for path in tracked_files():
    if suffixes and not path.endswith(suffixes):
      continue
    with open(os.path.join(ROOT, path), "rb") as f:
      data = f.read()
    if b"\0" in data[:8192]:
      continue
    try:
      texts[path] = data.decode("utf-8")
    except UnicodeDecodeError:
      continue
  return texts


def test_no_reference_to_documents_outside_the_repository():
  hits = []
  for path, text in tracked_text().items():
    for lineno, line in enumerate(text.splitlines(), 1):
      if any(s in line for s in FORBIDDEN):
        hits.append(f"{path}:{lineno}: {line.strip()[:100]}")
  assert not hits, ("point these at docs/ or at the paper instead:\n" + "\n".join(hits))


def test_the_documentation_pages_exist():
  for name in ("algorithms", "architecture", "environments", "scaling", "performance",
               "reproducibility"):
    path = os.path.join(ROOT, "docs", f"{name}.md")
    assert os.path.isfile(path), f"docs/{name}.md is missing"
    with open(path, encoding="utf-8") as f:
      assert len(f.read()) > 2000, f"docs/{name}.md is nearly empty"
  with open(os.path.join(ROOT, "results", "README.md"), encoding="utf-8") as f:
    assert len(f.read()) > 2000, "results/README.md is nearly empty"


_DOCS_PATH = re.compile(r"docs/[\w./-]+?\.md")
_SECTION_REF = re.compile(r"(docs/[\w-]+\.md)[,:]?\s*\u00a7\s*(\d+(?:\.\d+)*)")
_MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*$", re.M)


def _headings(path: str) -> list[str]:
  with open(os.path.join(ROOT, path), encoding="utf-8") as f:
    return _HEADING.findall(f.read())


def _slug(heading: str) -> str:
  """GitHub's anchor of a Markdown heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


# Written by `python -m launch.plan --table` (and its figure); a checkout may not hold them
# yet, so a mention of or a link to these is allowed to dangle. Nothing else is.
GENERATED_ELSEWHERE = frozenset({"docs/plan_table.md", "docs/plan_table.csv",
                                 "docs/figures/plan_memory.png"})


def broken_links(path: str, text: str) -> list[str]:
  """Problems with the relative links of a Markdown file at `path` (repository-relative):
  a link to a missing file (GENERATED_ELSEWHERE excepted) or to a missing heading."""
  problems = []
  for target in _MD_LINK.findall(text):
    if re.match(r"[a-z]+:", target):
      continue  # http(s), mailto
    file_part, _, anchor = target.partition("#")
    dest = os.path.normpath(os.path.join(ROOT, os.path.dirname(path), file_part)) if file_part \
        else os.path.join(ROOT, path)
    if not os.path.exists(dest):
      if os.path.relpath(dest, ROOT) not in GENERATED_ELSEWHERE:
        problems.append(f"{path}: link ({target}) points at a missing file")
    elif anchor and dest.endswith(".md"):
      if anchor not in {_slug(h) for h in _headings(os.path.relpath(dest, ROOT))}:
        problems.append(f"{path}: link ({target}) names a missing heading")
  return problems


def test_docs_paths_sections_and_links_resolve():
  problems = []
  for path, text in tracked_text((".md", ".py")).items():
    for ref in set(_DOCS_PATH.findall(text)):
      if not os.path.isfile(os.path.join(ROOT, ref)) and ref not in GENERATED_ELSEWHERE:
        problems.append(f"{path}: mentions {ref}, which does not exist")
    for ref, section in set(_SECTION_REF.findall(text)):
      if not os.path.isfile(os.path.join(ROOT, ref)):
        continue  # reported above
      numbers = {h.split()[0].rstrip(".") for h in _headings(ref) if h[:1].isdigit()}
      if section not in numbers:
        problems.append(f"{path}: cites {ref} \u00a7{section}, which has no such section")
    if path.endswith(".md"):
      problems += broken_links(path, text)
  assert not problems, "\n".join(problems)


def test_the_link_check_finds_broken_links():
  """The check above can fail: a missing file, a missing heading; allowed: the generated
  plan table, an existing heading, an absolute URL."""
  missing = "docs/" + "nowhere.md"  # concatenated: the path check above reads this file
  text = (f"[a]({missing}) [b](docs/scaling.md#no-such-heading) [c](docs/plan_table.md)"
          " [d](docs/scaling.md#the-mesh) [e](https://example.org/x.md) [f](../docs/algorithms.md)")
  assert broken_links("README.md", text) == [
      f"README.md: link ({missing}) points at a missing file",
      "README.md: link (docs/scaling.md#no-such-heading) names a missing heading",
      "README.md: link (../docs/algorithms.md) points at a missing file"]
  assert broken_links("results/README.md", "[g](../docs/algorithms.md) [h](mini.md)") == []


README_MAX_LINES = 200  # a front door: measurements live in docs/ and results/
# A commit hash: 7-40 hex digits with at least one letter and one digit.
_COMMIT = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


def _readme() -> str:
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    return f.read()


def test_readme_is_a_front_door():
  """README.md stays short, names no commit, and points at every document a reader needs."""
  text = _readme()
  lines = text.splitlines()
  assert 40 < len(lines) <= README_MAX_LINES, (
      f"README.md has {len(lines)} lines (budget {README_MAX_LINES}): move measurements and "
      "transcripts to docs/performance.md, docs/reproducibility.md, docs/scaling.md or "
      "results/README.md")
  hashes = sorted(set(_COMMIT.findall(text)))
  assert not hashes, f"README.md names commits {hashes}: their history belongs in docs/ or git"
  targets = {t.partition("#")[0] for t in _MD_LINK.findall(text)}
  wanted = {f"docs/{n}.md" for n in ("algorithms", "architecture", "environments", "scaling",
                                     "performance", "reproducibility")}
  wanted |= {"results/README.md", "docs/plan_table.md"}
  assert wanted <= targets, f"README.md does not link {sorted(wanted - targets)}"
  for command in ("make run", "make test", "make venv ACCEL=cuda12", "make venv ACCEL=tpu",
                  "python -m launch.main --config=", "python -m launch.plan"):
    assert command in text, f"README.md does not show `{command}`"


def test_the_commit_pattern_finds_hashes_only():
  found = _COMMIT.findall("at e777d4c and 71b5d0e48bf3; arXiv 2602.22817, 1e-6, added, 1529 s")
  assert found == ["e777d4c", "71b5d0e48bf3"]


_CODE_REF = re.compile(r"`((?:hgpo_jax|env_servers|configs|launch)(?:\.[A-Za-z_]\w*)+)`")


def _resolve(dotted: str) -> bool:
  parts = dotted.split(".")
  for cut in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:cut]))
    except ImportError:
      continue
    try:
      for attr in parts[cut:]:
        obj = getattr(obj, attr)
    except AttributeError:
      return False
    return True
  return False


def test_backquoted_code_references_resolve():
  """A back-quoted dotted name under hgpo_jax/env_servers/configs/launch in docs and
  docstrings names a module or attribute that exists."""
  refs = {}
  for path, text in tracked_text((".md", ".py")).items():
    for ref in _CODE_REF.findall(text):
      refs.setdefault(ref, path)
  assert len(refs) > 10  # the check sees the references it is meant to check
  broken = [f"{path}: `{ref}`" for ref, path in sorted(refs.items())
            if not ref.startswith(API_EXCLUDED) and not _resolve(ref)]
  assert not broken, "references to names that do not exist:\n" + "\n".join(broken)


@pytest.mark.slow
def test_api_reference_builds_without_warnings(tmp_path):
  """`make docs` into a temporary directory: exit 0, no warning, a page per module."""
  proc = subprocess.run([sys.executable, "-m", "launch.api_docs", "--out", str(tmp_path)],
                        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "warning" not in proc.stderr, proc.stderr[-3000:]
  missing = []
  for path in tracked_files():
    if not path.endswith(".py") or not path.startswith(tuple(p + "/" for p in API_PACKAGES)):
      continue
    module = path[:-3].replace("/", ".").removesuffix(".__init__")
    if module.endswith("__main__") or module.startswith(API_EXCLUDED):
      continue
    if not (tmp_path / (module.replace(".", "/") + ".html")).is_file():
      missing.append(module)
  assert not missing, f"modules without an API page: {missing}"
  page = (tmp_path / "hgpo_jax" / "advantages" / "hgpo.html").read_text()
  assert "HGPOOptions" in page and "zero_tolerance" in page


def test_api_reference_gate_fails_on_bad_modules(tmp_path):
  """The build reports what it must: an import error stops it, a repeated module warns."""
  api_docs = importlib.import_module("launch.api_docs")
  pkg = tmp_path / "src" / "docs_probe_pkg"
  pkg.mkdir(parents=True)
  (pkg / "__init__.py").write_text('"""Probe package."""\n')
  (pkg / "fine.py").write_text('"""Fine."""\nX = 1\n')
  (pkg / "broken.py").write_text('raise ImportError("missing dependency")\n')
  sys.path.insert(0, str(tmp_path / "src"))
  try:
    with pytest.raises(RuntimeError, match="docs_probe_pkg.broken"):
      api_docs.build(str(tmp_path / "out1"), ["docs_probe_pkg.broken"])
    warnings = api_docs.build(str(tmp_path / "out2"), ["docs_probe_pkg.fine", "docs_probe_pkg.fine"])
    assert warnings and "docs_probe_pkg.fine" in warnings[0]
    assert api_docs.build(str(tmp_path / "out3"), ["docs_probe_pkg.fine"]) == []
    assert (tmp_path / "out3" / "docs_probe_pkg" / "fine.html").is_file()
  finally:
    sys.path.remove(str(tmp_path / "src"))


def test_api_docs_finds_modules_hidden_from_pdocs_walk():
  names = importlib.import_module("launch.api_docs").module_names()
  assert "hgpo_jax.advantages.hgpo" in names  # not in hgpo_jax.advantages.__all__
  assert "hgpo_jax.rollout.rollout" in names  # namespace package (no __init__.py)
  assert "hgpo_jax.progress" in names
  assert not any(n.startswith(API_EXCLUDED) or n.endswith("__main__") for n in names)


def test_documented_env_data_overrides_are_accepted():
  """docs/environments.md tells users to plug data in with --config.env.args.*: it works."""
  with open(os.path.join(ROOT, "docs", "environments.md"), encoding="utf-8") as f:
    text = f.read()
  documented = set(re.findall(r"--config\.env\.args\.(\w+)=", text))
  assert documented == {"data_dir", "real_data_dir", "hide_actions", "search_actions", "corpus",
                        "retriever", "retriever_model"}
  alfworld = importlib.import_module("configs.alfworld").get_config("model=tiny")
  webshop = importlib.import_module("configs.webshop").get_config("model=tiny")
  alfworld.update_from_flattened_dict({"env.args.data_dir": "/data/alfworld/json_2.1.1",
                                       "env.args.hide_actions": "look,inventory,examine"})
  webshop.update_from_flattened_dict({"env.args.data_dir": "/d", "env.args.real_data_dir": "/r",
                                      "env.args.search_actions": "goal"})
  assert alfworld.env.args.data_dir == "/data/alfworld/json_2.1.1"
  assert alfworld.env.args.hide_actions == "look,inventory,examine"
  assert (webshop.env.args.data_dir, webshop.env.args.real_data_dir) == ("/d", "/r")
  assert webshop.env.args.search_actions == "goal"
  search = importlib.import_module("configs.search").get_config("model=tiny")
  search.update_from_flattened_dict({"env.args.data_dir": "/d", "env.args.corpus": "/c.jsonl",
                                     "env.args.retriever": "127.0.0.1:8123",
                                     "env.args.retriever_model": "/models/e5-base-v2"})
  assert (search.env.args.data_dir, search.env.args.corpus, search.env.args.retriever) == (
      "/d", "/c.jsonl", "127.0.0.1:8123")
  assert search.env.args.retriever_model == "/models/e5-base-v2"
  # The defaults select the shipped data: empty strings the env constructors read as unset.
  assert importlib.import_module("configs.alfworld").get_config("").env.args.to_dict() == {
      "data_dir": "", "hide_actions": ""}


def _algorithms_sections() -> dict[str, str]:
  """'## N. Title' sections of docs/algorithms.md: title line -> section text."""
  with open(os.path.join(ROOT, "docs", "algorithms.md"), encoding="utf-8") as f:
    text = f.read()
  parts = re.split(r"^## ", text, flags=re.M)[1:]
  return {p.splitlines()[0]: p for p in parts}


def test_every_estimator_option_is_documented():
  """Each registered estimator has a section in docs/algorithms.md ('(`name`)' in its
  title) naming every field of its options dataclass; likewise the loss options."""
  import dataclasses
  from hgpo_jax.advantages import registry
  from hgpo_jax.training import losses
  sections = _algorithms_sections()
  missing = []
  targets = [(f"(`{n}`)", registry.get(n).options_cls) for n in registry.names()]
  targets.append(("PPO actor loss", losses.LossConfig))
  for marker, options_cls in targets:
    found = [text for title, text in sections.items() if marker in title]
    if len(found) != 1:
      missing.append(f"no single section of docs/algorithms.md has {marker} in its title")
      continue
    missing += [f"{options_cls.__name__}.{f.name} is not named in the section {marker}"
                for f in dataclasses.fields(options_cls) if f"`{f.name}`" not in found[0]]
  assert not missing, "\n".join(missing)


# Modules whose hgpo_jax imports must all be at module level: a
# function-local import there hid an import cycle (the estimator registry) or a reach into
# another module at call time (the program registry).
NO_LOCAL_IMPORTS = ("hgpo_jax/advantages/registry.py", "hgpo_jax/training/programs.py")


def _local_hgpo_imports(source: str) -> list[str]:
  """'line: import' for each import of an hgpo_jax module inside a function or class."""
  import ast
  found = []

  def visit(node, nested):
    for child in ast.iter_child_nodes(node):
      inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                           ast.ClassDef))
      if nested and isinstance(child, ast.Import):
        found.extend(f"{child.lineno}: import {a.name}" for a in child.names
                     if a.name.split(".")[0] == "hgpo_jax")
      elif nested and isinstance(child, ast.ImportFrom) and (
          child.level or (child.module or "").split(".")[0] == "hgpo_jax"):
        found.append(f"{child.lineno}: from {'.' * child.level}{child.module or ''} import ...")
      visit(child, inner)

  visit(ast.parse(source), False)
  return found


def test_no_function_local_hgpo_imports_in_the_registries():
  """The estimator registry and the program registry import every hgpo_jax module they
  use at the top: no cycle is dodged by importing inside a function."""
  found = []
  for path in NO_LOCAL_IMPORTS:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      found += [f"{path}:{hit}" for hit in _local_hgpo_imports(f.read())]
  assert not found, "function-local imports of hgpo_jax modules:\n" + "\n".join(found)


def test_the_local_import_scan_sees_nested_imports():
  probe = ("import hgpo_jax.cost.hlo\n"
           "def f():\n  from hgpo_jax.training import targets\n  import os\n"
           "class C:\n  def g(self):\n    import hgpo_jax.advantages.estimator\n"
           "    from . import sibling\n")
  assert _local_hgpo_imports(probe) == [
      "3: from hgpo_jax.training import ...", "7: import hgpo_jax.advantages.estimator",
      "8: from . import ..."]


def test_estimator_modules_do_not_import_the_registry():
  """The registry imports the estimator modules; none imports it back (no cycle)."""
  import ast
  from hgpo_jax.advantages import registry
  importers = []
  for fn in registry.ESTIMATOR_FUNCTIONS:
    path = fn.__module__.replace(".", "/") + ".py"
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [f"{node.module}.{a.name}" for a in node.names]
               if isinstance(node, ast.ImportFrom) else [])
      importers += [f"{path}:{node.lineno}" for n in names
                    if n.startswith("hgpo_jax.advantages.registry")]
  assert not importers, importers
