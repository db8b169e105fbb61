"""Starts env server processes on this machine and makes sure none outlives its owner.

Each server is `sys.executable -m env_servers.serve ...` in its own process group with
`JAX_PLATFORMS=cpu` (a server must never grab the accelerator; see env_servers/serve.py).
`start_servers` reads each server's `PORT <n>` line, waits for the gRPC health
service to report SERVING, and on failure raises with the tail of the server's stderr.

No orphans: `ServerProcess.stop` kills the whole process group; an `atexit` hook stops
every server still running when the interpreter exits; and each server is started with
`--parent-pid` so it exits by itself when its parent dies without running atexit
(SIGKILL, a segfault, an OOM kill).

This module does not import JAX (the rollout may run it in a JAX-free process).
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc

import env_servers

# The directory holding the `env_servers` package, put on the servers' PYTHONPATH so
# they import the same code as this process even without an installed package.
_CODE_ROOT = str(pathlib.Path(env_servers.__file__).resolve().parent.parent)
_LIVE: "weakref.WeakSet[ServerProcess]" = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class LocalServers:
  """Env servers that an `EnvPool` starts (and restarts) itself.

  Attributes:
    env: registered env name (`env_servers.registry.ENVS`).
    num_servers: server processes; the pool's slots are spread evenly over them.
    env_args: env constructor keyword arguments (`--env-arg key=value`).
    host: bind address of the servers.
    startup_timeout_s: how long one server may take to print its port and serve.
    log_level: the servers' logging level.
    retriever_corpus: a corpus file: the pool also starts one `env_servers.retriever` over
      it, passes its endpoint to every env server as `env_args["retriever"]`, restarts it
      on the same port if it dies, and stops it with the env servers; "": none.
    retriever_model: that retriever's `--dense-model` (an encoder directory); "": BM25.
    step_latency_ms: the servers' `--step-latency-ms` (every Step call delayed: a remote
      env's latency, for benchmarks); 0: none.
  """
  env: str
  num_servers: int = 1
  env_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  host: str = "127.0.0.1"
  startup_timeout_s: float = 120.0
  log_level: str = "WARNING"
  retriever_corpus: str = ""
  retriever_model: str = ""
  step_latency_ms: float = 0.0


class ServerProcess:
  """One env server child process (started by `start`, ready after `wait_ready`), or with
  `retriever`, one `env_servers.retriever` process: both print their port and serve gRPC
  health."""

  def __init__(self, env: str, slots: int, env_args: Mapping[str, Any] | None = None,
               host: str = "127.0.0.1", log_level: str = "WARNING", port: int = 0,
               step_latency_ms: float = 0.0):
    cmd = [sys.executable, "-m", "env_servers.serve", "--env", env, "--port", str(port),
           "--host", host, "--slots", str(slots), "--parent-pid", str(os.getpid()),
           "--log-level", log_level]
    if step_latency_ms:
      cmd += ["--step-latency-ms", f"{step_latency_ms:g}"]
    for key, value in (env_args or {}).items():
      cmd += ["--env-arg", f"{key}={_arg_text(value)}"]
    self._spawn(f"env server {env!r}", cmd, host)
    self.env, self.slots = env, slots

  @classmethod
  def retriever(cls, corpus: str, host: str = "127.0.0.1", log_level: str = "WARNING",
                port: int = 0, dense_model: str = "") -> "ServerProcess":
    """An `env_servers.retriever` process over `corpus` (dense with the encoder directory
    `dense_model`, else BM25), not yet ready (`wait_ready`)."""
    proc = cls.__new__(cls)
    dense = ["--dense-model", dense_model] if dense_model else []
    proc._spawn("retriever", [sys.executable, "-m", "env_servers.retriever", "--corpus", corpus,
                              "--port", str(port), "--host", host, "--parent-pid",
                              str(os.getpid()), "--log-level", log_level, *dense], host)
    proc.env, proc.slots = "retriever", 0
    return proc

  def _spawn(self, name: str, cmd: list[str], host: str) -> None:
    self.name, self.host = name, host
    child_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_CODE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    self.cmd = cmd
    # Own process group: stop() can kill anything the env itself spawned.
    self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, env=child_env,
                                  start_new_session=True, text=True, errors="replace")
    self.port: int | None = None
    self._port_seen = threading.Event()
    self._stderr_tail: collections.deque[str] = collections.deque(maxlen=40)
    self._readers = [threading.Thread(target=self._read_stdout, daemon=True),
                     threading.Thread(target=self._read_stderr, daemon=True)]
    for reader in self._readers:
      reader.start()
    _LIVE.add(self)

  @property
  def pid(self) -> int:
    return self.popen.pid

  @property
  def endpoint(self) -> str:
    if self.port is None:
      raise RuntimeError("env server has no port yet; call wait_ready() first")
    return f"{self.host}:{self.port}"

  def alive(self) -> bool:
    return self.popen.poll() is None

  def stderr_tail(self) -> str:
    return "".join(self._stderr_tail).rstrip()

  def _read_stdout(self) -> None:
    for line in self.popen.stdout:
      if self.port is None and line.startswith("PORT "):
        self.port = int(line.split()[1])
        self._port_seen.set()
    self._port_seen.set()  # EOF: the process ended; wait_ready reports why

  def _read_stderr(self) -> None:
    for line in self.popen.stderr:
      self._stderr_tail.append(line)

  def _fail(self, what: str) -> RuntimeError:
    self.stop()
    for reader in self._readers:  # the last stderr lines are the useful ones
      reader.join(timeout=2.0)
    tail = self.stderr_tail() or "(no stderr output)"
    return RuntimeError(f"{self.name} (pid {self.pid}, exit code "
                        f"{self.popen.returncode}) {what}; its stderr ends with:\n{tail}")

  def wait_ready(self, timeout_s: float = 120.0) -> str:
    """Waits for the port line and health SERVING; returns the endpoint or raises."""
    deadline = time.monotonic() + timeout_s
    if not self._port_seen.wait(timeout_s):
      raise self._fail(f"did not print its port within {timeout_s:.0f} s")
    if self.port is None:  # stdout closed without a port: the process is ending
      try:
        self.popen.wait(5.0)
      except subprocess.TimeoutExpired:
        pass
      raise self._fail("exited during start-up")
    with grpc.insecure_channel(self.endpoint) as channel:
      stub = health_pb2_grpc.HealthStub(channel)
      while True:
        if not self.alive():
          raise self._fail("exited during start-up")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
          raise self._fail(f"was not SERVING within {timeout_s:.0f} s")
        try:
          reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=min(2.0, remaining))
          if reply.status == health_pb2.HealthCheckResponse.SERVING:
            return self.endpoint
        except grpc.RpcError:
          pass
        time.sleep(0.05)

  def stop(self, timeout_s: float = 5.0) -> None:
    """SIGTERM to the process group, SIGKILL if it is still there after `timeout_s`."""
    if self.popen.poll() is None:
      self._signal_group(signal.SIGTERM)
      try:
        self.popen.wait(timeout_s)
      except subprocess.TimeoutExpired:
        pass
    self.kill()

  def kill(self) -> None:
    """SIGKILL to the process group (works on a SIGSTOPped server too) and reap."""
    self._signal_group(signal.SIGKILL)
    try:
      self.popen.wait(5.0)
    except subprocess.TimeoutExpired:
      pass
    _LIVE.discard(self)

  def _signal_group(self, sig: int) -> None:
    try:
      os.killpg(self.popen.pid, sig)  # pgid == pid: start_new_session
    except (ProcessLookupError, PermissionError):
      pass


def _arg_text(value: Any) -> str:
  """An env argument as `serve.parse_env_args` reads it back (JSON unless text)."""
  return value if isinstance(value, str) else json.dumps(value)


def start_servers(env: str, slots_per_server: Sequence[int],
                  env_args: Mapping[str, Any] | None = None, host: str = "127.0.0.1",
                  startup_timeout_s: float = 120.0, log_level: str = "WARNING",
                  step_latency_ms: float = 0.0) -> list[ServerProcess]:
  """Starts one server per entry of `slots_per_server` (in parallel) and waits for all.

  Raises:
    RuntimeError: a server did not come up (message carries its stderr tail); the
      servers already started are stopped first.
  """
  procs = [ServerProcess(env, n, env_args, host, log_level, step_latency_ms=step_latency_ms)
           for n in slots_per_server]
  try:
    for proc in procs:
      proc.wait_ready(startup_timeout_s)
  except BaseException:
    for proc in procs:
      proc.stop()
    raise
  return procs


def start_retriever(corpus: str, host: str = "127.0.0.1", startup_timeout_s: float = 120.0,
                    log_level: str = "WARNING", port: int = 0,
                    dense_model: str = "") -> ServerProcess:
  """Starts one `env_servers.retriever` over `corpus` (dense with the encoder directory
  `dense_model`, else BM25) and waits until it serves.

  Raises:
    RuntimeError: it did not come up (a missing or malformed corpus: the message carries
      its stderr tail).
  """
  proc = ServerProcess.retriever(corpus, host, log_level, port, dense_model)
  try:
    proc.wait_ready(startup_timeout_s)
  except BaseException:
    proc.stop()
    raise
  return proc


@atexit.register
def _stop_all() -> None:
  for proc in list(_LIVE):
    proc.stop(timeout_s=2.0)
