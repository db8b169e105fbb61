"""Generates the Python gRPC stubs of `env.proto` and `retriever.proto` (CLI: `python -m
env_servers.protos.build`).

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
PROTO_NAMES = ("env", "retriever")  # env.proto (env servers), retriever.proto (retriever)
PROTO_FILE = PROTO_DIR / "env.proto"
# Package root that `-I` points at: the directory holding `env_servers/`.
ROOT = PROTO_DIR.parent.parent
PROTO_REL = PROTO_FILE.relative_to(ROOT)


def _stubs(name: str) -> tuple[str, ...]:
  return (f"{name}_pb2.py", f"{name}_pb2.pyi", f"{name}_pb2_grpc.py")


def _present() -> tuple[str, ...]:
  """The protos of `PROTO_NAMES` present beside this file (a bare copy may hold env.proto
  alone)."""
  return tuple(n for n in PROTO_NAMES if (PROTO_DIR / f"{n}.proto").exists())


GENERATED = tuple(f for n in PROTO_NAMES for f in _stubs(n))


def stale() -> bool:
  """True when a generated file is missing or older than its .proto."""
  for proto in _present():
    proto_mtime = (PROTO_DIR / f"{proto}.proto").stat().st_mtime
    for name in _stubs(proto):
      path = PROTO_DIR / name
      if not path.exists() or path.stat().st_mtime < proto_mtime:
        return True
  return False


def generate(out_dir: pathlib.Path | None = None) -> list[pathlib.Path]:
  """Compiles each .proto and writes its three stub files.

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
  protos = _present()
  with tempfile.TemporaryDirectory(dir=out_dir, prefix=".protogen-") as tmp:
    args = [
        "grpc_tools.protoc", f"-I{ROOT}", f"-I{well_known}", f"--python_out={tmp}",
        f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
        *(str(PROTO_DIR / f"{n}.proto") for n in protos)
    ]
    code = protoc.main(args)
    if code != 0:
      raise RuntimeError(f"protoc failed with exit code {code} on {', '.join(protos)}.proto; "
                         "fix the syntax error it printed above")
    written = []
    for name in (f for n in protos for f in _stubs(n)):
      src = pathlib.Path(tmp) / PROTO_REL.parent / name
      dst = out_dir / name
      os.replace(src, dst)
      written.append(dst)
  return written


def ensure_generated() -> None:
  """Regenerates the stubs when missing or older than their .proto (import-time hook)."""
  if stale():
    generate()
