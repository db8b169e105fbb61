"""The environment server process: many env slots of one env behind `env.proto`.

  python -m env_servers.serve --env sokoban --port 0 --slots 32 [--host 127.0.0.1]
      [--env-arg key=value ...] [--parent-pid PID]
      [--token-file FILE] [--tls-cert CERT.pem --tls-key KEY.pem]

Prints `PORT <n>` on stdout once it serves (port 0 = pick a free one), logs to stderr,
and stops cleanly on SIGTERM/SIGINT, or when `--parent-pid` is no longer its parent
(the launcher passes it so a crashed trainer leaves no orphan servers).

It never imports JAX: a server must not initialise the accelerator its trainer owns
(cf. sglang-jax issue #857), so importing `jax` here fails with a
clear error. Slots of one call are stepped one after the other (envs are Python);
parallelism comes from running several servers.

Robustness (the error model of env.proto; docs/architecture.md): a request is validated as a whole before
any env is touched and rejected with INVALID_ARGUMENT / FAILED_PRECONDITION naming
the slot; an exception inside one env becomes that slot's result (done, info["error"])
and the slot must be reset; over-long actions are truncated; messages are capped by
`--max-message-mb`; when the client's deadline passes mid-call the server stops
stepping and marks the call's slots stale (they must be reset before the next step).

Exposure: the server binds loopback by default. For servers reached over a network,
`--token-file` (or the environment variable HGPO_ENV_TOKEN) makes every call, health
checks included, carry `authorization: Bearer <token>` metadata (else UNAUTHENTICATED),
and `--tls-cert/--tls-key` serve TLS (`grpc.ssl_server_credentials`); the client side
is `EnvPool(..., token=..., tls_root_cert=...)`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import hmac
import importlib.abc
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc

from env_servers import base
from env_servers import protos
from env_servers import registry
from env_servers.protos import env_pb2

log = logging.getLogger("env_servers.serve")
TOKEN_ENV = "HGPO_ENV_TOKEN"



class _NoJaxFinder(importlib.abc.MetaPathFinder):
  """Makes `import jax` fail loudly inside a server process."""

  def find_spec(self, fullname, path=None, target=None):
    del path, target
    if fullname.split(".")[0] in ("jax", "jaxlib"):
      raise ImportError(f"env servers must not import {fullname} (it would initialise the "
                        "accelerator the trainer owns); move that import out of the env")
    return None


class RequestError(Exception):
  """A request the server rejects as a whole; `code` is the gRPC status to return."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code


@dataclasses.dataclass
class _Slot:
  env: Any = None
  # "idle" (never reset), "active", "done", "stale" (must be reset: env raised or the
  # client abandoned a call that touched it).
  state: str = "idle"


def parse_env_args(pairs: Sequence[str]) -> dict[str, Any]:
  """Parses `key=value` strings; values are JSON when they parse (1, 0.5, true), else text."""
  out = {}
  for pair in pairs:
    key, sep, value = pair.partition("=")
    if not sep or not key:
      raise ValueError(f"--env-arg {pair!r} is not key=value; write e.g. --env-arg max_steps=30")
    try:
      out[key] = json.loads(value)
    except json.JSONDecodeError:
      out[key] = value
  return out


def _clean_text(text: Any, limit: int = base.MAX_TEXT_CHARS) -> str:
  """str, capped at `limit` chars, without lone surrogates (protobuf rejects them)."""
  text = str(text)[:limit]
  return text.encode("utf-8", "replace").decode("utf-8")


