r"""Results tables and curves of a suite, read from its run directories.

  python -m launch.experiments.sweep render --suite mini [--root workdirs/sweeps] [--out results]

writes `results/<suite>.md`, `results/<suite>.csv` and `results/<suite>_curves.png`.
Only finished runs count (a run is finished when its metrics.jsonl holds the final
evaluation: a line with `eval/...` keys and no `rollout/...` keys, which the trainer
writes after its last iteration and launch.evaluate writes as its only line).

Per environment and method, over the finished seeds (std = sample standard deviation):
  * train success, last 3 iterations: per seed the mean of `rollout/success` over the
    last 3 training iterations; mean ± std over seeds;
  * held-out success at the end: `eval/<heldout>/success` of the final evaluation
    (T = config.eval.temperature, 0.4); mean ± std over seeds;
  * best held-out eval: the single largest `eval/<heldout>/success` over all seeds and
    all evaluations of the run (periodic and final), with its seed and iteration. A
    peak, reported as a peak: it is optimistic and is never averaged;
  * iterations to 50 % train success: per seed the first iteration whose
    `rollout/success` >= 0.5; mean ± std over the seeds that reached it ("k/n" when not
    all did, "not reached" when none did);
  * episode length and invalid-action rate of the final held-out evaluation.
Noise marks: for each method and the reference method, the per-seed differences of
(a) and (b) over the seeds both finished (seeds share tasks and env seeds: paired) are
resampled 10,000 times (paired bootstrap, fixed generator seed 0); when the 95 %
percentile interval of the mean difference contains 0, the cell is marked "≈" (within
seed noise). With fewer than 2 paired seeds no mark is computed.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.metadata
import io
import math
import os
import platform
import shlex
import statistics
import subprocess
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from hgpo_jax.training import run_records
from launch.experiments import suites as suites_lib

LAST_K = 3  # training iterations averaged for the final train success
THRESHOLD = 0.5  # train success for "iterations to 50 %"
BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 0
NOISE_MARK = "≈"
NO_SPREAD = 1e-9  # a std of paired differences at or below this is 0 (rounding of equal ones)
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "ml-collections",
            "textworld", "alfworld", "matplotlib")


@dataclasses.dataclass(frozen=True)
class SeedResult:
  """What the table reads from one finished run."""

  seed: int
  train_final: float | None  # mean rollout/success of the last LAST_K iterations
  iters_to_threshold: int | None  # first step with rollout/success >= THRESHOLD
  num_iterations: int
  eval_final: float | None
  eval_best: float | None
  eval_best_step: int | None
  eval_episode_length: float | None
  eval_invalid_rate: float | None
  train_episode_length: float | None
  train_invalid_rate: float | None
  curve: tuple[tuple[int, float], ...]  # (step, rollout/success)
  # the final held-out evaluation game by game (eval-set order: won), from the run's
  # eval_tasks.jsonl; None for a run without one
  eval_games: tuple[float, ...] | None = None


def _mean_last(values: Sequence[float], k: int = LAST_K) -> float | None:
  return float(np.mean(values[-k:])) if values else None


def summarize_run(lines: Sequence[dict], seed: int, heldout: str) -> SeedResult:
  """Per-seed numbers from a finished run's metrics lines."""
  train = sorted((l for l in lines if "rollout/success" in l), key=lambda l: l["step"])
  success = [float(l["rollout/success"]) for l in train]
  finals = [l for l in lines if run_records.is_final_eval(l)]
  final = finals[-1] if finals else {}
  key = f"eval/{heldout}/success"
  # The final evaluation (step num_iterations + 1) evaluates the weights after the last
  # iteration: its iteration is step - 1 (0 for an evaluation-only run).
  evals = [(float(l[key]), int(l["step"]) - (1 if train and run_records.is_final_eval(l) else 0))
           for l in lines if key in l]
  best = max(evals, key=lambda e: (e[0], -e[1])) if evals else (None, None)  # earliest peak
  reached = [int(l["step"]) for l in train if float(l["rollout/success"]) >= THRESHOLD]
  get = lambda name: float(final[name]) if name in final else None  # noqa: E731
  return SeedResult(
      seed=seed,
      train_final=_mean_last(success),
      iters_to_threshold=reached[0] if reached else None,
      num_iterations=int(train[-1]["step"]) if train else 0,
      eval_final=get(key),
      eval_best=best[0], eval_best_step=best[1],
      eval_episode_length=get(f"eval/{heldout}/episode_length"),
      eval_invalid_rate=get(f"eval/{heldout}/invalid_rate"),
      train_episode_length=_mean_last([float(l["rollout/episode_length"]) for l in train
                                       if "rollout/episode_length" in l]),
      train_invalid_rate=_mean_last([float(l["rollout/invalid_rate"]) for l in train
                                     if "rollout/invalid_rate" in l]),
      curve=tuple((int(l["step"]), float(l["rollout/success"])) for l in train))


