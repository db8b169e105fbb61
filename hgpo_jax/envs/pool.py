"""The rollout's view of the environments: a fixed set of slots over env servers.

`EnvPool` spreads `num_slots` slots over one or more env servers (contiguous blocks,
sizes differing by at most one), calls all servers of a batch concurrently (one thread
per server) with a per-call deadline, and hides server failures:

* a call that fails with UNAVAILABLE / DEADLINE_EXCEEDED / FAILED_PRECONDITION
  (server dead, hung, or restarted and lost its slots), or any failure of a server
  process the pool owns that has died, triggers recovery of that server: a server the
  pool started is killed and restarted; an endpoint it does not own is waited for
  with exponential backoff;
* an exception inside an env is not a server failure and is never retried: it raises
  `EnvError` at once, naming the slot, its task and the exception (the server's log
  has the traceback); so does any other status (INVALID_ARGUMENT, ...);
* every unfinished episode of that server is then re-run from its reset and its
  actions replayed (envs are deterministic per (task, seed)); the replayed final
  observation must equal the one the caller saw, else the pool raises;
* the pending call is executed again, so the caller sees neither lost nor duplicated
  steps. Restarts, replays and failed calls are counted in `metrics()`;
* when recovery fails `max_retries` times the call raises `EnvPoolError`; a batch is
  never returned partially;
* a retriever the pool owns (`LocalServers.retriever_corpus`: the search env's passages
  from one `env_servers.retriever` process) that has died is restarted on its port; the
  steps it failed (the env servers report a `RetrieverError` for them) are re-run: their
  servers' unfinished episodes are replayed to before the step, which is then sent again.

Usage:

  with EnvPool(launcher.LocalServers("alfworld", num_servers=2), num_slots=32) as pool:
    tasks = pool.list_tasks("train")
    results = pool.reset(task_ids, seeds, "train")        # one StepResult per slot
    results = pool.step(["go to desk 1", None, ...])      # None: slot skipped

or `EnvPool(["10.0.0.5:50051", "10.0.0.6:50051"], 32)` for servers started elsewhere
(`python -m env_servers.serve --env alfworld --host 0.0.0.0 --port 50051 --slots 16`).
Servers reached over a network should be started with `--token-file` and
`--tls-cert/--tls-key`; the pool then passes `token=` (sent with every call) and
`tls_root_cert=` (PEM of the CA that signed the servers' certificates).

This module does not import JAX: the pool may run in a process of its own.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import statistics
import threading
import time
from typing import Any, Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc

from env_servers import base
from env_servers import protos
from env_servers.protos import env_pb2
from env_servers.protos import env_pb2_grpc
from hgpo_jax.envs import launcher

# Status codes of transport failures and hangs, after which restarting (or waiting for)
# the server and re-running its episodes can fix things. Others (INVALID_ARGUMENT,
# RESOURCE_EXHAUSTED, an env's own exception as INTERNAL, ...) raise at once.
_RECOVERABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.FAILED_PRECONDITION})
# gRPC reports a connection torn down mid-call with these details under UNKNOWN/INTERNAL.
_TRANSPORT_DETAILS = ("Stream removed", "Socket closed", "Connection reset", "RST_STREAM")


class EnvPoolError(RuntimeError):
  """An env server call failed and could not be recovered."""


class EnvError(EnvPoolError):
  """An env raised inside its server (a bug or bad data in the env, not a server failure)."""


@dataclasses.dataclass
class _Episode:
  """What is needed to re-create a slot's state: its reset and the actions since."""
  task_id: str
  seed: int
  split: str
  actions: list[str] = dataclasses.field(default_factory=list)
  last: base.StepResult | None = None


class _Server:
  """One env server: endpoint, stub, the pool slots it hosts, its process if owned."""

  def __init__(self, endpoint: str, slots: range, process: launcher.ServerProcess | None,
               channel_options: list, token: str | None = None,
               tls_root_cert: bytes | None = None):
    self.slots = slots  # pool slot ids; the server's own slot id is `pool slot - slots.start`
    self.process = process
    self._channel_options = channel_options
    self._tls_root_cert = tls_root_cert
    self.metadata = (("authorization", f"Bearer {token}"),) if token else None
    self.connect(endpoint)

  def connect(self, endpoint: str) -> None:
    self.endpoint = endpoint
    if self._tls_root_cert is not None:
      credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_root_cert)
      self.channel = grpc.secure_channel(endpoint, credentials, options=self._channel_options)
    else:
      self.channel = grpc.insecure_channel(endpoint, options=self._channel_options)
    self.stub = env_pb2_grpc.EnvStub(self.channel)
    self.health = health_pb2_grpc.HealthStub(self.channel)

  def call(self, method: str, request, timeout: float):
    """One Env RPC with this server's credentials metadata."""
    return getattr(self.stub, method)(request, timeout=timeout, metadata=self.metadata)

  def close_channel(self) -> None:
    self.channel.close()


