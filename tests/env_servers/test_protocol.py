"""env.proto stubs: generated files match a fresh generation, regenerate when missing
or stale (also with two importers at once), and messages round-trip."""

import os
import pathlib
import shutil
import subprocess
import sys

import grpc

from env_servers.protos import codegen
from env_servers.protos import env_pb2
from env_servers.protos import env_pb2_grpc

PROTO_DIR = pathlib.Path(codegen.__file__).parent


def test_stubs_equal_a_fresh_generation(tmp_path):
  written = codegen.generate(tmp_path)
  assert sorted(p.name for p in written) == sorted(codegen.GENERATED)
  for name in codegen.GENERATED:
    assert (tmp_path / name).read_bytes() == (PROTO_DIR / name).read_bytes(), name
  assert "from env_servers.protos import env_pb2" in (tmp_path / "env_pb2_grpc.py").read_text()
  assert not codegen.stale()


def _copy_package(root: pathlib.Path) -> pathlib.Path:
  """A bare copy of env_servers/protos (no generated files) under `root`."""
  dst = root / "env_servers" / "protos"
  dst.mkdir(parents=True)
  shutil.copy(PROTO_DIR.parent / "__init__.py", dst.parent / "__init__.py")
  for name in ("__init__.py", "codegen.py", "build.py", "env.proto", "retriever.proto"):
    shutil.copy(PROTO_DIR / name, dst / name)
  return dst


_IMPORT = ("from env_servers.protos import env_pb2, env_pb2_grpc; "
           "print(env_pb2.StepRequest(slots=[3]).SerializeToString().hex())")


def _run_import(root, wait=True):
  env = dict(os.environ, PYTHONPATH=str(root))
  proc = subprocess.Popen([sys.executable, "-c", _IMPORT], cwd=root, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  return proc.communicate(timeout=60) + (proc.returncode,) if wait else proc


def test_import_regenerates_missing_then_stale_stubs(tmp_path):
  dst = _copy_package(tmp_path)
  out, err, code = _run_import(tmp_path)
  assert code == 0, err
  assert out.strip() == "0a0103"  # field 1, packed, one varint 3
  for name in codegen.GENERATED:
    assert (dst / name).read_bytes() == (PROTO_DIR / name).read_bytes()
  # Make the proto newer than the stubs: the next import must rewrite them.
  old = (dst / "env_pb2.py").stat().st_mtime
  os.utime(dst / "env_pb2.py", (old - 100, old - 100))
  os.utime(dst / "env.proto", (old - 10, old - 10))
  out, err, code = _run_import(tmp_path)
  assert code == 0, err
  assert (dst / "env_pb2.py").stat().st_mtime > old - 10
  assert not list(dst.glob(".protogen-*"))  # no temporary directory left behind


def test_two_processes_importing_at_once_both_succeed(tmp_path):
  dst = _copy_package(tmp_path)
  procs = [_run_import(tmp_path, wait=False) for _ in range(3)]
  for proc in procs:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out.strip() == "0a0103"
  for name in codegen.GENERATED:
    assert (dst / name).read_bytes() == (PROTO_DIR / name).read_bytes()


def test_messages_round_trip():
  request = env_pb2.StepRequest(slots=[0, 5], actions=["go to desk 1".encode(), b""])
  assert env_pb2.StepRequest.FromString(request.SerializeToString()) == request
  reply = env_pb2.BatchReply(results=[
      env_pb2.SlotResult(slot=5, observation="You see a desk.\u00e9", anchor_obs="desk",
                         admissible_actions=["look", "inventory"], reward=10.0, done=True,
                         won=True, info={"task_type": "pick_and_place", "score": "1.0"})
  ])
  back = env_pb2.BatchReply.FromString(reply.SerializeToString())
  r = back.results[0]
  assert (r.slot, r.observation, r.reward, r.done, r.won) == (5, "You see a desk.\u00e9", 10.0,
                                                             True, True)
  assert list(r.admissible_actions) == ["look", "inventory"]
  assert dict(r.info) == {"task_type": "pick_and_place", "score": "1.0"}
  # The service has the five RPCs the pool calls.
  with grpc.insecure_channel("127.0.0.1:1") as channel:
    stub = env_pb2_grpc.EnvStub(channel)
    assert all(callable(getattr(stub, m)) for m in ("Describe", "ListTasks", "Reset", "Step",
                                                     "Close"))