def collect(root: str, suite: suites_lib.Suite, env: suites_lib.Environment,
            method: suites_lib.Method) -> tuple[list[SeedResult], int]:
  """Finished runs of one cell (in suite seed order) and the number of unfinished ones."""
  results, unfinished = [], 0
  for seed in suite.seeds_of(env):
    rd = suites_lib.run_dir(root, suite, env.name, method.name, seed)
    if run_records.is_finished(rd):
      result = summarize_run(run_records.read_metrics(rd), seed,
                             env.heldout_split)
      results.append(dataclasses.replace(result, eval_games=final_games(rd, env.heldout_split)))
    elif os.path.isdir(rd):
      unfinished += 1
  return results, unfinished


def final_games(run_dir: str, split: str) -> tuple[float, ...] | None:
  """Per game (eval-set order), the share of the run's last evaluation on `split` that won
  it (1.0 or 0.0; with `eval.repeats` the mean over the repeats): the records of its last
  evaluated step in eval_tasks.jsonl (`metrics.write_task_results`); None when the run has
  none."""
  records = run_records.read_task_results(run_dir)
  steps = [step for step, s in records if s == split]
  if not steps:
    return None
  games: dict[int, list[bool]] = {}
  for r in records[(max(steps), split)]:
    games.setdefault(r["index"], []).append(bool(r["won"]))
  return tuple(float(np.mean(games[i])) for i in sorted(games))


# ---------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------
def mean_std(values: Sequence[float]) -> tuple[float, float] | None:
  """Mean and sample standard deviation (0 for one value); None for no values."""
  if not values:
    return None
  if len(values) == 1:
    return float(values[0]), 0.0
  return float(statistics.mean(values)), float(statistics.stdev(values))


def paired_bootstrap(diffs: Sequence[float], samples: int = BOOTSTRAP_SAMPLES,
                     seed: int = BOOTSTRAP_SEED) -> tuple[float, float]:
  """95 % percentile interval of the mean of `diffs` under resampling with replacement."""
  d = np.asarray(diffs, dtype=np.float64)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, len(d), size=(samples, len(d)))
  means = d[idx].mean(axis=1)
  lo, hi = np.percentile(means, [2.5, 97.5])
  return float(lo), float(hi)


def within_noise(method: Sequence[SeedResult], reference: Sequence[SeedResult],
                 field: str) -> bool | None:
  """True if `field` differs from the reference by no more than seed noise (the paired
  bootstrap interval of the mean difference contains 0); None with < 2 paired seeds."""
  diffs = paired_diffs(method, reference, field)
  if len(diffs) < 2:
    return None
  lo, hi = paired_bootstrap(diffs)
  return lo <= 0.0 <= hi


# Two-sided 95 % quantiles of Student's t by degrees of freedom (1 ... 30; 1.96 beyond).
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
  return _T975[df - 1] if df <= len(_T975) else 1.96


def paired_diffs(method: Sequence[SeedResult], reference: Sequence[SeedResult],
                 field: str) -> list[float]:
  """method - reference of `field`, per seed that both finished (seeds share tasks)."""
  ref = {r.seed: getattr(r, field) for r in reference}
  return [getattr(r, field) - ref[r.seed] for r in method
          if r.seed in ref and getattr(r, field) is not None and ref[r.seed] is not None]


def detectable_difference(diffs: Sequence[float]) -> float | None:
  """The smallest mean paired difference these seeds can tell from 0 at 95 %.

  The half-width of the t interval of the mean paired difference, t(0.975, n-1) s / sqrt(n)
  (s: the sample std of the per-seed differences): a difference at least this large puts
  0 outside the interval. None with fewer than 2 paired seeds, or when all the differences
  are equal (a spread of 0 measures nothing: two seeds that happen to differ by the same
  number of games would claim that any difference is detectable).
  """
  if len(diffs) < 2 or statistics.stdev(diffs) <= NO_SPREAD:
    return None
  return t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))


def seeds_to_detect(spread: float, delta: float, max_seeds: int = 200) -> int | None:
  """Fewest paired seeds n with t(0.975, n-1) spread / sqrt(n) <= delta (None past max)."""
  for n in range(2, max_seeds + 1):
    if t975(n - 1) * spread / math.sqrt(n) <= delta:
      return n
  return None


# ---------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class Cell:
  """One (environment, method) row of the table."""

  env: suites_lib.Environment
  method: suites_lib.Method
  results: list[SeedResult]
  unfinished: int = 0
  pending: str | None = None
  train_noise: bool | None = None
  eval_noise: bool | None = None
  train_detectable: float | None = None  # detectable_difference vs the reference
  eval_detectable: float | None = None
  paired_seeds: int = 0  # seeds finished by both this method and the reference