def _env_raised(e: grpc.RpcError) -> bool:
  """True when the server marked the failure as the env's own exception."""
  try:
    metadata = e.trailing_metadata() or ()
  except Exception:  # not a call error: no metadata
    return False
  return any(k == protos.ENV_ERROR_METADATA for k, _ in metadata)


def _from_proto(r: env_pb2.SlotResult) -> base.StepResult:
  return base.StepResult(observation=r.observation, anchor_obs=r.anchor_obs,
                         admissible_actions=list(r.admissible_actions), reward=r.reward,
                         done=r.done, won=r.won, info=dict(r.info))


class EnvPool:
  """`num_slots` env slots over one or more env servers (see the module docstring).

  Args:
    servers: `launcher.LocalServers(...)` to start (and own) local server processes,
      or a list of `host:port` endpoints of running servers.
    num_slots: slots the rollout uses (G tasks x N trajectories).
    deadline_s: deadline of every gRPC call (a hung server is detected after it).
    max_retries: recovery attempts per call before `EnvPoolError`.
    backoff_s: first wait before re-trying an endpoint the pool does not own (doubles).
    max_message_mb: gRPC message-size cap, the same as the servers' default.
    token: shared secret of endpoint servers started with `--token-file` (sent as
      `authorization: Bearer <token>` metadata with every call).
    tls_root_cert: PEM root certificate(s) to verify endpoint servers started with
      `--tls-cert/--tls-key`; None: plaintext.
  """

  def __init__(self, servers: launcher.LocalServers | Sequence[str], num_slots: int, *,
               deadline_s: float = 120.0, max_retries: int = 3, backoff_s: float = 0.5,
               max_message_mb: float = 16.0, token: str | None = None,
               tls_root_cert: bytes | None = None):
    if num_slots < 1:
      raise ValueError(f"num_slots must be >= 1, got {num_slots}")
    self.num_slots = num_slots
    self.deadline_s, self.max_retries, self.backoff_s = deadline_s, max_retries, backoff_s
    if isinstance(servers, str):
      raise TypeError(f"servers={servers!r}: pass a list of endpoints, e.g. [{servers!r}] "
                        f"(command line: --config.env.endpoints=\"('{servers}',)\")")
    self._local = servers if isinstance(servers, launcher.LocalServers) else None
    if self._local and (token or tls_root_cert):
      raise ValueError("token/tls_root_cert apply to endpoints started elsewhere; local "
                       "servers bind loopback and take neither (command line: --config.env.token_file and "
                       "--config.env.tls_root_cert need --config.env.endpoints)")
    n = self._local.num_servers if self._local else len(servers)
    if n < 1 or n > num_slots:
      raise ValueError(f"need 1..num_slots ({num_slots}) env servers, got {n}")
    sizes = [num_slots // n + (i < num_slots % n) for i in range(n)]
    starts = [sum(sizes[:i]) for i in range(n)]
    options = [("grpc.max_receive_message_length", int(max_message_mb * 2**20)),
               ("grpc.max_send_message_length", int(max_message_mb * 2**20))]
    self._lock = threading.Lock()
    self._counters = collections.Counter()
    self._latency_ms: dict[str, collections.deque] = collections.defaultdict(
        lambda: collections.deque(maxlen=1000))
    self._episodes: list[_Episode | None] = [None] * num_slots
    self._servers: list[_Server] = []
    self._retriever: launcher.ServerProcess | None = None
    self._closed = False
    try:
      if self._local and self._local.retriever_corpus:
        self._retriever = launcher.start_retriever(
            self._local.retriever_corpus, self._local.host, self._local.startup_timeout_s,
            self._local.log_level, dense_model=self._local.retriever_model)
        self._local = dataclasses.replace(
            self._local, env_args={**self._local.env_args, "retriever": self._retriever.endpoint})
      if self._local:
        procs = launcher.start_servers(self._local.env, sizes, self._local.env_args,
                                       self._local.host, self._local.startup_timeout_s,
                                       self._local.log_level, self._local.step_latency_ms)
        for proc, start, size in zip(procs, starts, sizes):
          self._servers.append(_Server(proc.endpoint, range(start, start + size), proc, options))
      else:
        for endpoint, start, size in zip(servers, starts, sizes):
          self._servers.append(_Server(endpoint, range(start, start + size), None, options,
                                       token, tls_root_cert))
      self._executor = concurrent.futures.ThreadPoolExecutor(
          max_workers=len(self._servers), thread_name_prefix="envpool")
      self.describe = self._check_servers()
    except BaseException:
      self.close()
      raise

  # ---------------------------------------------------------------- public API

  def reset(self, task_ids: Sequence[str], seeds: Sequence[int],
            split: str) -> list[base.StepResult]:
    """Starts an episode in every slot: `task_ids[i]` with env seed `seeds[i]`."""
    if len(task_ids) != self.num_slots or len(seeds) != self.num_slots:
      raise ValueError(f"reset needs {self.num_slots} task ids and seeds (one per slot), got "
                       f"{len(task_ids)} and {len(seeds)}")
    episodes = [_Episode(str(t), int(s), split) for t, s in zip(task_ids, seeds)]

    def call(server: _Server) -> list[base.StepResult]:
      request = env_pb2.ResetRequest(
          slots=[g - server.slots.start for g in server.slots],
          task_ids=[episodes[g].task_id for g in server.slots],
          seeds=[episodes[g].seed for g in server.slots], split=split)
      reply = self._call(server, "Reset", request, replay=False)
      return [_from_proto(r) for r in reply.results]

    results = self._map(call, self._servers)
    flat = [r for rs in results for r in rs]
    for episode, result in zip(episodes, flat):
      episode.last = result
    self._episodes = episodes
    self._raise_env_errors({g: r for g, r in enumerate(flat)}, "reset")
    return flat

  def step(self, actions: Sequence[str | None]) -> list[base.StepResult | None]:
    """Steps every slot whose action is not None; returns None for the skipped slots."""
    if len(actions) != self.num_slots:
      raise ValueError(f"step needs {self.num_slots} actions (None = skip slot), got "
                       f"{len(actions)}")
    for g, action in enumerate(actions):
      if action is None:
        continue
      episode = self._episodes[g]
      if episode is None or episode.last.done:
        why = "episode is over" if episode else "never reset (or the last step call failed)"
        raise ValueError(f"slot {g}: {why}; pass None for it or reset the pool")
    busy = [s for s in self._servers if any(actions[g] is not None for g in s.slots)]

    def call(server: _Server) -> list[tuple[int, base.StepResult]]:
      active = [g for g in server.slots if actions[g] is not None]
      request = env_pb2.StepRequest(slots=[g - server.slots.start for g in active],
                                    actions=[actions[g].encode("utf-8") for g in active])
      reply = self._call(server, "Step", request, replay=True)
      return [(g, _from_proto(r)) for g, r in zip(active, reply.results)]

    try:
      replies = self._map(call, busy)
      if self._retriever is not None and not self._retriever.alive():
        replies = [self._step_again(server, pairs, call)
                   for server, pairs in zip(busy, replies)]
    except BaseException:
      # Other servers may have stepped: the episodes are no longer consistent.
      self._episodes = [None] * self.num_slots
      raise
    out: list[base.StepResult | None] = [None] * self.num_slots
    for pairs in replies:
      for g, result in pairs:
        episode = self._episodes[g]
        episode.actions.append(actions[g])
        episode.last = result
        out[g] = result
    self._raise_env_errors({g: r for g, r in enumerate(out) if r is not None}, "step")
    return out

  def list_tasks(self, split: str) -> list[str]:
    """Task ids of `split` as the (first) server reports them."""
    return list(self._call(self._servers[0], "ListTasks",
                           env_pb2.ListTasksRequest(split=split), replay=False).task_ids)

  def metrics(self) -> dict[str, float]:
    """Counters (calls, failed_calls, restarts, replayed_episodes, replayed_steps,
    env_errors) and call latency statistics in milliseconds per method."""
    with self._lock:
      out: dict[str, float] = {k: float(v) for k, v in self._counters.items()}
      for key in ("calls", "failed_calls", "restarts", "replayed_episodes", "replayed_steps",
                  "env_errors"):
        out.setdefault(key, 0.0)
      for method, values in self._latency_ms.items():
        if values:
          out[f"{method.lower()}_latency_ms_mean"] = statistics.fmean(values)
          out[f"{method.lower()}_latency_ms_p50"] = statistics.median(values)
          out[f"{method.lower()}_latency_ms_max"] = max(values)
    return out

  @property
  def endpoints(self) -> list[str]:
    return [s.endpoint for s in self._servers]

  @property
  def server_pids(self) -> list[int]:
    """Pids of the server processes the pool owns (empty for endpoints)."""
    return [s.process.pid for s in self._servers if s.process is not None]

  @property
  def retriever_pid(self) -> int | None:
    """Pid of the retriever process the pool owns (None: it owns none)."""
    return self._retriever.pid if self._retriever is not None else None

  def close(self) -> None:
    """Releases the slots, closes channels and stops owned servers (idempotent)."""
    if self._closed:
      return
    self._closed = True
    for server in self._servers:
      try:
        server.call("Close", env_pb2.CloseRequest(), 2.0)
      except grpc.RpcError:
        pass  # best effort: the server may be gone already
      server.close_channel()
      if server.process is not None:
        server.process.stop()
    if self._retriever is not None:
      self._retriever.stop()
    if hasattr(self, "_executor"):
      self._executor.shutdown(wait=False)

  def __enter__(self) -> "EnvPool":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # ---------------------------------------------------------------- internals

  def _raise_env_errors(self, results: dict[int, base.StepResult], what: str) -> None:
    """Raises `EnvError` for the first slot whose env raised (all of them are counted)."""
    failed = [g for g, r in results.items() if base.ERROR in r.info]
    if not failed:
      return
    self._count("env_errors", len(failed))
    g = failed[0]
    e = self._episodes[g]
    others = f" (and {len(failed) - 1} more slots)" if len(failed) > 1 else ""
    where = {"step": f"step {len(e.actions)} (action {e.actions[-1][:80]!r})" if e.actions
                     else "step", "reset": "reset"}.get(what, f"the {what} after a server failure")
    raise EnvError(
        f"slot {g}{others}: the env raised in {where} of task {e.task_id!r} (split "
        f"{e.split!r}, seed {e.seed}): {results[g].info[base.ERROR]}; fix the env (the "
        "server log has the traceback)")

  def _recoverable(self, server: _Server, e: grpc.RpcError) -> bool:
    """Transport failures and hangs are; an env's exception and bad requests are not."""
    if _env_raised(e):
      return False
    if e.code() in _RECOVERABLE:
      return True
    if server.process is not None and not server.process.alive():
      return True  # the owned process died, whatever status the broken call got
    return (e.code() in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL,
                         grpc.StatusCode.CANCELLED)
            and any(d in (e.details() or "") for d in _TRANSPORT_DETAILS))

  def _count(self, key: str, n: int = 1) -> None:
    with self._lock:
      self._counters[key] += n

  def _map(self, fn: Callable[[_Server], Any], servers: Sequence[_Server]) -> list[Any]:
    """fn over servers concurrently; all finish before the first error is raised."""
    if self._closed:
      raise EnvPoolError("the env pool is closed; create a new EnvPool")
    if len(servers) == 1:
      return [fn(servers[0])]
    futures = [self._executor.submit(fn, s) for s in servers]
    concurrent.futures.wait(futures)
    return [f.result() for f in futures]

  def _check_servers(self) -> env_pb2.DescribeReply:
    replies = [self._call(s, "Describe", env_pb2.DescribeRequest(), replay=False)
               for s in self._servers]
    for server, reply in zip(self._servers, replies):
      if reply.protocol_version.split(".")[0] != protos.PROTOCOL_VERSION.split(".")[0]:
        raise EnvPoolError(f"env server {server.endpoint} speaks protocol "
                           f"{reply.protocol_version}, this client {protos.PROTOCOL_VERSION}; "
                           "run both from the same hgpo_jax version")
      if reply.num_slots < len(server.slots):
        raise EnvPoolError(f"env server {server.endpoint} has {reply.num_slots} slots but the "
                           f"pool puts {len(server.slots)} on it; start it with --slots "
                           f"{len(server.slots)} or add servers")
      if reply.env_name != replies[0].env_name:
        raise EnvPoolError(f"env servers host different envs ({replies[0].env_name!r} at "
                           f"{self._servers[0].endpoint}, {reply.env_name!r} at "
                           f"{server.endpoint}); one pool serves one env")
    return replies[0]

  def _call(self, server: _Server, method: str, request, replay: bool):
    """One RPC with recovery: restart/wait, replay unfinished episodes, call again."""
    start = time.perf_counter()
    error = None
    for attempt in range(self.max_retries + 1):
      try:
        if attempt:
          self._recover(server, attempt, replay)
        self._count("calls")
        reply = server.call(method, request, self.deadline_s)
        with self._lock:
          self._latency_ms[method].append(1e3 * (time.perf_counter() - start))
        return reply
      except grpc.RpcError as e:
        self._count("failed_calls")
        if not self._recoverable(server, e):
          if _env_raised(e):
            raise EnvError(f"env server {server.endpoint}: {e.details()}; fix the env (the "
                           "server log has the traceback)") from None
          raise EnvPoolError(f"env server {server.endpoint}: {method} failed with "
                             f"{e.code().name}: {e.details()}") from None
        error = e
    raise EnvPoolError(
        f"env server {server.endpoint}: {method} failed {self.max_retries + 1} times, last "
        f"with {error.code().name}: {error.details()}; check that the server is running "
        "(for endpoints you start yourself) or raise deadline_s if it is just slow") from None

  def _restart_retriever(self) -> None:
    """Starts the owned retriever again on its port (the env servers keep its endpoint)."""
    dead, local = self._retriever, self._local
    dead.kill()
    try:
      self._retriever = launcher.start_retriever(local.retriever_corpus, local.host,
                                                 local.startup_timeout_s, local.log_level,
                                                 port=dead.port, dense_model=local.retriever_model)
    except RuntimeError as e:
      raise EnvPoolError(f"restarting the dead retriever failed: {e}") from None
    self._count("restarts")

  def _step_again(self, server: _Server, pairs: list[tuple[int, base.StepResult]],
                  call: Callable[[_Server], list[tuple[int, base.StepResult]]]
                  ) -> list[tuple[int, base.StepResult]]:
    """`server`'s step results, taken again after a restart of the dead retriever when the
    env raised in one of its slots: its unfinished episodes replayed to before the step
    (`_replay`; the step's results are not yet recorded), then the step sent again."""
    if not any(base.ERROR in r.info for _, r in pairs):
      return pairs
    if not self._retriever.alive():
      self._restart_retriever()
    self._replay(server)
    return call(server)

  def _recover(self, server: _Server, attempt: int, replay: bool) -> None:
    """Makes `server` usable again (restart or wait), then replays its episodes."""
    if self._retriever is not None and not self._retriever.alive():
      self._restart_retriever()  # the replay below searches again
    if server.process is not None:
      server.process.kill()
      server.close_channel()
      local = self._local
      try:
        server.process = launcher.start_servers(local.env, [len(server.slots)], local.env_args,
                                                local.host, local.startup_timeout_s,
                                                local.log_level, local.step_latency_ms)[0]
      except RuntimeError as e:
        raise EnvPoolError(f"restarting a dead env server failed: {e}") from None
      server.connect(server.process.endpoint)
      self._count("restarts")
    else:
      time.sleep(self.backoff_s * 2**(attempt - 1))
      server.health.Check(health_pb2.HealthCheckRequest(), timeout=self.deadline_s,
                          metadata=server.metadata)
    if replay:
      self._replay(server)

  def _replay(self, server: _Server) -> None:
    """Re-runs every unfinished episode of `server` up to where the caller saw it."""
    live = [g for g in server.slots
            if self._episodes[g] is not None and not self._episodes[g].last.done]
    if not live:
      return
    by_split = collections.defaultdict(list)
    for g in live:
      by_split[self._episodes[g].split].append(g)
    last = {g: None for g in live}
    for split, slots in by_split.items():
      request = env_pb2.ResetRequest(slots=[g - server.slots.start for g in slots],
                                     task_ids=[self._episodes[g].task_id for g in slots],
                                     seeds=[self._episodes[g].seed for g in slots], split=split)
      for g, r in zip(slots, server.call("Reset", request, self.deadline_s).results):
        last[g] = r
    for t in range(max(len(self._episodes[g].actions) for g in live)):
      slots = [g for g in live if len(self._episodes[g].actions) > t]
      request = env_pb2.StepRequest(
          slots=[g - server.slots.start for g in slots],
          actions=[self._episodes[g].actions[t].encode("utf-8") for g in slots])
      for g, r in zip(slots, server.call("Step", request, self.deadline_s).results):
        last[g] = r
    self._raise_env_errors({g: _from_proto(last[g]) for g in live}, "replay")
    for g in live:
      seen, replayed = self._episodes[g].last, _from_proto(last[g])
      if (replayed.observation, replayed.reward, replayed.done) != (seen.observation, seen.reward,
                                                                   seen.done):
        raise EnvPoolError(
            f"slot {g}: replaying task {self._episodes[g].task_id!r} after a server failure "
            "gave a different observation than the original run; the env is not "
            "deterministic per (task, seed), so its episodes cannot be recovered")
    self._count("replayed_episodes", len(live))
    self._count("replayed_steps", sum(len(self._episodes[g].actions) for g in live))
