r"""Sweeps: run a named suite (or a grid of config variants x seeds) and render its results.

  # the main job (`make run`): GRPO vs GiGPO vs HGPO K=2 on ALFWorld-mini, first seed;
  # prints the table, writes workdirs/quick.{md,csv} and workdirs/quick_curves.png
  python -m launch.experiments.sweep quick [--root workdirs/sweeps] [--out workdirs]
  # a named suite (launch/experiments/suites.py): environments x methods x seeds, resumable
  python -m launch.experiments.sweep plan --suite mini            # the runs, their status, the workload
  python -m launch.experiments.sweep suite --suite mini [--envs alfworld_mini] [--methods grpo gigpo] \
      [--seeds 123] [--root workdirs/sweeps] [--print]
  # tables and curves from the run directories: results/mini.md, .csv, _curves.png
  python -m launch.experiments.sweep render --suite mini [--root workdirs/sweeps] [--out results] \
      [--reading results/mini_reading.md]      # a hand-written reading, under the tables
  # one column alone (its runs done, the others not yet): results/mini_webshop_mini.*
  python -m launch.experiments.sweep render --suite mini --envs webshop_mini
  # the record files of the finished runs, to commit them (see "Run records" below)
  python -m launch.experiments.sweep plan --suite mini --root results/runs --records

A suite run skips every finished run (its metrics.jsonl holds the final evaluation),
re-launches unfinished ones in the same workdir, where the trainer resumes from the
latest checkpoint, and lists cells that cannot run yet (the config or the trainer's
validation refuses them: e.g. an estimator that is not trainable yet) as pending; the
table keeps their rows, marked pending. Every run is a subprocess with
PYTHONHASHSEED=0, its console output in `<workdir>/log.txt`, which starts each launch with
the trainer's git revision (the table's footer counts the revisions of its runs) and the
command. A run whose recorded command is not its cell's current one (a run of an older
suite definition: another shop, level set or budget) is stale: the sweep neither resumes
nor replaces it, the render refuses it (both name the differing arguments); move it out
of the root to rerun the cell.

Run records. The committed table is rendered from `results/runs` (`make table` runs and
renders there): the repository keeps, of each finished run, its `metrics.jsonl` and
`log.txt` (`plan --records` lists them; .gitignore keeps the checkpoints, event files and
task data out), so the table can be re-rendered and checked from a clone, and a sweep
that spans several sessions or machines resumes from the committed runs: they count as
done, and only unfinished runs start again (from their checkpoints where these survive).

The older grid interface (one config file, explicit variants):

  # run (sequentially on this machine; on a cluster, --print emits one command per line)
  python -m launch.experiments.sweep run --name alf_k2 --root workdirs/sweeps \
      --config configs/alfworld.py --variants algo=grpo,k=2 algo=gigpo,k=2 algo=hgpo,k=2 \
      --seeds 123 456 789 [--override train.num_iterations=160] [--print]
  # table (mean +- std over seeds of the final evaluation, and the best evaluation seen)
  python -m launch.experiments.sweep table --root workdirs/sweeps/alf_k2 --out results/alf_k2.md

Each run lives in `<root>/<name>/<variant>/seed_<seed>` and writes `metrics.jsonl`
(one JSON object per iteration; evaluation keys look like `eval/<split>/success`).
The table records the command that produced it, the git revision and package versions,
so a table in the repository always says where its numbers came from (verl-agent #155:
report final means over seeds, and the best checkpoint separately).
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import os
import shlex
import statistics
import subprocess
import sys
import time
from typing import Callable

from hgpo_jax.training import run_records
from launch.experiments import report
from launch.experiments import suites as suites_lib


def _run_dir(root: str, name: str, variant: str, seed: int) -> str:
  safe = variant.replace(",", "_").replace("=", "-") or "default"
  return os.path.join(root, name, safe, f"seed_{seed}")


def commands(args) -> list[tuple[str, list[str]]]:
  out = []
  for variant in args.variants:
    for seed in args.seeds:
      workdir = _run_dir(args.root, args.name, variant, seed)
      cmd = [sys.executable, "-m", "launch.main", f"--config={args.config}:{variant}",
             f"--workdir={workdir}", f"--config.seed={seed}"]
      cmd += [f"--config.{o}" for o in args.override]
      out.append((workdir, cmd))
  return out


def run(args) -> int:
  for workdir, cmd in commands(args):
    if args.print:
      print(shlex.join(cmd))
      continue
    os.makedirs(workdir, exist_ok=True)
    print(f"[sweep] {shlex.join(cmd)}", flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
      print(f"[sweep] run failed with exit code {rc}: {workdir}", file=sys.stderr)
      return rc
  return 0


def _fmt(values: list[float]) -> str:
  if not values:
    return "n/a"
  scale = [100.0 * v for v in values]
  if len(scale) == 1:
    return f"{scale[0]:.1f}"
  return f"{statistics.mean(scale):.1f} ± {statistics.stdev(scale):.1f}"


def table(args) -> str:
  """Markdown: one row per variant, columns = final and best eval success per split."""
  runs = collections.defaultdict(list)
  for variant, _, run_dir in run_records.find_grid_runs(args.root):
    runs[variant].append(run_records.read_metrics(run_dir))
  if not runs:
    raise SystemExit(f"no metrics.jsonl under {args.root}")
  keys = sorted({k for rs in runs.values() for r in rs for line in r for k in line
                 if k.startswith("eval/") and k.endswith("/success")})
  header = ["variant", "seeds"] + [f"{k[5:-8]} final" for k in keys] + [f"{k[5:-8]} best" for k in keys]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  for variant, rs in sorted(runs.items()):
    finals = {k: [] for k in keys}
    bests = {k: [] for k in keys}
    for r in rs:
      for k in keys:
        vals = [line[k] for line in r if k in line]
        if vals:
          finals[k].append(vals[-1])
          bests[k].append(max(vals))
    lines.append("| " + " | ".join([variant, str(len(rs))] + [_fmt(finals[k]) for k in keys]
                                   + [_fmt(bests[k]) for k in keys]) + " |")
  try:
    rev = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
  except (OSError, subprocess.CalledProcessError):
    rev = "unknown"
  versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in
                       ("jax", "flax", "alfworld", "textworld") if _has(p))
  preface = [f"<!-- generated by: python -m launch.experiments.sweep table --root {args.root} --out {args.out} -->",
             f"Success rate (%) of the evaluation, mean ± std over seeds (final = last evaluation, "
             f"best = best evaluation during training). git {rev}; {versions}.", ""]
  return "\n".join(preface + lines) + "\n"


def _has(pkg: str) -> bool:
  try:
    importlib.metadata.version(pkg)
    return True
  except importlib.metadata.PackageNotFoundError:
    return False


# ---------------------------------------------------------------------------------------
# Named suites
# ---------------------------------------------------------------------------------------
Runner = Callable[[list, str], int]


def subprocess_runner(cmd: list, workdir: str) -> int:
  """Runs one trainer/evaluator command from the repository root; output -> log.txt.

  The log names this interpreter `python`: its path is the machine's, and run records are
  committed (the stale check does not compare the interpreter)."""
  os.makedirs(workdir, exist_ok=True)
  env = dict(os.environ, PYTHONHASHSEED="0")
  logged = ["python", *cmd[1:]] if cmd and cmd[0] == sys.executable else list(cmd)
  with open(os.path.join(workdir, "log.txt"), "a", encoding="utf-8") as log:
    log.write(f"{report.REVISION_PREFIX}{report.git_revision()}\n$ {shlex.join(logged)}\n")
    log.flush()
    return subprocess.call(cmd, cwd=suites_lib.REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                           env=env)


def _select(suite: suites_lib.Suite, envs, methods, seeds):
  try:
    envs = [suite.env(e) for e in envs] if envs else list(suite.environments)
  except ValueError as e:
    raise ValueError(f"--envs: {e}") from None
  try:
    methods = [suite.method(m) for m in methods] if methods else list(suite.methods)
  except ValueError as e:
    raise ValueError(f"--methods: {e}") from None
  seeds = list(seeds) if seeds else list(suite.seeds)
  unknown = [s for s in seeds if s not in suite.seeds]
  if unknown:
    raise ValueError(f"--seeds: seeds {unknown} are not seeds of suite {suite.name!r} "
                     f"{list(suite.seeds)}")
  return envs, methods, seeds


def check_configs(entries: list[dict]) -> None:
  """Loads and validates the config of every run that would start (its file, variant
  arguments and overrides, `--override` included), as the trainer does before any work;
  raises ValueError naming the run and the flag to change."""
  from configs import common
  from hgpo_jax.training import experiment
  seen = set()
  for e in entries:
    if e["status"] in ("pending", "stale"):
      continue
    spec = next(a.split("=", 1)[1] for a in e["command"] if a.startswith("--config="))
    overrides = tuple(a for a in e["command"] if a.startswith("--config."))
    if (spec, overrides) in seen:
      continue
    seen.add((spec, overrides))
    tag = f"{e['env']}/{e['method']}"
    try:
      experiment.from_config(common.load(spec, list(overrides)))
    except (ValueError, KeyError) as err:  # ConfigLoadError (a ValueError) included
      raise ValueError(f"{tag}: {err} (check --override)") from None


def plan_suite(suite: suites_lib.Suite, root: str, envs=None, methods=None, seeds=None,
               pending=None, python: str = sys.executable, extra=()) -> list[dict]:
  """One entry per run: env, method, seed, workdir, status (done|todo|pending|stale),
  command. A run is stale when its log records another command than its cell's (a run of
  an older suite definition, or of other `extra` overrides): it is neither resumed nor
  counted.

  `extra`: "a.b=value" overrides appended to every command (smoke checks of the wiring;
  use another --root, the table of a suite is made without them)."""
  pending = pending or suites_lib.pending_reason
  envs, methods, seeds = _select(suite, envs, methods, seeds)
  out = []
  for env in envs:
    for method in methods:
      reason = pending(env, method)
      for seed in (s for s in seeds if s in suite.seeds_of(env)):
        workdir = suites_lib.run_dir(root, suite, env.name, method.name, seed)
        cmd = (suites_lib.command(root, suite, env, method, seed, python)
               + [f"--config.{o}" for o in extra])
        stale = None if reason else report.stale_reason(workdir, cmd)
        if reason:
          status, why = "pending", reason
        elif stale:
          status, why = "stale", f"{stale}; move {workdir} away to rerun it"
        else:
          status, why = ("done" if run_records.is_finished(workdir) else "todo"), ""
        out.append({"env": env.name, "method": method.name, "seed": seed, "workdir": workdir,
                    "status": status, "reason": why, "command": cmd})
  return out


def run_suite(suite: suites_lib.Suite, root: str, envs=None, methods=None, seeds=None,
              runner: Runner = subprocess_runner, pending=None, log=print, extra=()) -> int:
  """Runs every unfinished, non-pending run of the selection; returns the failure count
  (a stale run counts: it is neither resumed nor replaced)."""
  failures = 0
  for entry in plan_suite(suite, root, envs, methods, seeds, pending, extra=extra):
    tag = f"{entry['env']}/{entry['method']}/seed_{entry['seed']}"
    if entry["status"] == "pending":
      log(f"[sweep] pending  {tag}: {entry['reason']}")
      continue
    if entry["status"] == "done":
      log(f"[sweep] done     {tag} (skipped)")
      continue
    if entry["status"] == "stale":
      failures += 1
      log(f"[sweep] STALE    {tag}: {entry['reason']}")
      continue
    log(f"[sweep] run      {tag}: {shlex.join(entry['command'])}")
    t0 = time.perf_counter()
    rc = runner(entry["command"], entry["workdir"])
    if rc != 0 or not run_records.is_finished(entry["workdir"]):
      failures += 1
      log(f"[sweep] FAILED   {tag} (exit code {rc}); see {entry['workdir']}/log.txt")
    else:
      log(f"[sweep] finished {tag} in {time.perf_counter() - t0:.0f} s")
  return failures


def quick_main(args) -> int:
  """The main job: the quick cells of the mini suite, then their table and curves."""
  suite = suites_lib.quick_suite(suites_lib.get_suite(args.suite))
  t0 = time.perf_counter()
  failures = run_suite(suite, args.root, extra=args.override)
  if failures:
    print(f"[sweep] {failures} failed run(s); see the log.txt of each run under {args.root}")
    return 1
  command = "python -m launch.experiments.sweep quick " + shlex.join(["--root", args.root, "--out", args.out])
  # Finished runs are reused, so a root filled by an older trainer can mix revisions:
  # the table then says so above its rows (report.render).
  paths = report.render(args.root, suite, args.out, command,
                        stem="quick" if suite.name == suites_lib.MINI.name else f"quick_{suite.name}",
                        allow_mixed_revisions=True, per_iteration=True)
  with open(paths["md"], encoding="utf-8") as f:
    print(f.read())
  print(f"[sweep] quick table in {time.perf_counter() - t0:.0f} s")
  print(f"table:  {paths['md']} (and {paths['csv']})")
  print(f"curves: {paths['png']}")
  return 0


def _suite_main(args) -> int:
  suite = suites_lib.get_suite(args.suite)
  if args.cmd == "render":
    argv = ["--suite", args.suite, "--root", args.root, "--out", args.out]
    stem = None
    if args.envs:  # some columns only: <suite>_<env>....{md,csv} beside the whole table
      suite = suites_lib.column_suite(suite, args.envs)
      stem = "_".join([suite.name, *args.envs])
      argv += ["--envs", *args.envs]
    if args.allow_mixed_revisions:
      argv.append("--allow-mixed-revisions")
    reading = None
    if args.reading:
      argv += ["--reading", args.reading]
      try:
        with open(args.reading, encoding="utf-8") as f:
          reading = f.read()
      except OSError as e:
        print(f"launch.experiments.sweep: error: --reading {args.reading}: {e.strerror}", file=sys.stderr)
        return 2
    command = "python -m launch.experiments.sweep render " + shlex.join(argv)
    try:
      paths = report.render(args.root, suite, args.out, command, stem=stem,
                            allow_mixed_revisions=args.allow_mixed_revisions, reading=reading)
    except (report.MixedRevisionsError, report.StaleRunError) as e:
      print(f"launch.experiments.sweep: error: {e}", file=sys.stderr)
      return 2
    for kind in ("md", "csv", "png"):
      print(f"wrote {paths[kind]}")
    return 0
  entries = plan_suite(suite, args.root, args.envs, args.methods, args.seeds, extra=args.override)
  check_configs(entries)  # a config the trainer would refuse: one line before any run
  if args.cmd == "plan" and args.records:
    # The files the repository keeps of each finished run (for `git add`): the table is
    # rendered from them alone; checkpoints, event files and task data stay behind.
    for e in entries:
      if e["status"] == "done":
        for name in report.RECORD_FILES:
          if os.path.isfile(os.path.join(e["workdir"], name)):
            print(os.path.join(e["workdir"], name))
    return 0
  if args.cmd == "plan" or args.print:
    counts = collections.Counter(e["status"] for e in entries)
    for e in entries:
      if args.print:
        if e["status"] == "todo":
          print(shlex.join(e["command"]))
      else:
        reason = f"  ({e['reason']})" if e["reason"] else ""
        print(f"{e['status']:8s} {e['env']}/{e['method']}/seed_{e['seed']}{reason}")
    if not args.print:
      todo = [e for e in entries if e["status"] == "todo"]
      iters = sum(_iterations(suite, e) for e in todo)
      evals = sum(_evaluations(suite, e) for e in todo)
      print(f"{len(entries)} runs: {dict(sorted(counts.items()))}; to run: {len(todo)} runs, "
            f"{iters} training iterations, {evals} evaluations")
      if args.iteration_s or args.eval_s:
        hours = (iters * args.iteration_s + evals * args.eval_s) / 3600
        print(f"estimated wall time: {hours:.1f} h at {args.iteration_s:g} s per iteration and "
              f"{args.eval_s:g} s per evaluation")
    return 0
  failures = run_suite(suite, args.root, args.envs, args.methods, args.seeds, extra=args.override)
  print(f"[sweep] {failures} failed run(s)" if failures else "[sweep] all selected runs finished"
        f"; render: python -m launch.experiments.sweep render --suite {suite.name} --root {args.root}")
  return 1 if failures else 0


def _evaluations(suite: suites_lib.Suite, entry: dict) -> int:
  """Periodic evaluations plus the final one (an evaluation-only run: 1)."""
  if suite.method(entry["method"]).kind == suites_lib.PROMPTED:
    return 1
  o = suite.env(entry["env"]).overrides
  every = int(o.get("eval.every", 0))
  return (_iterations(suite, entry) // every if every else 0) + int(bool(o.get("eval.at_end", True)))


def _iterations(suite: suites_lib.Suite, entry: dict) -> int:
  method = suite.method(entry["method"])
  if method.kind == suites_lib.PROMPTED:
    return 0
  return int(suite.env(entry["env"]).overrides.get("train.num_iterations", 0))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="cmd", required=True)
  for name in ("suite", "plan", "render"):
    s = sub.add_parser(name)
    s.add_argument("--suite", required=True, choices=sorted(suites_lib.SUITES))
    s.add_argument("--root", default="workdirs/sweeps")
    if name == "render":
      s.add_argument("--out", default="results")
      s.add_argument("--envs", nargs="*", default=None,
                     help="render these columns only, to <out>/<suite>_<envs>.{md,csv} and "
                          "_curves.png (the whole table stays <suite>.*)")
      s.add_argument("--allow-mixed-revisions", action="store_true",
                     help="render runs of several trainer revisions (the table says so)")
      s.add_argument("--reading", default=None, metavar="FILE",
                     help="a Markdown file (a reading of the numbers) put under the tables")
    else:
      s.add_argument("--envs", nargs="*", default=None)
      s.add_argument("--methods", nargs="*", default=None)
      s.add_argument("--seeds", nargs="*", type=int, default=None)
      s.add_argument("--print", action="store_true",
                     help="print the commands of the runs still to do instead of running them")
      s.add_argument("--iteration-s", type=float, default=0.0,
                     help="plan: seconds per training iteration for the wall-time estimate")
      s.add_argument("--eval-s", type=float, default=0.0,
                     help="plan: seconds per evaluation for the wall-time estimate")
      s.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                     help="extra config overrides for every run (smoke checks; use another --root)")
      if name == "plan":
        s.add_argument("--records", action="store_true",
                       help="print the record files of the finished runs (metrics.jsonl, "
                            "log.txt), one per line: what the repository keeps of a run")
  q = sub.add_parser("quick", help="the main job: GRPO vs GiGPO vs HGPO on ALFWorld-mini, "
                                    "one seed, then its table and curves")
  q.add_argument("--suite", default="mini", choices=sorted(suites_lib.SUITES))
  q.add_argument("--root", default="workdirs/sweeps")
  q.add_argument("--out", default="workdirs")
  q.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                 help="extra config overrides for every run (smoke checks; use another --root)")
  r = sub.add_parser("run")
  r.add_argument("--name", required=True)
  r.add_argument("--root", default="workdirs/sweeps")
  r.add_argument("--config", required=True)
  r.add_argument("--variants", nargs="+", required=True)
  r.add_argument("--seeds", nargs="+", type=int, default=[123, 456, 789])
  r.add_argument("--override", nargs="*", default=[])
  r.add_argument("--print", action="store_true", help="print the commands instead of running them")
  t = sub.add_parser("table")
  t.add_argument("--root", required=True)
  t.add_argument("--out", default="-")
  args = p.parse_args(argv)
  if args.cmd in ("suite", "plan", "render"):
    try:
      return _suite_main(args)
    except ValueError as e:  # an unknown env/method/seed of the suite: one line, exit 2
      print(f"launch.experiments.sweep: error: {e}", file=sys.stderr)
      return 2
  if args.cmd == "quick":
    try:
      return quick_main(args)
    except ValueError as e:
      print(f"launch.experiments.sweep: error: {e}", file=sys.stderr)
      return 2
  if args.cmd == "run":
    return run(args)
  text = table(args)
  if args.out == "-":
    sys.stdout.write(text)
  else:
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
      f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