def _pct(ms: tuple[float, float] | None, n: int) -> str:
  if ms is None:
    return "—"
  return f"{100 * ms[0]:.1f}" if n == 1 else f"{100 * ms[0]:.1f} ± {100 * ms[1]:.1f}"


def _num(ms: tuple[float, float] | None, n: int, digits: int = 1) -> str:
  if ms is None:
    return "—"
  return f"{ms[0]:.{digits}f}" if n == 1 else f"{ms[0]:.{digits}f} ± {ms[1]:.{digits}f}"


def _values(results: Iterable[SeedResult], field: str) -> list[float]:
  return [getattr(r, field) for r in results if getattr(r, field) is not None]


def cell_columns(cell: Cell, reference: str) -> dict[str, str]:
  """The markdown cells of one row (also the CSV's *_text columns)."""
  m, rs = cell.method, cell.results
  if cell.pending:
    return {"seeds": "pending", "train": "—", "eval": "—", "best": "—", "iters": "—",
            "length": "—", "invalid": "—", "detect": "—", "note": cell.pending}
  if not rs:
    note = f"{cell.unfinished} unfinished" if cell.unfinished else "not run"
    return {"seeds": "0", "train": "—", "eval": "—", "best": "—", "iters": "—",
            "length": "—", "invalid": "—", "detect": "—", "note": note}
  n = len(rs)
  trained = m.kind == suites_lib.TRAINED
  ref_mark = " (ref)" if m.name == reference else ""
  train = _pct(mean_std(_values(rs, "train_final")), n) if trained else "— (no training)"
  if trained and cell.train_noise:
    train += f" {NOISE_MARK}"
  evl = _pct(mean_std(_values(rs, "eval_final")), n)
  if cell.eval_noise:
    evl += f" {NOISE_MARK}"
  best_runs = [r for r in rs if r.eval_best is not None]
  if best_runs:
    b = max(best_runs, key=lambda r: (r.eval_best, -r.seed))
    step = "start" if not trained else f"it. {b.eval_best_step}"
    best = f"best {100 * b.eval_best:.1f} (seed {b.seed}, {step})"
  else:
    best = "—"
  if trained:
    reached = _values(rs, "iters_to_threshold")
    if not reached:
      iters = f"not reached (> {max(r.num_iterations for r in rs)})"
    else:
      iters = _num(mean_std(reached), len(reached))
      if len(reached) < n:
        iters += f" ({len(reached)}/{n} seeds)"
  else:
    iters = "—"
  return {"seeds": f"{n}{ref_mark}", "train": train, "eval": evl, "best": best, "iters": iters,
          "length": _num(mean_std(_values(rs, "eval_episode_length")), n),
          "invalid": _pct(mean_std(_values(rs, "eval_invalid_rate")), n),
          "detect": _detect(cell, reference), "note": _note(cell)}


def _detect(cell: Cell, reference: str) -> str:
  """The detectable-difference cell: train / held-out, in points."""
  if cell.method.name == reference:
    return "(ref)"
  def fmt(d):
    if d is not None:
      return f"{100 * d:.1f}"
    return "n/a (< 2 paired seeds)" if cell.paired_seeds < 2 else "n/a (equal paired differences)"
  train = fmt(cell.train_detectable) if cell.method.kind == suites_lib.TRAINED else "—"
  return f"{train} / {fmt(cell.eval_detectable)}"


def _note(cell: Cell) -> str:
  """The Note column of a cell with finished runs: the method's note, unfinished runs."""
  unfinished = f"{cell.unfinished} unfinished" if cell.unfinished else ""
  return "; ".join(x for x in (cell.method.note, unfinished) if x)


def build_cells(root: str, suite: suites_lib.Suite,
                pending: Callable[[suites_lib.Environment, suites_lib.Method], str | None]
                ) -> list[Cell]:
  cells = []
  for env in suite.environments:
    by_method = {}
    for method in suite.methods:
      reason = pending(env, method)
      results, unfinished = collect(root, suite, env, method)
      by_method[method.name] = Cell(env, method, results, unfinished, reason)
    ref = by_method.get(suite.reference)
    for cell in by_method.values():
      if ref is not None and cell.method.name != suite.reference and not cell.pending:
        cell.paired_seeds = len({r.seed for r in cell.results} & {r.seed for r in ref.results})
        if cell.method.kind == suites_lib.TRAINED:
          cell.train_noise = within_noise(cell.results, ref.results, "train_final")
          cell.train_detectable = detectable_difference(
              paired_diffs(cell.results, ref.results, "train_final"))
        cell.eval_noise = within_noise(cell.results, ref.results, "eval_final")
        cell.eval_detectable = detectable_difference(
            paired_diffs(cell.results, ref.results, "eval_final"))
      cells.append(cell)
  return cells


