"""Generates the Python gRPC stubs of `env.proto` (CLI: `python -m env_servers.protos.build`).

The stubs are generated, never checked in: generated code pins the protobuf/grpcio
runtime it was made with (`ValidateProtobufRuntimeVersion` at the top of `env_pb2.py`), so
generating from the installed grpcio-tools keeps stubs and runtime in lock-step. The
proto is compiled relative to the repository root so the stubs import each other as
`from env_servers.protos import env_pb2`.

Writes are atomic (generate into a private temporary directory, then `os.replace`
each file), so two processes importing `env_servers.protos` at once both end with
complete, identical files.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
PROTO_FILE = PROTO_DIR / "env.proto"
# Package root that `-I` points at: the directory holding `env_servers/`.
ROOT = PROTO_DIR.parent.parent
PROTO_REL = PROTO_FILE.relative_to(ROOT)
GENERATED = ("env_pb2.py", "env_pb2.pyi", "env_pb2_grpc.py")


def stale() -> bool:
  """True when a generated file is missing or older than env.proto."""
  proto_mtime = PROTO_FILE.stat().st_mtime
  for name in GENERATED:
    path = PROTO_DIR / name
    if not path.exists() or path.stat().st_mtime < proto_mtime:
      return True
  return False


def generate(out_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
  """Compiles env.proto and writes the three stub files.

  Args:
    out_dir: directory that receives the files; defaults to this package directory.

  Returns:
    The written paths.
  """
  try:
    from grpc_tools import protoc
  except ImportError as e:
    raise RuntimeError(
        "env_servers/protos: the gRPC stubs are missing or stale and grpcio-tools is not "
        "installed; run `pip install -r requirements.txt` then "
        "`python -m env_servers.protos.build`") from e
  import importlib.resources

  out_dir = pathlib.Path(out_dir) if out_dir is not None else PROTO_DIR
  out_dir.mkdir(parents=True, exist_ok=True)
  well_known = importlib.resources.files("grpc_tools") / "_proto"
  with tempfile.TemporaryDirectory(dir=out_dir, prefix=".protogen-") as tmp:
    args = [
        "grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={tmp}",
        f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", str(PROTO_FILE)
    ]
    code = protoc.main(args)
    if code != 0:
      raise RuntimeError(f"protoc failed with exit code {code} on {PROTO_FILE}; "
                         "fix the syntax error it printed above")
    written = []
    for name in GENERATED:
      src = pathlib.Path(tmp) / PROTO_REL.parent / name
      dst = out_dir / name
      os.replace(src, dst)
      written.append(dst)
  return written


def ensure_generated() -> None:
  """Regenerates the stubs when missing or older than env.proto (import-time hook)."""
  if stale():
    generate()
