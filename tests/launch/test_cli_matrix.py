"""Every command answers every config: a result, or one line naming the flag to change.

The matrix is {alfworld, webshop, sokoban} x {grpo, rloo, gigpo, hgpo, ppo, hiper} smoke
variants on v5e-8, v5p-8 and v6e-8 (54 cells). Its cost is bounded for CI (2 cores, with
the rest of the suite): every cell runs `launch.plan --no-compile` (config validation, the
mesh, every learner's micro-batch, every program built and lowered for the target: the
checks that used to end in a traceback, without XLA:TPU's compile); a covering subset
(each family, each target, both critic algorithms, `--mesh`, `--micro-batch` and
`--search`) compiles in a subprocess, exit status 0 with a `fits` line and no traceback.
Plus the commands' error lines, and no libtpu start-up noise on a host without TPUs.
"""

import os
import pathlib
import subprocess
import sys

import pytest

from hgpo_jax import runtime
from hgpo_jax.cost import targets
from configs import common
from launch import plan as plan_cli
from launch.experiments import sweep

ROOT = pathlib.Path(__file__).resolve().parents[2]
FAMILIES = ("alfworld", "webshop", "sokoban")
ALGOS = ("grpo", "rloo", "gigpo", "hgpo", "ppo", "hiper")
TARGETS = ("v5e-8", "v5p-8", "v6e-8")
CELLS = [(f, a, t) for f in FAMILIES for a in ALGOS for t in TARGETS]
# libtpu's start-up lines on a host without TPU chips.
NOISE = ("Failed to find host bounds", "unexpected worker hostname", "Source Location Trace",
         "Logging before InitGoogle")

needs_libtpu = pytest.mark.skipif(targets.libtpu_available() is not None,
                                  reason=targets.libtpu_available() or "")


def _spec(family, algo):
  return f"--config=configs/{family}.py:algo={algo},smoke"


def _assert_answer(rc, out, err, ok_line):
  """rc 0 with `ok_line` in the last line of stdout, or rc 2 with one error line."""
  assert "Traceback" not in out + err
  if rc == 0:
    assert ok_line in out.strip().splitlines()[-1], out
  else:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("launch.plan: error: "), err
    assert "--" in lines[0], err  # it names the flag to change


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("family,algo,target", CELLS)
def test_every_config_plans_on_every_target_without_compiling(family, algo, target, capsys):
  rc = plan_cli.main([_spec(family, algo), "--topology", target, "--no-compile"])
  cap = capsys.readouterr()
  _assert_answer(rc, cap.out, cap.err, "lowered without compiling")
  # Every smoke config has a plan on these targets (raised micro-batches included).
  assert rc == 0, cap.err