HEADER = ("Method", "Seeds", "Train success, last 3 it. (%)", "Held-out success at end, T=0.4 (%)",
          "Best held-out eval (%), single peak", "Iterations to 50 % train success",
          "Episode length (eval)", "Invalid actions (eval, %)",
          "Detectable difference vs ref., train / held-out (points, 95 %)", "Note")


def power_line(cells: Sequence[Cell], env: suites_lib.Environment, reference: str,
               delta: float = 0.10) -> str:
  """How many games one held-out number rests on, and the seeds a `delta` difference needs."""
  games = env.overrides.get("eval.num_tasks")
  parts = [f"Held-out success: {games} games per evaluation (one game = {100 / games:.1f} points)."
           if games else "Held-out success: the split's default number of games."]
  for field, label in (("train_final", "train"), ("eval_final", "held-out")):
    mine = [c for c in cells if c.env.name == env.name and not c.pending and c.results]
    ref = next((c.results for c in mine if c.method.name == reference), [])
    spreads = [statistics.stdev(d) for d in (paired_diffs(c.results, ref, field) for c in mine
                                             if c.method.name != reference) if len(d) >= 2]
    spreads = [x for x in spreads if x > NO_SPREAD]
    if not spreads:
      parts.append(f"{label}: no paired spread yet (fewer than 2 seeds).")
      continue
    spread = statistics.median(spreads)
    n = seeds_to_detect(spread, delta)
    need = f"{n} seeds" if n else "more than 200 seeds"
    parts.append(f"{label}: median std of the paired differences {100 * spread:.1f} points, so a "
                 f"{100 * delta:.0f}-point difference needs {need} (t interval, 95 %).")
  return " ".join(parts)


def game_diffs(method: Sequence[SeedResult], baseline: Sequence[SeedResult]) -> list[float]:
  """method - baseline held-out outcome (won = 1) per (seed, game) of the seeds both
  finished with per-game records of the same games: each seed's final evaluations play
  the same tasks with the same evaluation keys (`launch.evaluate` uses the trainer's final
  key), so the outcomes pair game by game."""
  base = {r.seed: r.eval_games for r in baseline if r.eval_games is not None}
  out = []
  for r in method:
    if r.eval_games is not None and r.seed in base and len(base[r.seed]) == len(r.eval_games):
      out += [float(a) - float(b) for a, b in zip(r.eval_games, base[r.seed])]
  return out


def paired_seed_count(method: Sequence[SeedResult], baseline: Sequence[SeedResult]) -> int:
  """How many seeds `game_diffs(method, baseline)` pairs."""
  base = {r.seed: r.eval_games for r in baseline if r.eval_games is not None}
  return sum(1 for r in method if r.eval_games is not None and r.seed in base
             and len(base[r.seed]) == len(r.eval_games))


def paired_text(diffs: Sequence[float], seeds: int) -> tuple[str, float, float]:
  """The mean of paired (seed, game) differences with its 95 % bootstrap interval, as the
  tables print it, and the interval's ends."""
  lo, hi = paired_bootstrap(diffs)
  return (f"{100 * float(np.mean(diffs)):+.1f} points, 95 % interval [{100 * lo:+.1f}, "
          f"{100 * hi:+.1f}] over {len(diffs)} (seed, game) pairs "
          f"({seeds} seed{'s' if seeds != 1 else ''})"), lo, hi


def games_lines(cells: Sequence[Cell], env: suites_lib.Environment) -> list[str]:
  """Each trained method's held-out success against the column's prompted method, paired
  game by game (`game_diffs`): the mean difference with its 95 % paired bootstrap interval
  over (seed, game) pairs, and whether the interval decides it. Nothing for a column
  without a prompted method or per-game records."""
  mine = [c for c in cells if c.env.name == env.name and not c.pending and c.results]
  prompted = next((c for c in mine if c.method.kind == suites_lib.PROMPTED), None)
  if prompted is None:
    return []
  out = []
  for cell in mine:
    if cell.method.kind != suites_lib.TRAINED:
      continue
    diffs = game_diffs(cell.results, prompted.results)
    if not diffs:
      continue
    text, lo, hi = paired_text(diffs, paired_seed_count(cell.results, prompted.results))
    verdict = ("trained better" if lo > 0 else "prompted better" if hi < 0
               else "not decided (the interval contains 0)")
    out.append(f"{cell.method.label}: {text}: {verdict}.")
  if not out:
    return []
  return [f"Held-out success against {prompted.method.label}, paired game by game (the same "
          "games and evaluation keys per seed; trained - prompted, paired bootstrap over "
          "(seed, game) pairs):", ""] + [f"- {line}" for line in out]


