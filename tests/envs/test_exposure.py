"""Env servers reached over a network: a shared-secret token on every call and TLS.

The servers run in this process (`serve.make_grpc_server`), the client is the real
`EnvPool`; the TLS certificate is self-signed, made by `openssl` in the test.
"""

import shutil
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc

from env_servers import serve
from env_servers.protos import env_pb2
from env_servers.protos import env_pb2_grpc
from env_servers.sokoban import env as sokoban
from hgpo_jax.envs import launcher
from hgpo_jax.envs import pool as pool_lib

TOKEN = "s3cret-Token"


def _serve(token=None, tls=None):
  core = serve.SlotServer("sokoban", 2)
  server, port, _ = serve.make_grpc_server(core, "127.0.0.1", 0, 2, 2**20, token=token, tls=tls)
  return server, port


def _play(pool):
  first = pool.reset(["train-00000"] * 2, [0, 0], "train")
  # train-00000 is solved by "up right"
  return first[0].observation, [r.won for r in pool.step(["up", "up"])], pool.step(
      ["right", None])[0].won


@pytest.fixture(name="token_server")
def fixture_token_server():
  server, port = _serve(token=TOKEN)
  yield f"127.0.0.1:{port}"
  server.stop(None)


def test_right_token_is_served(token_server):
  with pool_lib.EnvPool([token_server], 2, token=TOKEN) as pool:
    assert pool.describe.env_name == "sokoban"
    _, after_up, won = _play(pool)
    assert after_up == [False, False] and won


@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN.lower()])
def test_missing_or_wrong_token_is_unauthenticated_without_retries(token_server, token):
  with pytest.raises(pool_lib.EnvPoolError, match=(
      rf"env server {token_server}: Describe failed with UNAUTHENTICATED: missing or wrong env "
      r"server token; pass the token the server was started with \(EnvPool\(..., token=...\) "
      r"or --config.env.token_file=FILE\)$")):
    pool_lib.EnvPool([token_server], 2, token=token, max_retries=3)


def test_every_method_and_the_health_check_need_the_token(token_server):
  with grpc.insecure_channel(token_server) as channel:
    stub = env_pb2_grpc.EnvStub(channel)
    calls = [lambda m: stub.Describe(env_pb2.DescribeRequest(), timeout=5, metadata=m),
             lambda m: stub.ListTasks(env_pb2.ListTasksRequest(split="test"), timeout=5,
                                      metadata=m),
             lambda m: stub.Reset(env_pb2.ResetRequest(slots=[0], seeds=[0], split="train"),
                                  timeout=5, metadata=m),
             lambda m: stub.Step(env_pb2.StepRequest(slots=[0], actions=[b"up"]), timeout=5,
                                 metadata=m),
             lambda m: health_pb2_grpc.HealthStub(channel).Check(
                 health_pb2.HealthCheckRequest(), timeout=5, metadata=m)]
    for call in calls:
      with pytest.raises(grpc.RpcError) as e:
        call((("authorization", "Bearer nope"),))
      assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
      call((("authorization", f"Bearer {TOKEN}"),))  # the same call with the token works


def test_token_file_and_environment_variable(tmp_path, monkeypatch):
  monkeypatch.delenv(serve.TOKEN_ENV, raising=False)
  assert serve.read_token("") is None
  path = tmp_path / "token"
  path.write_text(f"  {TOKEN}\n")
  assert serve.read_token(str(path)) == TOKEN
  monkeypatch.setenv(serve.TOKEN_ENV, "from-env")
  assert serve.read_token("") == "from-env"
  path.write_text("\n")
  with pytest.raises(ValueError, match="token file .* is empty; write the shared secret"):
    serve.read_token(str(path))
  with pytest.raises(ValueError, match="local servers bind loopback and take neither"):
    pool_lib.EnvPool(launcher.LocalServers("sokoban"), 2, token=TOKEN)


def test_server_cli_refuses_half_tls_and_empty_token_file(tmp_path):
  empty = tmp_path / "empty"
  empty.write_text("")
  for extra, message in [(["--tls-cert", "c.pem"], "--tls-cert and --tls-key go together"),
                         (["--token-file", str(empty)], "is empty; write the shared secret")]:
    proc = subprocess.run([sys.executable, "-m", "env_servers.serve", "--env", "sokoban", *extra],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.fixture(name="certificate")
def fixture_certificate(tmp_path):
  if shutil.which("openssl") is None:
    pytest.skip("openssl is not installed")
  key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
  subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                  "-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost",
                  "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                 check=True, capture_output=True, timeout=60)
  return cert.read_bytes(), key.read_bytes()


def test_tls_with_a_self_signed_certificate_and_token(certificate):
  cert, key = certificate
  server, port = _serve(token=TOKEN, tls=(cert, key))
  try:
    endpoint = f"localhost:{port}"
    with pool_lib.EnvPool([endpoint], 2, token=TOKEN, tls_root_cert=cert) as pool:
      obs, after_up, won = _play(pool)
      expected, _ = sokoban.SokobanEnv().reset(seed=0, options={"task_id": "train-00000",
                                                                "split": "train"})
      assert obs == expected and after_up == [False, False] and won
    # A plaintext client cannot talk to a TLS server; a client that trusts another CA
    # is refused at the handshake. Both are transport failures: retried, then raised.
    with pytest.raises(pool_lib.EnvPoolError, match="Describe failed 2 times, last with "
                       "UNAVAILABLE"):
      pool_lib.EnvPool([endpoint], 2, token=TOKEN, max_retries=1, backoff_s=0.01, deadline_s=5)
    other_ca = subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout",
         "/dev/null", "-subj", "/CN=localhost"], check=True, capture_output=True,
        timeout=60).stdout
    with pytest.raises(pool_lib.EnvPoolError, match="UNAVAILABLE"):
      pool_lib.EnvPool([endpoint], 2, token=TOKEN, tls_root_cert=other_ca, max_retries=1,
                       backoff_s=0.01, deadline_s=5)
  finally:
    server.stop(None)


def test_trainer_config_passes_token_and_root_certificate(tmp_path, monkeypatch):
  from configs import sokoban as sokoban_config
  from hgpo_jax.training import experiment
  from hgpo_jax.training import run as run_lib
  (tmp_path / "token").write_text(TOKEN + "\n")
  (tmp_path / "ca.pem").write_bytes(b"PEM")
  config = sokoban_config.get_config("smoke")
  config.update_from_flattened_dict({"env.endpoints": ("envhost:50051",),
                                     "env.token_file": str(tmp_path / "token"),
                                     "env.tls_root_cert": str(tmp_path / "ca.pem")})
  seen = {}
  monkeypatch.setattr(run_lib.pool_lib, "EnvPool",
                      lambda servers, n, **kw: seen.update(servers=servers, n=n, **kw))
  run_lib.make_pool(experiment.from_config(config).env, 4)
  assert (seen["servers"], seen["n"], seen["token"], seen["tls_root_cert"]) == (
      ["envhost:50051"], 4, TOKEN, b"PEM")