class SlotServer:
  """The slots of one server, independent of gRPC (the servicer wraps it).

  Thread-safe: one lock serialises Reset/Step/Close (envs are Python; the GIL would
  serialise them anyway), so concurrent calls never interleave on a slot.
  """

  def __init__(self, env_name: str, num_slots: int, env_args: dict[str, Any] | None = None,
               step_latency_s: float = 0.0):
    if num_slots < 1:
      raise ValueError(f"--slots must be >= 1, got {num_slots}")
    if step_latency_s < 0:
      raise ValueError(f"--step-latency-ms must be >= 0, got {step_latency_s * 1e3:g}")
    self.env_name = env_name
    self.step_latency_s = step_latency_s
    self.env_args = dict(env_args or {})
    self._env_cls = registry.env_class(env_name)
    self._slots = [_Slot() for _ in range(num_slots)]
    self._lock = threading.Lock()
    self._task_sets: dict[str, frozenset] = {}
    # Built now so a bad --env-arg fails at start-up, not at the first reset; it also
    # answers Describe/ListTasks and becomes slot 0's env.
    self._slots[0].env = self._make_env()
    self._catalog = self._slots[0].env

  def _make_env(self):
    try:
      return self._env_cls(**self.env_args)
    except TypeError as e:
      raise ValueError(f"env {self.env_name!r} rejected --env-arg {self.env_args}: {e}") from e

  @property
  def num_slots(self) -> int:
    return len(self._slots)

  def splits(self) -> list[str]:
    return list(self._catalog.splits())

  def list_tasks(self, split: str) -> list[str]:
    if split not in self.splits():
      raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"unknown split {split!r}; {self.env_name} splits: {self.splits()}")
    return list(self._catalog.task_ids(split))

  def _check_slots(self, slots: Sequence[int], n_values: int, what: str) -> None:
    if len(slots) != n_values:
      raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{len(slots)} slots but {n_values} {what}; send one per slot")
    seen = set()
    for slot in slots:
      if not 0 <= slot < len(self._slots):
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"slot {slot}: unknown slot; this server has slots "
                           f"0..{len(self._slots) - 1}")
      if slot in seen:
        raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                           f"slot {slot}: listed twice in one call")
      seen.add(slot)

  def _known_tasks(self, split: str) -> frozenset:
    if split not in self._task_sets:
      self._task_sets[split] = frozenset(self.list_tasks(split))
    return self._task_sets[split]

  def reset(self, slots: Sequence[int], task_ids: Sequence[str], seeds: Sequence[int],
            split: str, is_active: Callable[[], bool] = lambda: True) -> list[base.StepResult]:
    """Starts an episode in each slot; `task_ids` may be empty (the seed picks)."""
    task_ids = list(task_ids) or [""] * len(slots)
    self._check_slots(slots, len(task_ids), "task ids")
    self._check_slots(slots, len(seeds), "seeds")
    if split:
      known = self._known_tasks(split)
      for slot, task_id in zip(slots, task_ids):
        if task_id and task_id not in known:
          raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"slot {slot}: unknown task id {task_id!r} in split {split!r}")
    options_base = {"split": split} if split else {}
    with self._lock:
      return self._run(slots, is_active, lambda s, i: self._reset_one(
          s, {**options_base, **({"task_id": task_ids[i]} if task_ids[i] else {})}, seeds[i]))

  def step(self, slots: Sequence[int], actions: Sequence[bytes],
           is_active: Callable[[], bool] = lambda: True) -> list[base.StepResult]:
    """Executes one action (UTF-8 bytes) per slot, after `step_latency_s` (a remote env's
    round trip, `--step-latency-ms`; outside the lock, so concurrent calls overlap)."""
    if self.step_latency_s:
      time.sleep(self.step_latency_s)
    self._check_slots(slots, len(actions), "actions")
    texts = []
    with self._lock:
      for slot, raw in zip(slots, actions):
        try:
          texts.append(raw.decode("utf-8") if isinstance(raw, bytes) else str(raw))
        except UnicodeDecodeError as e:
          raise RequestError(grpc.StatusCode.INVALID_ARGUMENT,
                             f"slot {slot}: action is not valid UTF-8 ({e.reason} at byte "
                             f"{e.start}); send UTF-8 text") from None
        state = self._slots[slot].state
        if state != "active":
          why = {"idle": "step before reset", "done": "episode is over",
                 "stale": "slot must be reset (its env raised or a call was abandoned)"}[state]
          raise RequestError(grpc.StatusCode.FAILED_PRECONDITION,
                             f"slot {slot}: {why}; call Reset on it first")
      return self._run(slots, is_active, lambda s, i: self._step_one(s, texts[i]))

  def close(self, slots: Sequence[int]) -> None:
    slots = list(slots) or list(range(len(self._slots)))
    self._check_slots(slots, len(slots), "slots")
    with self._lock:
      for slot in slots:
        s = self._slots[slot]
        if s.env is not None and s.env is not self._catalog:
          try:
            s.env.close()
          except Exception:
            log.exception("slot %d: env.close() raised", slot)
          s.env = None
        s.state = "idle"

  def _run(self, slots, is_active, fn) -> list[base.StepResult]:
    results = []
    for i, slot in enumerate(slots):
      if not is_active():
        # The client gave up (deadline/cancel): it will re-run these episodes, and
        # their server-side state is now partial, so forbid stepping them.
        for s in slots:
          self._slots[s].state = "stale"
        raise RequestError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"call abandoned by the client after {i} of {len(slots)} slots")
      results.append(fn(slot, i))
    return results

  def _reset_one(self, slot: int, options: dict, seed: int) -> base.StepResult:
    s = self._slots[slot]
    try:
      if s.env is None:
        s.env = self._make_env()
      obs, info = s.env.reset(seed=int(seed), options=options)
      s.state = "active"
      return self._result(obs, 0.0, False, False, info)
    except Exception as e:
      return self._env_error(slot, "reset", e)

  def _step_one(self, slot: int, action: str) -> base.StepResult:
    s = self._slots[slot]
    truncated_action = len(action) > base.MAX_TEXT_CHARS
    try:
      obs, reward, terminated, truncated, info = s.env.step(action[:base.MAX_TEXT_CHARS])
    except Exception as e:
      return self._env_error(slot, "step", e)
    result = self._result(obs, reward, terminated, truncated, info)
    if truncated_action:
      result.info[base.ACTION_TRUNCATED] = "true"
    s.state = "done" if result.done else "active"
    return result

  def _result(self, obs, reward, terminated, truncated, info) -> base.StepResult:
    result = base.result_from_gym(obs, reward, bool(terminated or truncated), info)
    if truncated and not terminated:
      result.info[base.TRUNCATED] = "true"
    return result

  def to_proto(self, slot: int, r: base.StepResult, what: str) -> env_pb2.SlotResult:
    """The slot's result as a message; an env output that cannot be converted (e.g. an
    observation whose `__str__` raises) becomes that slot's env error."""
    try:
      return _to_proto(slot, r)
    except Exception as e:
      with self._lock:
        return _to_proto(slot, self._env_error(slot, what, e))

  def _env_error(self, slot: int, what: str, e: Exception) -> base.StepResult:
    log.exception("slot %d: env %s raised; the slot must be reset", slot, what)
    # A fresh instance on the next reset: the raising one may be half-updated (slot 0's
    # is kept: it also answers Describe/ListTasks, which need no episode state).
    s = self._slots[slot]
    if s.env is not self._catalog:
      s.env = None
    s.state = "stale"
    message = f"{type(e).__name__}: {e}"
    return base.StepResult(observation=f"[env error in {what}] {message}", anchor_obs="",
                           admissible_actions=[], reward=0.0, done=True, won=False,
                           info={base.ERROR: message})