def between_lines(cells: Sequence[Cell], env: suites_lib.Environment) -> list[str]:
  """The trained methods against each other, paired game by game (`game_diffs`) over the
  seeds both finished: for each pair in the suite's method order, later - earlier with its
  95 % paired bootstrap interval over (seed, game) pairs and whether the interval decides
  it. Only for a column with a prompted method (the language-model suites, whose held-out
  evaluations share their keys across methods of a seed) and two trained methods with
  per-game records."""
  mine = [c for c in cells if c.env.name == env.name and not c.pending and c.results]
  if not any(c.method.kind == suites_lib.PROMPTED for c in mine):
    return []
  trained = [c for c in mine if c.method.kind == suites_lib.TRAINED]
  out = []
  for i, a in enumerate(trained):
    for b in trained[i + 1:]:
      diffs = game_diffs(b.results, a.results)
      if not diffs:
        continue
      text, lo, hi = paired_text(diffs, paired_seed_count(b.results, a.results))
      verdict = (f"{b.method.label} better" if lo > 0 else f"{a.method.label} better"
                 if hi < 0 else "not separated (the interval contains 0)")
      out.append(f"{b.method.label} - {a.method.label}: {text}: {verdict}.")
  if not out:
    return []
  return ["Held-out success of the trained methods against each other, paired game by game "
          "(the seeds both finished; paired bootstrap over (seed, game) pairs):", ""] + [
              f"- {line}" for line in out]


def curve_lines(cells: Sequence[Cell], env: suites_lib.Environment) -> list[str]:
  """Train success per iteration of each finished run of the column (a suite's quick
  version: one seed, a few methods, so each curve fits a line)."""
  out = []
  for cell in cells:
    if cell.env.name != env.name or cell.method.kind != suites_lib.TRAINED:
      continue
    for r in cell.results:
      out.append(f"- {cell.method.label}, seed {r.seed}: "
                 + " ".join(f"{v:.3f}" for _, v in r.curve))
  return ["Train success per iteration:", ""] + out if out else []


def progress_line(cells: Sequence[Cell], suite: suites_lib.Suite) -> str | None:
  """A table of a sweep still running says how far it is (None once every run that can
  run is finished): finished, unfinished (started, resumable), pending (cannot run yet)
  and not started runs, out of the suite's."""
  total = sum(len(suite.seeds_of(c.env)) for c in cells)
  finished = sum(len(c.results) for c in cells)
  unfinished = sum(c.unfinished for c in cells if not c.pending)
  pending = sum(len(suite.seeds_of(c.env)) - len(c.results) for c in cells if c.pending)
  if finished + pending == total:
    return None
  rest = total - finished - unfinished - pending
  parts = [f"{unfinished} unfinished", f"{rest} not started"] + (
      [f"{pending} pending"] if pending else [])
  return (f"**Sweep in progress: {finished} of {total} runs finished** ({', '.join(parts)}); "
          "each cell is over the seeds finished so far (its Seeds column).")


def markdown(cells: Sequence[Cell], suite: suites_lib.Suite, footer: Sequence[str],
             mixed_revisions: str | None = None, reading: str | None = None,
             per_iteration: bool = False) -> str:
  """The tables; `per_iteration` adds each run's train success per iteration (`curve_lines`)."""
  ref_label = suite.method(suite.reference).label
  out = [f"# Results: suite `{suite.name}` ({suite.version})", "",
         f"{suite.description}. Mean ± std over finished seeds (seeds {list(suite.seeds)}); "
         f"{NOISE_MARK} = within seed noise of the reference method {ref_label} (paired bootstrap "
         "over seeds, 95 % interval of the mean difference contains 0). \"Best\" is the single "
         "largest held-out evaluation over all seeds and evaluations: a peak, never a mean. "
         "\"Detectable difference\": the half-width of the 95 % t interval of the mean paired "
         f"difference from {ref_label} over seeds; a smaller difference cannot be told from seed "
         "noise with these seeds."
         + ("" if mixed_revisions else " The runs of a column come from one trainer revision "
            "(footer); methods are compared within a column only."), ""]
  progress = progress_line(cells, suite)
  if progress:
    out += [progress, ""]
  if mixed_revisions:
    out += [f"**Mixed trainer revisions** (rendered with --allow-mixed-revisions): "
            f"{mixed_revisions}. Rows from different revisions are not one experiment.", ""]
  for env in suite.environments:
    seeds_here = ("" if suite.seeds_of(env) == suite.seeds
                  else f"; seeds {list(suite.seeds_of(env))}")
    out += [f"## {env.label or env.name} (held-out split: {env.heldout_split}{seeds_here})", "",
            "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for cell in cells:
      if cell.env.name != env.name:
        continue
      c = cell_columns(cell, suite.reference)
      out.append("| " + " | ".join([cell.method.label, c["seeds"], c["train"], c["eval"],
                                     c["best"], c["iters"], c["length"], c["invalid"],
                                     c["detect"], c["note"].replace("|", "/")]) + " |")
    out += ["", power_line(cells, env, suite.reference), ""]
    for lines in (games_lines(cells, env), between_lines(cells, env),
                  curve_lines(cells, env) if per_iteration else []):
      if lines:
        out += lines + [""]
  if reading:
    out += ["## Reading", "", reading.strip(), ""]
  out += ["---", ""] + [f"- {line}" for line in footer]
  return "\n".join(out) + "\n"


CSV_FIELDS = ("env", "method", "label", "status", "seeds", "train_final_mean", "train_final_std",
              "train_within_noise", "eval_final_mean", "eval_final_std", "eval_within_noise",
              "eval_best", "eval_best_seed", "eval_best_step", "iters_to_50_mean",
              "iters_to_50_std", "iters_to_50_reached", "eval_episode_length_mean",
              "eval_invalid_rate_mean", "train_episode_length_mean", "train_invalid_rate_mean",
              "train_detectable", "eval_detectable", "note")


def _r(x: float | None) -> str:
  return "" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.6g}"


