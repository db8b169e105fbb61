r"""Trainer entry point: flags, multi-process initialisation, logging; then the library.

  python -m launch.main --config=configs/alfworld.py:algo=hgpo,k=2 --workdir=/tmp/run \
      [--config.train.lr=1e-6 ...]

Kept deliberately thin (flax examples style): everything testable lives in
`hgpo_jax.train.train_and_evaluate(config, workdir)`.

Multi-process (TPU pod slices, GPU clusters): set --num_processes/--process_id/
--coordinator_address (or let `jax.distributed.initialize()` auto-detect on TPU/SLURM
with --distributed=auto); each process then drives its share of the env groups.

Bad input (an unknown config argument or field, an ill-typed override, an unknown
estimator, a missing or wrong model, an unwritable workdir) ends the run before any
work with one line on stderr, `launch.main: error: ...`, and exit code 2; `--verbose`
adds the traceback.
"""

from __future__ import annotations

import os
import re
import sys
import traceback

from absl import app
from absl import flags
from absl import logging

from hgpo_jax import runtime

# The flags of both entry points (launch/evaluate.py reads them too). `--config.a.b=VALUE`
# overrides are not absl flags: `parse_flags` takes them out and `configs.common.load`
# applies them, as for every entry point.
CONFIG = flags.DEFINE_string("config", None, "Experiment config file[:variant args]; "
                             "--config.a.b=VALUE overrides a field.")
WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, metrics and dumps.")
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed", "off", ["off", "auto", "explicit"],
    "off: single process; auto: jax.distributed.initialize() with cluster auto-detection "
    "(TPU pods, SLURM); explicit: use the three flags below.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Total number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_LOCAL_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "If > 0, fake this many CPU devices (testing sharding on one machine).")
_CPU_NUMERICS = flags.DEFINE_enum(
    "cpu_numerics", None, list(runtime.CPU_NUMERICS),
    "XLA:CPU numerics setting (hgpo_jax/runtime.py, docs/reproducibility.md); default "
    "$HGPO_JAX_CPU_NUMERICS, else 'default'. host_math runs bfloat16 products on a CPU's "
    "bf16 units (model.compute_dtype=bfloat16); default gives the same bits on other CPUs.")
_VERBOSE = flags.DEFINE_bool("verbose", False,
                             "Print the traceback of bad-input errors (else one line).")

EXIT_BAD_INPUT = 2

flags.mark_flags_as_required(["config", "workdir"])


class BadInput(Exception):
  """A user error: reported as one line and exit code 2."""


def _fail(message: str, verbose: bool, prog: str = "launch.main") -> None:
  if verbose:
    traceback.print_exc()
  hint = "" if verbose else " (--verbose prints the traceback)"
  print(f"{prog}: error: {message}{hint}", file=sys.stderr, flush=True)
  sys.exit(EXIT_BAD_INPUT)


def _last_line(text: str) -> str:
  """The exception line at the end of a message that embeds a traceback, without the
  exception type and the quotes a KeyError adds."""
  lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
  if any(l.startswith("Traceback (most recent call last)") for l in lines):
    lines = [re.sub(r"^[A-Za-z_.]*(Error|Exception): ", "", lines[-1])]
  line = " ".join(lines)
  if len(line) > 1 and line[0] == line[-1] and line[0] in "\"'":
    line = line[1:-1]
  return line


_LOADED = {}  # the config parse_flags loaded (`loaded_config`)


def parse_flags(argv: list[str], prog: str = "launch.main") -> list[str]:
  """absl flag parsing, then the config loaded with its `--config.a.b=VALUE` overrides
  (`configs.common.load`); bad input ends in one line (`{prog}: error: ...`) and exit
  code 2."""
  verbose = any(a in ("--verbose", "--verbose=true", "--verbose=1") for a in argv)
  overrides = [a for a in argv[1:] if a.startswith("--config.")]
  try:
    rest = flags.FLAGS([a for a in argv if not a.startswith("--config.")])
  except Exception as e:  # flags.Error
    _fail(_last_line(str(e)), verbose, prog)
    raise  # unreachable (sys.exit)
  if CONFIG.value is not None:
    from configs import common
    try:
      _LOADED["config"] = common.load(CONFIG.value, overrides)
    except Exception as e:  # ConfigLoadError, or the config file's own refusal (get_config)
      _fail(_last_line(str(e.args[0] if isinstance(e, KeyError) and e.args else e)),
            verbose, prog)
  return rest


def loaded_config():
  """The config `parse_flags` loaded from --config and its overrides."""
  return _LOADED["config"]