def _to_proto(slot: int, r: base.StepResult) -> env_pb2.SlotResult:
  return env_pb2.SlotResult(
      slot=slot, observation=_clean_text(r.observation), anchor_obs=_clean_text(r.anchor_obs),
      admissible_actions=[_clean_text(a, 1024) for a in r.admissible_actions],
      reward=r.reward, done=r.done, won=r.won,
      info={_clean_text(k, 256): _clean_text(v) for k, v in r.info.items()})


def _handler(method: str, request_cls, fn):
  """A unary handler that parses the request itself, so garbage bytes get a clear status.

  An exception that escapes `fn` (an env raising outside a slot's reset/step, e.g. in
  `task_ids`) is answered with INTERNAL and the trailing metadata
  `protos.ENV_ERROR_METADATA`, so the client tells it from a transport failure and
  raises at once instead of restarting the server.
  """

  def handle(raw: bytes, context: grpc.ServicerContext):
    try:
      request = request_cls.FromString(raw)
    except Exception as e:  # DecodeError and friends
      context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                    f"malformed {request_cls.__name__}: {e}; use the env_servers.protos stubs")
    start = time.perf_counter()
    try:
      reply = fn(request, context)
    except RequestError as e:
      log.warning("%s rejected: %s", request_cls.__name__, e)
      context.abort(e.code, str(e))
    except Exception as e:  # reported to the client
      log.exception("%s: the env raised", method)
      context.set_trailing_metadata(((protos.ENV_ERROR_METADATA, "1"),))
      context.abort(grpc.StatusCode.INTERNAL,
                    f"env error in {method}: {type(e).__name__}: {_clean_text(e, 2000)}")
    log.debug("%s served in %.1f ms", request_cls.__name__, 1e3 * (time.perf_counter() - start))
    return reply

  return handle