@pytest.mark.tpu_compile
@needs_libtpu
def test_a_critic_config_raises_the_critic_micro_batch_too(capsys):
  """The issue's case: webshop HiPER smoke on v6e-8 (8 data-parallel chips, config
  micro-batch 4) ended in CriticLearner's traceback; both learners now take 8 rows."""
  rc = plan_cli.main([_spec("webshop", "hiper"), "--topology", "v6e-8", "--no-compile"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "micro-batch of every learner raised from 4 to 8 rows" in out
  assert "critic_values, critic_update, generate" in out and "micro-batch 8;" in out


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.parametrize("args,flag", [
    (["--micro-batch", "4"], "--micro-batch"),  # not a multiple of 8 data-parallel chips
    (["--micro-batch", "16"], "--micro-batch"),  # does not divide the mini-batch of 8
    (["--mesh", "data=3"], "--mesh"),  # 3 x 1 x 1 is not the 8 chips
    (["--mesh", "fsdp=x"], "fsdp=8"),  # unreadable
    (["--config.train.micro_batch_rows=3"], "--micro-batch"),
    (["--config.critic.warmup_iterations=1"], "warmup_iterations"),  # needs a critic
])
def test_plan_errors_are_one_line_naming_the_flag(args, flag, capsys):
  config = "alfworld" if "--config.critic.warmup_iterations=1" in args else "webshop"
  algo = "grpo" if "--config.critic.warmup_iterations=1" in args else "hiper"
  rc = plan_cli.main([_spec(config, algo), "--topology", "v6e-8", "--no-compile", *args])
  cap = capsys.readouterr()
  lines = cap.err.strip().splitlines()
  assert rc == 2 and len(lines) == 1 and lines[0].startswith("launch.plan: error: "), cap.err
  assert flag in lines[0], lines[0]


def test_plan_errors_without_a_compiler(capsys):
  assert plan_cli.main(["--topology", "v5e-8"]) == 2
  assert "--config is required" in capsys.readouterr().err
  assert plan_cli.main([_spec("alfworld", "hgpo"), "--topology", "v9-8"]) == 2
  assert capsys.readouterr().err.startswith("launch.plan: error: --topology: unknown target")
  # one table run compiles with one compiler: TPU and GPU targets are not mixed
  assert plan_cli.main(["--table", "--table-targets", "v5e-8,h100-1", "--table-models",
                        "qwen2.5-1.5b", "--out", "/nonexistent/t.md"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "mixes TPU and GPU targets" in err[0], err
  with pytest.raises(common.ConfigLoadError, match=r"unknown config field --config.train.nofield"):
    common.load("configs/alfworld.py:algo=hgpo,smoke", ["--config.train.nofield=1"])
  # true/false read as launch.main reads a bool field
  config = common.load("configs/alfworld.py:algo=hgpo,smoke", ["--config.rollout.constrained=false"])
  assert config.rollout.constrained is False


def _run(*argv, timeout=1800):
  """A command in a subprocess as a user runs it: no JAX_PLATFORMS, no TPU_* settings."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_PLATFORMS",) and not k.startswith("TPU_")}
  env["PYTHONPATH"] = str(ROOT)
  proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=timeout, check=False)
  return proc.returncode, proc.stdout, proc.stderr


# The compiled subset: every family, every target, both critic algorithms; --mesh,
# --micro-batch and --search.
COMPILED = [
    (("webshop", "hiper", "v6e-8"), ()),
    (("webshop", "hiper", "v6e-8"), ("--mesh", "fsdp=8", "--micro-batch", "8")),
    (("alfworld", "ppo", "v5e-8"), ("--search",)),
    (("sokoban", "gigpo", "v5p-8"), ()),
]


@pytest.mark.tpu_compile
@needs_libtpu
@pytest.mark.slow
@pytest.mark.parametrize("cell,extra", COMPILED)
def test_compiled_plans_fit_and_end_with_the_fits_line(cell, extra):
  family, algo, target = cell
  rc, out, err = _run("launch.plan", _spec(family, algo), "--topology", target, *extra)
  assert "Traceback" not in out + err, err
  assert rc == 0, err + out[-2000:]
  last = out.strip().splitlines()[-1]
  assert last.startswith("fits: peak ") and f"GiB per device on {target}" in last
  if "--search" in extra:  # every learner's micro-batch searched, then the run's command
    assert "update + critic_update peak" in out
    assert "run:  python -m launch.main " in out and "--config.train.micro_batch_rows=" in out
  if not runtime.tpu_chips_present():
    assert not [n for n in NOISE if n in err], err


@needs_libtpu
@pytest.mark.skipif(runtime.tpu_chips_present(), reason="this host has TPU chips")
def test_no_libtpu_start_up_noise_on_a_host_without_tpus(tmp_path):
  """The trainer's entry point (an error after JAX starts its backends) and the plan tool
  (a topology's devices load libtpu as a compiler) print their own lines only."""
  rc, out, err = _run("launch.main", "--config=configs/sokoban.py:algo=hgpo,smoke",
                      "--config.critic.warmup_iterations=1", f"--workdir={tmp_path}",
                      timeout=600)
  assert rc == 2 and err.strip().startswith("launch.main: error: config.critic."), err
  assert not [n for n in NOISE if n in out + err], err
  rc, out, err = _run("launch.plan", "--config=configs/sokoban.py:algo=grpo,smoke",
                      "--topology", "v5e-8", "--no-compile", timeout=600)
  assert rc == 0 and "lowered without compiling" in out, err
  assert err.strip() == "", err
  # a tool that never calls the runtime itself: `launch/__init__.py` picks the platforms
  rc, out, err = _run("launch.benchmarks.rollout", "--accelerator", timeout=600)
  assert rc == 1 and out == "", out
  assert err.strip().splitlines() == [
      "--accelerator needs a GPU or TPU (this process's first device is a CPU); the CPU "
      "sampler benchmark is `python -m launch.benchmarks.sampler`."], err


def test_select_platforms_leaves_an_explicit_choice(monkeypatch):
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  assert runtime.select_platforms() == "cpu"


@pytest.mark.parametrize("argv,flag", [
    (["plan", "--suite", "mini", "--envs", "nope"], "--envs"),
    (["plan", "--suite", "mini", "--methods", "nope"], "--methods"),
    (["plan", "--suite", "mini", "--seeds", "1"], "--seeds"),
    (["plan", "--suite", "mini", "--override", "train.nofield=1"], "--config.train.nofield"),
    (["plan", "--suite", "mini", "--override", "train.lr=x"], "--config.train.lr"),
    (["plan", "--suite", "mini", "--override", "train.micro_batch_rows=3"], "--override"),
])
def test_sweep_plan_errors_are_one_line_naming_the_flag(argv, flag, capsys, tmp_path):
  assert sweep.main([*argv, "--root", str(tmp_path)]) == 2
  lines = capsys.readouterr().err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("launch.experiments.sweep: error: ") and flag in lines[0]


def test_sweep_plan_validates_every_run_config(capsys, tmp_path):
  assert sweep.main(["plan", "--suite", "mini", "--root", str(tmp_path)]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  assert out[-1].startswith("112 runs: {'pending': 12, 'todo': 100}")


def test_plan_table_renders_from_its_csv(tmp_path):
  """`launch.plan --render` writes the Markdown and the figure from the CSV rows: the
  committed docs/plan_table.md is that rendering of docs/plan_table.csv (no hand edits)."""
  rows = [dict(model="m1", target="v5e-8", chips=8, usable_hbm_gib=15.75,
               mesh="data=1,fsdp=4,tensor=2", micro_batch_rows=8, peak_gib=13.5,
               peak_program="update", verdict="fits", est_s_per_iteration=12.5,
               persistent_gib=5.25, peak_gib_update=13.5, peak_gib_generate=9.0, search_s=1,
               commit="abc1234", prefill_chunk_rows=16),
          dict(model="m0", target="v5e-8", chips=8, usable_hbm_gib=15.75,
               mesh="data=2,fsdp=4,tensor=1", micro_batch_rows=8, peak_gib=12.0,
               peak_program="generate", verdict="fits", est_s_per_iteration=40.0,
               persistent_gib=4.0, peak_gib_generate=12.0, search_s=1, commit="abc1234",
               decode_slots=8, share_prefill="false"),
          dict(model="m2", target="v5e-8", chips=8, usable_hbm_gib=15.75, mesh="-",
               verdict="does not fit", persistent_gib=20.0, commit="abc1234"),
          dict(model="m3", target="v5e-8", chips=8, usable_hbm_gib=15.75, mesh="-",
               verdict="does not fit", persistent_gib=12.0, commit="abc1234",
               why="last tried mesh data=1 fsdp=8 tensor=1 micro-batch 2: update peak 30.00 "
                   "GiB, budget 14.18 GiB: no")]
  md = tmp_path / "plan_table.md"
  plan_cli.write_table(rows, str(md), str(tmp_path / "f.png"), 0.1)
  back = plan_cli.read_table(str(tmp_path / "plan_table.csv"))
  assert back[0]["decode_slots"] == 8 and back[0]["share_prefill"] == "false"
  assert back.pop(0)["model"] == "m0"  # sorts first
  assert back[0]["peak_gib"] == 13.5 and back[0]["micro_batch_rows"] == 8
  assert back[0]["prefill_chunk_rows"] == 16 and back[1]["prefill_chunk_rows"] == ""
  assert back[0]["decode_slots"] == ""
  assert back[1]["verdict"] == "does not fit" and back[1]["persistent_gib"] == 20.0
  text = md.read_text()
  assert "| m1 | v5e-8 (8 chips) | `data=1,fsdp=4,tensor=2` | 8 | 16 | - | 13.50 of 15.75 " \
         "(update) | fits | 12.5 | abc1234 |" in text
  assert "| m0 | v5e-8 (8 chips) | `data=2,fsdp=4,tensor=1` | 8 | -, unshared | 8 | 12.00 of 15.75 " \
         "(generate) | fits | 40.0 | abc1234 |" in text
  assert "| m2 | v5e-8 (8 chips) | none fits | - | - | - | persistent alone 20.00 of 15.75 | " \
         "does not fit | - | abc1234 |" in text
  assert back[2]["why"].startswith("last tried mesh data=1 fsdp=8")
  assert "| persistent alone 12.00 of 15.75; last tried mesh data=1 fsdp=8 tensor=1 " \
         "micro-batch 2: update peak 30.00 GiB, budget 14.18 GiB: no | does not fit |" in text
  assert (tmp_path / "f.png").stat().st_size > 1000
  committed = ROOT / "docs" / "plan_table.csv"
  if committed.exists():
    out = tmp_path / "docs" / "plan_table.md"
    plan_cli.write_table(plan_cli.read_table(str(committed)), str(out),
                         str(tmp_path / "docs" / "figures" / "plan_memory.png"), 0.1)
    assert out.read_text() == (ROOT / "docs" / "plan_table.md").read_text()


def test_plan_table_rows_are_in_model_size_order_and_its_text_names_their_models(tmp_path):
  """Rows sort by the billions ending the preset's name (qwen3-1.7b between the 1.5B and
  the 7B, though its name holds "7b"), a LoRA row after its base; the text names each base
  preset once."""
  rows = [dict(model=m, target=t, chips=8, usable_hbm_gib=15.75, mesh="-",
               verdict="does not fit", persistent_gib=1.0, commit="abc1234")
          for m, t in (("qwen3-8b", "v5e-8"), ("qwen2.5-7b+lora64", "v5e-8"),
                       ("qwen3-1.7b", "v6e-8"), ("qwen2.5-7b", "v5e-8"), ("qwen3-1.7b", "v5e-8"),
                       ("qwen2.5-1.5b", "v5e-8"))]
  md = tmp_path / "plan_table.md"
  plan_cli.write_table(rows, str(md), str(tmp_path / "f.png"), 0.1)
  order = [(r["model"], r["target"]) for r in plan_cli.read_table(str(tmp_path / "plan_table.csv"))]
  assert order == [("qwen2.5-1.5b", "v5e-8"), ("qwen3-1.7b", "v5e-8"), ("qwen3-1.7b", "v6e-8"),
                   ("qwen2.5-7b", "v5e-8"), ("qwen2.5-7b+lora64", "v5e-8"), ("qwen3-8b", "v5e-8")]
  text = md.read_text()
  assert "for each model (qwen2.5-1.5b, qwen3-1.7b, qwen2.5-7b and qwen3-8b; " in text
  assert [line.split(" | ")[0][2:] for line in text.splitlines() if line.startswith("| qwen")] \
      == [m for m, _ in order]


def test_a_table_row_names_its_commit_without_counting_the_tables_own_files(tmp_path):
  """Each row is computed after the rows before it rewrote the table's files: those do not
  make the commit read as modified (`+`); any other change does."""
  import subprocess
  git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True,
                                  text=True).stdout.strip()
  git("init", "-q")
  (tmp_path / "table.md").write_text("a\n")
  (tmp_path / "code.py").write_text("x = 1\n")
  git("add", ".")
  git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
  head = git("rev-parse", "--short", "HEAD")
  outputs = (str(tmp_path / "table.md"),)
  assert plan_cli._commit(outputs, repo=str(tmp_path)) == head
  (tmp_path / "table.md").write_text("b\n")
  assert plan_cli._commit(outputs, repo=str(tmp_path)) == head
  assert plan_cli._commit((), repo=str(tmp_path)) == head + "+"
  (tmp_path / "code.py").write_text("x = 2\n")
  assert plan_cli._commit(outputs, repo=str(tmp_path)) == head + "+"
  assert plan_cli._commit(outputs, repo=str(tmp_path / "nope")) == "?"