def csv_text(cells: Sequence[Cell], suite: suites_lib.Suite) -> str:
  buf = io.StringIO()
  w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
  w.writeheader()
  for cell in cells:
    rs = cell.results
    status = "pending" if cell.pending else ("done" if rs else "not run")
    tf, ef = mean_std(_values(rs, "train_final")), mean_std(_values(rs, "eval_final"))
    reached = _values(rs, "iters_to_threshold")
    it = mean_std(reached)
    best = max((r for r in rs if r.eval_best is not None), key=lambda r: (r.eval_best, -r.seed),
               default=None)
    avg = lambda f: _r(mean_std(_values(rs, f))[0]) if _values(rs, f) else ""  # noqa: E731
    trained = cell.method.kind == suites_lib.TRAINED
    w.writerow({
        "env": cell.env.name, "method": cell.method.name, "label": cell.method.label,
        "status": status, "seeds": " ".join(str(r.seed) for r in rs),
        "train_final_mean": _r(tf[0]) if tf and trained else "",
        "train_final_std": _r(tf[1]) if tf and trained else "",
        "train_within_noise": "" if cell.train_noise is None else str(cell.train_noise).lower(),
        "eval_final_mean": _r(ef[0]) if ef else "", "eval_final_std": _r(ef[1]) if ef else "",
        "eval_within_noise": "" if cell.eval_noise is None else str(cell.eval_noise).lower(),
        "eval_best": _r(best.eval_best) if best else "",
        "eval_best_seed": best.seed if best else "",
        "eval_best_step": best.eval_best_step if best else "",
        "iters_to_50_mean": _r(it[0]) if it and trained else "",
        "iters_to_50_std": _r(it[1]) if it and trained else "",
        "iters_to_50_reached": f"{len(reached)}/{len(rs)}" if rs and trained else "",
        "eval_episode_length_mean": avg("eval_episode_length"),
        "eval_invalid_rate_mean": avg("eval_invalid_rate"),
        "train_episode_length_mean": avg("train_episode_length") if trained else "",
        "train_invalid_rate_mean": avg("train_invalid_rate") if trained else "",
        "train_detectable": _r(cell.train_detectable), "eval_detectable": _r(cell.eval_detectable),
        "note": cell.pending or (_note(cell) if rs else
                                 (f"{cell.unfinished} unfinished" if cell.unfinished else "")),
    })
  return buf.getvalue()