class TokenInterceptor(grpc.ServerInterceptor):
  """Rejects every call without `authorization: Bearer <token>` metadata (UNAUTHENTICATED)."""

  def __init__(self, token: str):
    if not token:
      raise ValueError("the env server token is empty; write a non-empty secret to the token file")
    self._expected = f"Bearer {token}".encode()

    def deny(request, context):
      del request
      context.abort(grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong env server token; pass the token the server was started "
                    "with (EnvPool(..., token=...) or --config.env.token_file=FILE)")

    self._deny = grpc.unary_unary_rpc_method_handler(deny)

  def intercept_service(self, continuation, handler_call_details):
    for key, value in handler_call_details.invocation_metadata or ():
      if key == "authorization" and hmac.compare_digest(
          value.encode() if isinstance(value, str) else value, self._expected):
        return continuation(handler_call_details)
    return self._deny


def read_token(token_file: str | None) -> str | None:
  """The shared secret from `token_file` (stripped) or $HGPO_ENV_TOKEN; None: no token."""
  if token_file:
    with open(token_file, encoding="utf-8") as f:
      token = f.read().strip()
    if not token:
      raise ValueError(f"token file {token_file} is empty; write the shared secret into it")
    return token
  return os.environ.get(TOKEN_ENV) or None


def make_grpc_server(core: SlotServer, host: str, port: int, workers: int,
                     max_message_bytes: int, *, token: str | None = None,
                     tls: tuple[bytes, bytes] | None = None) -> tuple[grpc.Server, int, Any]:
  """Builds and starts the gRPC server; returns (server, bound port, health servicer).

  `token`: shared secret every call must carry (see `TokenInterceptor`); `tls`: PEM
  (certificate chain, private key) to serve TLS instead of plaintext.
  """

  def describe(request, context):
    del request, context
    return env_pb2.DescribeReply(
        env_name=core.env_name, splits=core.splits(), num_slots=core.num_slots,
        protocol_version=protos.PROTOCOL_VERSION,
        process={"pid": str(os.getpid()), "python": sys.version.split()[0],
                 "jax_imported": str("jax" in sys.modules).lower()})

  def list_tasks(request, context):
    del context
    return env_pb2.ListTasksReply(task_ids=core.list_tasks(request.split))

  def reset(request, context):
    slots = list(request.slots)
    results = core.reset(slots, list(request.task_ids), list(request.seeds), request.split,
                         context.is_active)
    return env_pb2.BatchReply(results=[core.to_proto(s, r, "reset")
                                       for s, r in zip(slots, results)])

  def step(request, context):
    slots = list(request.slots)
    results = core.step(slots, list(request.actions), context.is_active)
    return env_pb2.BatchReply(results=[core.to_proto(s, r, "step")
                                       for s, r in zip(slots, results)])

  def close(request, context):
    del context
    core.close(list(request.slots))
    return env_pb2.CloseReply()

  methods = {
      "Describe": (env_pb2.DescribeRequest, describe),
      "ListTasks": (env_pb2.ListTasksRequest, list_tasks),
      "Reset": (env_pb2.ResetRequest, reset),
      "Step": (env_pb2.StepRequest, step),
      "Close": (env_pb2.CloseRequest, close),
  }
  handlers = {
      name: grpc.unary_unary_rpc_method_handler(
          _handler(name, req_cls, fn), request_deserializer=None,
          response_serializer=lambda m: m.SerializeToString())
      for name, (req_cls, fn) in methods.items()
  }
  options = [("grpc.max_receive_message_length", max_message_bytes),
             ("grpc.max_send_message_length", max_message_bytes),
             ("grpc.so_reuseport", 0)]
  server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=workers),
                       options=options,
                       interceptors=[TokenInterceptor(token)] if token is not None else None)
  server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(protos.SERVICE_NAME,
                                                                        handlers),))
  bound, health_servicer = start_serving(server, host, port, tls, protos.SERVICE_NAME)
  return server, bound, health_servicer


