"""The package's import structure: no import circle in `hgpo_jax/` (imports inside
functions included), every import going down or across a floor (`FLOORS`), and the model
config readable without loading the Pallas kernels."""

import ast
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hgpo_jax")


def _module_name(path: str) -> str:
  rel = os.path.relpath(path, os.path.dirname(ROOT))[:-len(".py")].split(os.sep)
  return ".".join(rel[:-1] if rel[-1] == "__init__" else rel)


def import_graph() -> dict[str, set[str]]:
  """module -> the hgpo_jax modules it imports anywhere in its file (`ast`, so imports
  inside functions count). `from pkg import name` counts `pkg.name` when that is a
  module, else `pkg`."""
  modules = {}
  for folder, _, files in os.walk(ROOT):
    for f in files:
      if f.endswith(".py"):
        modules[_module_name(os.path.join(folder, f))] = os.path.join(folder, f)
  graph = {}
  for name, path in modules.items():
    is_package = path.endswith("__init__.py")
    deps = set()
    with open(path) as fh:
      tree = ast.parse(fh.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Import):
        deps.update(a.name for a in node.names if a.name in modules)
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative import
          parts = name.split(".")[:len(name.split(".")) - node.level + (1 if is_package else 0)]
          base = ".".join(parts + ([node.module] if node.module else []))
        for a in node.names:
          target = f"{base}.{a.name}"
          if target in modules:
            deps.add(target)
          elif base in modules:
            deps.add(base)
    # A package's own __init__ importing its submodules is not a circle through them.
    graph[name] = {d for d in deps if d != name and not (is_package and d.startswith(name + "."))}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import circle of `graph` (a list of modules, first = last), or None."""
  state = {}
  stack = []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for dep in sorted(graph.get(node, ())):
      if state.get(dep) == "open":
        return stack[stack.index(dep):] + [dep]
      if dep not in state:
        found = visit(dep)
        if found:
          return found
    stack.pop()
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state:
      found = visit(node)
      if found:
        return found
  return None


# The package's floors, lowest first: a module imports only modules on its own floor or
# below (longest matching name wins). Floors hold at the folder level: each folder of
# hgpo_jax/ (and each module beside them) sits on one floor. The cost readers (HLO,
# hardware, analytic counts, compile targets) are the bottom, which the program registry
# uses; the decode step's traffic sits with the sampler; the compiled plans and the
# trainer's FLOP metrics (`compiled`) above training, whose programs they compile.
FLOORS = {
    "hgpo_jax": 0, "hgpo_jax.runtime": 0, "hgpo_jax.registry": 0, "hgpo_jax.progress": 0,
    "hgpo_jax.cost": 0,
    "hgpo_jax.models": 1, "hgpo_jax.envs": 1,
    "hgpo_jax.sampling": 2, "hgpo_jax.advantages": 2,
    "hgpo_jax.rollout": 3, "hgpo_jax.analysis": 3,
    "hgpo_jax.training": 4,
    "hgpo_jax.compiled": 5,
    "hgpo_jax.train": 6,
}


def floor_of(module: str) -> int:
  """The floor of `module`: its longest dotted prefix in `FLOORS` (KeyError: none)."""
  parts = module.split(".")
  for n in range(len(parts), 0, -1):
    if ".".join(parts[:n]) in FLOORS:
      return FLOORS[".".join(parts[:n])]
  raise KeyError(f"{module} has no floor in FLOORS")


def imports_up(graph: dict[str, set[str]]) -> list[str]:
  """'module -> dependency' for each import that runs up a floor."""
  return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps
                if floor_of(d) > floor_of(m))


def test_find_cycle_finds_a_circle_and_accepts_a_tree():
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_has_the_model_modules_and_no_circle():
  graph = import_graph()
  assert "hgpo_jax.models.kv_cache" in graph["hgpo_jax.models.decoder"]
  assert "hgpo_jax.models.axes" in graph["hgpo_jax.models.attention"]
  assert "hgpo_jax.models.attention" not in graph["hgpo_jax.models.config"]
  assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def test_importing_the_model_config_loads_no_pallas():
  code = ("import sys, hgpo_jax.models.config as c; c.get_preset('tiny'); "
          "print(sorted(m for m in sys.modules if m.startswith('jax.experimental.pallas')))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.stdout.strip() == "[]", out.stdout
  # the check can fail: the attention module does load the kernels
  code = code.replace("hgpo_jax.models.config as c", "hgpo_jax.models.attention, "
                      "hgpo_jax.models.config as c")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert "jax.experimental.pallas" in out.stdout


def test_every_import_runs_down_or_across_a_floor():
  graph = import_graph()
  assert floor_of("hgpo_jax.compiled.plan") == 5 and floor_of("hgpo_jax.cost.hlo") == 0
  assert floor_of("hgpo_jax.training.programs") == 4 and floor_of("hgpo_jax.train") == 6
  assert "hgpo_jax.training.packing" in graph["hgpo_jax.compiled.trainer_metrics"]
  assert "hgpo_jax.cost.targets" in graph["hgpo_jax.training.programs"]
  assert "hgpo_jax.training.programs" in graph["hgpo_jax.compiled.plan"]
  # the check can fail: the bottom floor's HLO reader importing the program registry
  assert imports_up({"hgpo_jax.cost.hlo": {"hgpo_jax.training.programs"}}) == [
      "hgpo_jax.cost.hlo -> hgpo_jax.training.programs"]
  assert imports_up(graph) == []


def test_floors_are_given_by_folder():
  """Every folder and top-level module of hgpo_jax/ has its own floor, and no floor entry
  reaches inside a folder: a folder's modules share its floor."""
  names = {f"hgpo_jax.{n[:-3] if n.endswith('.py') else n}" for n in os.listdir(ROOT)
           if (n.endswith(".py") and n != "__init__.py")
           or (os.path.isdir(os.path.join(ROOT, n)) and not n.startswith(("_", ".")))}
  assert names - set(FLOORS) == set(), "no floor for these"
  assert all(k.count(".") <= 1 for k in FLOORS), "a floor entry inside a folder"