def _check_workdir(workdir: str) -> None:
  """Creates `workdir` and writes a probe file, so an unwritable one fails before any work."""
  probe = os.path.join(workdir, ".write_probe")
  try:
    os.makedirs(workdir, exist_ok=True)
    with open(probe, "w", encoding="utf-8") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise BadInput(f"workdir {workdir} is not writable ({e.strerror or e}); pass a --workdir "
                   "you can write to") from e


def run_guarded(body, argv, prog: str = "launch.main") -> None:
  """Runs `body(argv)`; a user error ends it with one line on stderr (`{prog}: error: ...`)
  and exit code 2, a bug with its traceback. The entry points of the trainer and of
  launch/evaluate.py share it."""
  try:
    body(argv)
  except (BadInput, app.UsageError) as e:
    _fail(str(e), _VERBOSE.value, prog)
  except Exception as e:
    from hgpo_jax import train
    from hgpo_jax.training import checkpoint
    user_error = isinstance(e, (train.ConfigError, checkpoint.CheckpointError))
    # ValueError/KeyError/OSError are bad input only where inputs are read (the config,
    # the model files, the checkpoint to resume); elsewhere they are bugs: traceback.
    if isinstance(e, (ValueError, KeyError, OSError)):
      frames = {f.name for f in traceback.extract_tb(e.__traceback__)}
      user_error |= bool(frames & _INPUT_READERS)
    if user_error:
      message = _last_line(str(e.args[0] if isinstance(e, KeyError) and e.args else e))
      if "no bundled weights" in message:
        message += " From the command line: --config.model.path=DIR."
      _fail(message, _VERBOSE.value, prog)
    raise


def main(argv):
  run_guarded(_main, argv)


# Functions that read user input; a ValueError/KeyError/OSError raised under them is a
# bad-input error (one line, exit 2).
_INPUT_READERS = frozenset({"from_dict", "load_model", "resume",
                            "make_mesh", "make_pool"})


def start(argv, prog: str = "launch.main"):
  """What both entry points do before their work: checks the arguments, the config file
  and the workdir, pins the CPU numerics, starts JAX (multi-process if asked), prints the
  platform and refuses a CPU run of a config meant for accelerators. Returns the run's
  settings, the config converted once into `hgpo_jax.training.experiment.Experiment`."""
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = loaded_config()
  _check_workdir(WORKDIR.value)
  if not flags.FLAGS["verbosity"].present:
    # Orbax and JAX log every checkpoint file operation at INFO; keep the console to
    # the per-iteration summaries unless --verbosity is given.
    logging.set_verbosity(logging.WARNING)
  if _LOCAL_DEVICES.value > 0:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={_LOCAL_DEVICES.value}")
  numerics = runtime.cpu_numerics_name(_CPU_NUMERICS.value)
  try:
    runtime.pin_cpu_isa(numerics)  # before JAX creates its CPU backend
  except ValueError as e:  # $HGPO_JAX_CPU_NUMERICS names no setting
    raise BadInput(str(e)) from None
  import jax  # after XLA_FLAGS on purpose
  if _DISTRIBUTED.value == "auto":
    jax.distributed.initialize()
  elif _DISTRIBUTED.value == "explicit":
    if None in (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value):
      raise app.UsageError("--distributed=explicit needs --coordinator_address, "
                           "--num_processes and --process_id")
    jax.distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  # The platform first (stdout: stderr is kept for errors), then no silent CPU fallback.
  from hgpo_jax.training import experiment
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import platform as platform_lib
  platform = jax.devices()[0].platform
  compute = ""
  if config.model.compute_dtype in model_config.COMPUTE_DTYPES:  # else validate says why
    compute = ", compute " + model_config.resolve_compute_dtype(
        config.model.compute_dtype, config.model.dtype, platform_lib.target_platform(jax.devices()))
  print(f"{prog}: platform {platform} ({jax.devices()[0].device_kind}), "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices, process "
        f"{jax.process_index()}/{jax.process_count()}, jax {jax.__version__}{compute}"
        f"{', XLA:CPU numerics ' + numerics if platform == 'cpu' else ''}", flush=True)
  exp = experiment.from_config(config)  # the typed settings the library reads
  refusal = experiment.cpu_refusal(exp, platform=platform, num_devices=jax.device_count(),
                                   distributed=_DISTRIBUTED.value != "off")
  if refusal:
    raise BadInput(refusal)
  runtime.enable_compilation_cache()
  return exp


def _main(argv):
  exp = start(argv)
  from hgpo_jax import train
  train.train_and_evaluate(exp, WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