def plot(cells: Sequence[Cell], suite: suites_lib.Suite, path: str) -> None:
  """Train success vs iteration, mean and ± std band over seeds, one panel per env."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  envs = suite.environments
  fig, axes = plt.subplots(1, len(envs), figsize=(5 * len(envs), 3.8), squeeze=False)
  for ax, env in zip(axes[0], envs):
    for cell in cells:
      if cell.env.name != env.name or not cell.results:
        continue
      if cell.method.kind == suites_lib.PROMPTED:
        vals = _values(cell.results, "eval_final")
        if vals:
          ax.axhline(float(np.mean(vals)), linestyle="--", color="gray", linewidth=1,
                     label=f"{cell.method.label} (eval)")
        continue
      n = min(len(r.curve) for r in cell.results)
      if n == 0:
        continue
      steps = np.array([s for s, _ in cell.results[0].curve[:n]])
      ys = np.array([[v for _, v in r.curve[:n]] for r in cell.results])
      mean, std = ys.mean(axis=0), ys.std(axis=0, ddof=1) if len(ys) > 1 else np.zeros(n)
      line, = ax.plot(steps, mean, label=f"{cell.method.label} (n={len(ys)})")
      ax.fill_between(steps, np.clip(mean - std, 0, 1), np.clip(mean + std, 0, 1),
                      color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title(env.label or env.name)
    ax.set_xlabel("iteration")
    ax.set_ylabel("train success (mean ± std over seeds)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(fontsize=7, loc="upper left")
  fig.suptitle(f"suite {suite.name} ({suite.version})")
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=110, metadata={"Software": None})
  plt.close(fig)


# What the repository keeps of a finished run (results/runs): the table is rendered from these.
RECORD_FILES = (run_records.METRICS, "log.txt", run_records.TASK_RESULTS)
REQUIRED_RECORD_FILES = RECORD_FILES[:2]  # runs from before per-game records have these only
REVISION_PREFIX = "# trainer revision: "  # the line launch.experiments.sweep writes into each run's log.txt
COMMAND_PREFIX = "$ "  # and the line after it: the run's command


def git_revision() -> str:
  """HEAD of the repository this code runs from, with a mark for uncommitted changes."""
  try:
    sha = subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=suites_lib.REPO_ROOT,
                                  text=True, stderr=subprocess.DEVNULL).strip()
    dirty = subprocess.call(["git", "diff", "--quiet", "HEAD"], cwd=suites_lib.REPO_ROOT,
                            stderr=subprocess.DEVNULL) != 0
    return sha + (" (uncommitted changes)" if dirty else "")
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def _versions() -> str:
  out = []
  for p in PACKAGES:
    try:
      out.append(f"{p} {importlib.metadata.version(p)}")
    except importlib.metadata.PackageNotFoundError:
      pass
  return ", ".join(out)


def _machine() -> str:
  return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")


def revision_counts(root: str, suite: suites_lib.Suite,
                    env_name: str | None = None) -> dict[str, int]:
  """Finished runs per trainer revision recorded in their run logs ("not recorded" if none),
  of one column (`env_name`) or of the whole suite."""
  counts: dict[str, int] = {}
  for env in suite.environments:
    if env_name is not None and env.name != env_name:
      continue
    for method in suite.methods:
      for seed in suite.seeds_of(env):
        workdir = suites_lib.run_dir(root, suite, env.name, method.name, seed)
        if not run_records.is_finished(workdir):
          continue
        # the last start of the run counts (a resumed run may move on)
        revision = (read_run_log(workdir).revisions or ["not recorded"])[-1]
        counts[revision] = counts.get(revision, 0) + 1
  return counts


def _count_text(counts: dict[str, int]) -> str:
  return ", ".join(f"{r} ({n} runs)" for r, n in sorted(counts.items())) or "no finished runs"


def run_revisions(root: str, suite: suites_lib.Suite) -> str:
  """The trainer revisions recorded in the suite's run logs, with their run counts; per
  column when the columns' revisions differ."""
  whole = revision_counts(root, suite)
  if len(whole) <= 1 or len(suite.environments) == 1:
    return _count_text(whole)
  return "; ".join(f"{env.label or env.name}: {_count_text(revision_counts(root, suite, env.name))}"
                   for env in suite.environments)


def mixed_columns(root: str, suite: suites_lib.Suite) -> list[str]:
  """Columns whose finished runs record more than one trainer revision (or some none)."""
  return [env.name for env in suite.environments
          if len(revision_counts(root, suite, env.name)) > 1]


class MixedRevisionsError(ValueError):
  """The finished runs of a table come from more than one trainer revision."""


class StaleRunError(ValueError):
  """A finished run of a table was made by another command than the suite's for its cell."""


class RunLog(NamedTuple):
  """What launch.experiments.sweep recorded in a run's log.txt, one entry per start of the run (a resumed
  run has several), oldest first: the trainer revisions and the commands."""
  revisions: list[str]
  commands: list[list[str]]


def read_run_log(workdir: str) -> RunLog:
  """The revisions and commands recorded in `workdir`'s log.txt (empty lists when it has none)."""
  log = RunLog([], [])
  try:
    with open(os.path.join(workdir, "log.txt"), encoding="utf-8") as f:
      for line in f:
        if line.startswith(REVISION_PREFIX):
          log.revisions.append(line[len(REVISION_PREFIX):].strip())
        elif line.startswith(COMMAND_PREFIX):
          log.commands.append(shlex.split(line[len(COMMAND_PREFIX):]))
  except OSError:
    pass
  return log


def command_difference(recorded: Sequence[str], expected: Sequence[str]) -> str | None:
  """How a recorded command differs from the expected one, or None; the interpreter and the
  --workdir are not compared (a run root may be moved)."""
  def comparable(cmd):
    return [a for a in cmd[1:] if not a.startswith("--workdir=")]
  ran, now = comparable(recorded), comparable(expected)
  if ran == now:
    return None
  only_ran = [a for a in ran if a not in now]
  only_now = [a for a in now if a not in ran]
  if not only_ran and not only_now:
    return "the same arguments in another order"
  return (f"it ran with {' '.join(only_ran) or '(nothing more)'} where the suite's command has "
          f"{' '.join(only_now) or '(nothing more)'}")