def start_serving(server: grpc.Server, host: str, port: int, tls, service_name: str):
  """Adds the health service to `server`, binds `host:port` (TLS with `tls` = (chain, key)
  PEM bytes, else plaintext), starts it and marks `service_name` and the server SERVING;
  returns (bound port, health servicer). The env servers and the retriever share it."""
  health_servicer = health.HealthServicer()
  health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
  if tls is not None:
    credentials = grpc.ssl_server_credentials([(tls[1], tls[0])])  # [(key, chain)]
    bound = server.add_secure_port(f"{host}:{port}", credentials)
  else:
    bound = server.add_insecure_port(f"{host}:{port}")
  if bound == 0:
    raise OSError(f"could not bind {host}:{port}; pick another --port (0 = any free port)")
  server.start()
  for service in ("", service_name):
    health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
  return bound, health_servicer


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description="Serve env slots over gRPC (env.proto).")
  parser.add_argument("--env", required=True,
                      help=f"one of {sorted(registry.ENVS)} or a module:Class path")
  parser.add_argument("--port", type=int, default=0, help="0 = any free port (printed)")
  parser.add_argument("--host", default="127.0.0.1",
                      help="bind address; loopback unless you mean to expose the envs")
  parser.add_argument("--slots", type=int, default=32, help="env instances hosted")
  parser.add_argument("--env-arg", action="append", default=[], metavar="KEY=VALUE",
                      help="env constructor keyword argument (JSON value or text)")
  parser.add_argument("--workers", type=int, default=4, help="gRPC handler threads")
  parser.add_argument("--max-message-mb", type=float, default=16.0,
                      help="cap on request and reply size")
  parser.add_argument("--parent-pid", type=int, default=0,
                      help="exit when this process is no longer our parent (0 = off)")
  parser.add_argument("--token-file", default="",
                      help=f"file holding a shared secret every call must carry (else "
                           f"${TOKEN_ENV} if set; none by default)")
  parser.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS")
  parser.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
  parser.add_argument("--step-latency-ms", type=float, default=0.0,
                      help="delay every Step call by this many milliseconds: the latency of a "
                           "remote env (a web shop, a browser, a sandbox) for benchmarks")
  parser.add_argument("--log-level", default="INFO")
  args = parser.parse_args(argv)
  logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                      format="%(asctime)s serve[%(process)d] %(levelname)s %(message)s")
  sys.meta_path.insert(0, _NoJaxFinder())

  try:
    if bool(args.tls_cert) != bool(args.tls_key):
      raise ValueError("--tls-cert and --tls-key go together; pass both or neither")
    tls = None
    if args.tls_cert:
      with open(args.tls_cert, "rb") as cert, open(args.tls_key, "rb") as key:
        tls = (cert.read(), key.read())
    token = read_token(args.token_file)
    core = SlotServer(args.env, args.slots, parse_env_args(args.env_arg),
                      step_latency_s=args.step_latency_ms / 1e3)
    server, port, health_servicer = make_grpc_server(
        core, args.host, args.port, args.workers, int(args.max_message_mb * 2**20),
        token=token, tls=tls)
  except (ValueError, ImportError, OSError) as e:
    print(f"env server: {e}", file=sys.stderr, flush=True)
    return 2

  stop = threading.Event()
  stop_reason = []

  def on_signal(signum, frame):
    del frame
    stop_reason.append(signal.Signals(signum).name)
    stop.set()

  signal.signal(signal.SIGTERM, on_signal)
  signal.signal(signal.SIGINT, on_signal)
  log.info("serving env %r with %d slots on %s:%d (%s, %s)", args.env, args.slots, args.host,
           port, "TLS" if tls else "plaintext", "token" if token else "no token")
  print(f"PORT {port}", flush=True)
  while not stop.wait(0.5):
    if args.parent_pid and os.getppid() != args.parent_pid:
      stop_reason.append(f"parent {args.parent_pid} exited")
      stop.set()
  log.info("stopping (%s)", stop_reason[0] if stop_reason else "?")
  health_servicer.enter_graceful_shutdown()
  server.stop(grace=2.0).wait()
  core.close([])
  return 0


if __name__ == "__main__":
  sys.exit(main())
