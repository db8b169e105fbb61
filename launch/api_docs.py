"""Builds the browsable API reference (HTML) with pdoc; `make docs` runs it.

  python -m launch.api_docs --out build/api      # then open build/api/index.html

Every module of `hgpo_jax`, `env_servers`, `configs` and `launch` gets a page. Modules
are found on disk, so submodules that a package leaves out of its `__all__` and the
namespace package `hgpo_jax.rollout` are rendered too. The generated protobuf modules
are left out (`env_servers/protos/*.proto` document the protocols). pdoc imports each
module: a module that fails to import stops the build, and anything pdoc warns about (a
repeated module, a type stub it cannot match) counts as an error too; either makes the
command exit with status 1 (CI runs it through
`tests/test_repository.py`). The HTML is a build output (`build/` is git-ignored).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import warnings

PACKAGES = ("hgpo_jax", "env_servers", "configs", "launch")
"""Top-level packages rendered."""
EXCLUDED = ("env_servers.protos.env_pb2", "env_servers.protos.env_pb2_grpc",
            "env_servers.protos.retriever_pb2", "env_servers.protos.retriever_pb2_grpc")
"""Generated code (protoc output), not rendered."""
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def module_names(root: str = _ROOT) -> list[str]:
  """Dotted names of the modules to render, from the .py files under PACKAGES."""
  names = []
  for package in PACKAGES:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, package)):
      dirnames[:] = sorted(d for d in dirnames if d.isidentifier())
      rel = os.path.relpath(dirpath, root).replace(os.sep, ".")
      for filename in sorted(filenames):
        stem, ext = os.path.splitext(filename)
        if ext != ".py" or stem == "__main__" or not stem.isidentifier():
          continue
        name = rel if stem == "__init__" else f"{rel}.{stem}"
        if not name.startswith(EXCLUDED):
          names.append(name)
  return sorted(set(names))


def _import_entry_points(modules: list[str]) -> None:
  """Imports `modules` one by one, forgetting the absl flags each one defines.

  Entry points (`launch.main`, ...) define absl flags at import, some with the same
  name (`--config`); absl refuses a second definition, so in one documentation process
  each module's flags are dropped after its import (the module objects stay in
  `sys.modules`, which is what pdoc renders).
  """
  from absl import flags

  for name in modules:
    before = set(flags.FLAGS)
    try:
      importlib.import_module(name)
    except Exception as e:  # reported like pdoc does
      raise RuntimeError(f"Error importing {name}") from e
    for flag in set(flags.FLAGS) - before:
      if flag in flags.FLAGS:
        delattr(flags.FLAGS, flag)


def build(out_dir: str, modules: list[str] | None = None) -> list[str]:
  """Renders `modules` (default: every module on disk) into `out_dir`; returns pdoc's warnings."""
  import pathlib
  import pdoc
  import pdoc.extract

  # pdoc hides (and warns about) any default value that equals an environment variable,
  # e.g. a repository path that happens to equal $OLDPWD; no module constant here is a
  # secret, and the warning would depend on the shell the build runs in.
  os.environ.setdefault("PDOC_DISPLAY_ENV_VARS", "1")
  exclude = ["!" + re.escape(m) for m in EXCLUDED]  # pdoc drops matches added before it
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    _import_entry_points(module_names() if modules is None else modules)
    if modules is None:
      # pdoc walks each package but skips submodules outside a package's `__all__` and
      # namespace packages; name those explicitly (once: pdoc warns about repeats).
      found = set(pdoc.extract.walk_specs(list(PACKAGES) + exclude))
      modules = list(PACKAGES) + [m for m in module_names() if m not in found]
    pdoc.pdoc(*modules, *exclude, output_directory=pathlib.Path(out_dir))
  # Deprecation notices of third-party libraries imported along the way are not ours.
  return [f"{w.category.__name__}: {w.message}" for w in caught
          if not issubclass(w.category, (DeprecationWarning, PendingDeprecationWarning, FutureWarning))]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="python -m launch.api_docs", description=__doc__.split("\n")[0])
  parser.add_argument("--out", default="build/api", help="output directory (default build/api)")
  args = parser.parse_args(argv)
  sys.path.insert(0, _ROOT)
  try:
    problems = build(args.out)
  except RuntimeError as e:  # pdoc: a module named explicitly failed to import
    cause = f" ({type(e.__cause__).__name__}: {e.__cause__})" if e.__cause__ else ""
    print(f"error: {e}{cause}", file=sys.stderr)
    return 1
  for p in problems:
    print(f"warning: {p}", file=sys.stderr)
  if problems:
    print(f"error: {len(problems)} pdoc warning(s); fix them (the reference must build cleanly)",
          file=sys.stderr)
    return 1
  print(f"API reference: {os.path.join(args.out, 'index.html')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