def stale_reason(workdir: str, expected: Sequence[str]) -> str | None:
  """Why the run in `workdir` is not a run of the `expected` command (None: every command
  recorded in its log is that one, or none is recorded)."""
  for cmd in read_run_log(workdir).commands:
    difference = command_difference(cmd, expected)
    if difference:
      return difference
  return None


def stale_runs(root: str, suite: suites_lib.Suite) -> list[tuple[str, str]]:
  """(env/method/seed_n, reason) of each finished run whose recorded command is not the
  suite's current command for its cell: a run of an older suite definition."""
  out = []
  for env in suite.environments:
    for method in suite.methods:
      for seed in suite.seeds_of(env):
        workdir = suites_lib.run_dir(root, suite, env.name, method.name, seed)
        if not run_records.is_finished(workdir):
          continue
        reason = stale_reason(workdir, suites_lib.command(root, suite, env, method, seed))
        if reason:
          out.append((f"{env.name}/{method.name}/seed_{seed}", reason))
  return out


def display_root(root: str) -> str:
  """`root` as the table shows it: relative to the working directory when under it, else a
  placeholder (a committed table carries no machine's paths)."""
  rel = os.path.relpath(os.path.abspath(root))
  return rel if not rel.startswith("..") else "<run root>"


def footer(suite: suites_lib.Suite, command: str, root: str) -> list[str]:
  shown = display_root(root)
  if shown != root:
    command = command.replace(root, shown)
  return [f"command: `{command}` (runs under `{shown}`; run directories `<env>/<method>/seed_<n>`)",
          f"suite: {suite.name}, version {suite.version}",
          f"git: {git_revision()}", f"trainer revisions of the runs: {run_revisions(root, suite)}",
          f"packages: {_versions()}", f"machine: {_machine()}"]


def render(root: str, suite: suites_lib.Suite, out_dir: str, command: str,
           pending: Callable[[suites_lib.Environment, suites_lib.Method], str | None] | None = None,
           stem: str | None = None, allow_mixed_revisions: bool = False,
           reading: str | None = None, per_iteration: bool = False) -> dict[str, str]:
  """Writes <out_dir>/<stem>.md, .csv and _curves.png (stem: the suite's name by
  default); returns their paths. `reading` (Markdown: a hand-written reading of the
  numbers) goes under the tables, as "Reading", above the footer.

  A column compares methods run by one trainer: when the finished runs of a column record
  more than one trainer revision (or some record none), this raises MixedRevisionsError
  naming them, unless `allow_mixed_revisions`, and then the table says so above its first
  row. Different columns may come from different revisions (no number of one column is
  compared with another's); the footer then lists each column's.

  A finished run whose log records another command than the suite's for its cell (a run of
  an older suite definition: another shop, level set or budget) raises StaleRunError.
  """
  stale = stale_runs(root, suite)
  if stale:
    tag, reason = stale[0]
    raise StaleRunError(
        f"{len(stale)} finished run(s) under {root} are not runs of suite {suite.version}'s "
        f"commands, first {tag}: {reason}; move them out of the run root and rerun them")
  mixed_envs = mixed_columns(root, suite)
  mixed = bool(mixed_envs)
  if mixed and not allow_mixed_revisions:
    column = mixed_envs[0]
    revisions = revision_counts(root, suite, column)
    raise MixedRevisionsError(
        f"the finished runs of column {column!r} under {root} come from {len(revisions)} "
        f"trainer revisions ({_count_text(revisions)}); rerun them with one trainer or pass "
        "--allow-mixed-revisions to render them anyway (the table then says so)")
  cells = build_cells(root, suite, pending or suites_lib.pending_reason)
  os.makedirs(out_dir, exist_ok=True)
  stem = stem or suite.name
  paths = {"md": os.path.join(out_dir, f"{stem}.md"),
           "csv": os.path.join(out_dir, f"{stem}.csv"),
           "png": os.path.join(out_dir, f"{stem}_curves.png")}
  text = markdown(cells, suite, footer(suite, command, root),   # before any file is rewritten:
                  mixed_revisions=run_revisions(root, suite) if mixed else None, reading=reading,
                  per_iteration=per_iteration)
  with open(paths["md"], "w", encoding="utf-8") as f:            # the footer reads `git diff`
    f.write(text)
  with open(paths["csv"], "w", encoding="utf-8") as f:
    f.write(csv_text(cells, suite))
  plot(cells, suite, paths["png"])
  return paths


if __name__ == "__main__":
  raise SystemExit("launch.experiments.report is the library behind `python -m launch.experiments.sweep render "
                   "--suite NAME`; run that (--help for its options).")
