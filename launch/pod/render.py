r"""Renders what each host of a pod runs: TPU VM / SLURM commands and Kubernetes manifests.

  # Per-host trainer commands (what tpu_pod.sh / slurm_gpu.sbatch run; DRY_RUN=1 prints them):
  python -m launch.pod.render commands --hosts 10.0.0.2,10.0.0.3 \
      --config configs/alfworld.py:algo=hgpo,k=2,model=qwen2.5-1.5b --workdir gs://b/run \
      [--env-endpoints envhost1:50051,envhost2:50051] [--token-file /etc/hgpo/token] \
      [--port 8476] [-- --config.mesh.fsdp=4 ...]
  # One host's command, executed in place (the templates' real path):
  python -m launch.pod.render commands ... --process-id 1 --exec
  # Kubernetes: trainer Indexed Job + env-server StatefulSet/Service + token Secret:
  python -m launch.pod.render k8s --num-hosts 2 --env-servers 4 --accelerator tpu-v5e-8 \
      --config ... --workdir ... --out launch/pod/k8s/

Every host runs `launch.main --distributed=explicit` with the same coordinator (host 0),
the host count and its own process id, so the rendered text is exactly what runs (no
auto-detection in between). Env endpoints are dealt round-robin: host i gets endpoints
i, i + H, ... (every host gets all of them when there are fewer endpoints than hosts).
The env servers' shared secret (env_servers/serve.py `--token-file`) is passed to the
trainer as `--config.env.token_file`.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from typing import Optional, Sequence

DEFAULT_PORT = 8476  # JAX's default coordinator port on Cloud TPU
ENV_PORT = 50051
TOKEN_MOUNT = "/etc/hgpo-env-token"

# GKE accelerators: node selectors, chips per host, resource names, and the `make venv
# ACCEL=...` target the trainer pod installs JAX for.
ACCELERATORS = {
    "tpu-v5e-8": dict(resource="google.com/tpu", count=8, accel="tpu", selectors={
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5-lite-podslice",
        "cloud.google.com/gke-tpu-topology": "2x4"}),
    "tpu-v5p-8": dict(resource="google.com/tpu", count=4, accel="tpu", selectors={
        "cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
        "cloud.google.com/gke-tpu-topology": "2x2x1"}),
    "h100-8": dict(resource="nvidia.com/gpu", count=8, accel="cuda12", selectors={
        "cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}),
}


def endpoints_for(process_id: int, num_hosts: int, endpoints: Sequence[str]) -> list[str]:
  """Host `process_id`'s share of the env fleet (round-robin; all if fewer than hosts)."""
  if len(endpoints) < num_hosts:
    return list(endpoints)
  return list(endpoints[process_id::num_hosts])


def host_command(*, process_id: int, hosts: Sequence[str], port: int, config: str, workdir: str,
                 endpoints: Sequence[str] = (), token_file: str = "", extra: Sequence[str] = (),
                 python: str = ".venv/bin/python") -> list[str]:
  """argv of the trainer on host `process_id` of `hosts` (host 0 is the coordinator)."""
  if not hosts:
    raise ValueError("no hosts: give --hosts ADDR0,ADDR1,... (host 0 is the coordinator)")
  if not 0 <= process_id < len(hosts):
    raise ValueError(f"process id {process_id} is outside 0..{len(hosts) - 1} for {len(hosts)} hosts")
  argv = [python, "-m", "launch.main", "--distributed=explicit",
          f"--coordinator_address={hosts[0]}:{port}", f"--num_processes={len(hosts)}",
          f"--process_id={process_id}", f"--config={config}", f"--workdir={workdir}"]
  mine = endpoints_for(process_id, len(hosts), endpoints)
  if mine:
    argv.append("--config.env.endpoints=(" + "".join(f"'{e}'," for e in mine) + ")")
  if token_file:
    argv.append(f"--config.env.token_file={token_file}")
  return argv + list(extra)


def render_commands(**kw) -> str:
  """`# host i` header + the shell-quoted command of every host."""
  hosts = kw["hosts"]
  lines = []
  for i in range(len(hosts)):
    lines.append(f"# host {i} ({hosts[i]}): process {i} of {len(hosts)}")
    lines.append(shlex.join(host_command(process_id=i, **kw)))
  return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------
# Kubernetes
# ---------------------------------------------------------------------------------------

def _env_server_set(env_name: str, image: str, env: str, env_servers: int, env_slots: int,
                    token_file: str, labels: dict, token_mount: dict, token_volume: dict) -> dict:
  """The env servers' StatefulSet: `env_servers` pods of `env_servers.serve` with the token."""
  return {
      "apiVersion": "apps/v1", "kind": "StatefulSet",
      "metadata": {"name": env_name, "labels": labels},
      "spec": {
          "serviceName": env_name, "replicas": env_servers, "podManagementPolicy": "Parallel",
          "selector": {"matchLabels": labels},
          "template": {
              "metadata": {"labels": labels},
              "spec": {
                  "containers": [{
                      "name": "env-server", "image": image,
                      "command": ["python", "-m", "env_servers.serve", "--env", env, "--host", "0.0.0.0",
                                  "--port", str(ENV_PORT), "--slots", str(env_slots),
                                  "--token-file", token_file],
                      "ports": [{"name": "grpc", "containerPort": ENV_PORT}],
                      # TCP, not the gRPC health probe: health checks need the token too.
                      "readinessProbe": {"tcpSocket": {"port": ENV_PORT}, "periodSeconds": 10},
                      "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
                      "volumeMounts": [token_mount]}],
                  "volumes": [token_volume]}}}}


def _trainer_job(trainer: str, image: str, num_hosts: int, acc: dict, shell: str, port: int,
                 labels: dict, token_mount: dict, token_volume: dict) -> dict:
  """The trainer's Indexed Job: one pod per host on the accelerator's nodes, running `shell`."""
  return {
      "apiVersion": "batch/v1", "kind": "Job",
      "metadata": {"name": trainer, "labels": labels},
      "spec": {
          "completionMode": "Indexed", "completions": num_hosts, "parallelism": num_hosts,
          "backoffLimit": 0,
          "template": {
              "metadata": {"labels": labels},
              "spec": {
                  "subdomain": trainer, "restartPolicy": "Never",
                  "nodeSelector": dict(acc["selectors"]),
                  "containers": [{
                      "name": "trainer", "image": image,
                      "command": ["bash", "-c", shell],
                      "ports": [{"name": "coordinator", "containerPort": port}],
                      "resources": {"limits": {acc["resource"]: acc["count"]},
                                    "requests": {acc["resource"]: acc["count"]}},
                      "volumeMounts": [token_mount]}],
                  "volumes": [token_volume]}}}}


def k8s_manifests(*, name: str, image: str, num_hosts: int, env_servers: int, env: str,
                  env_slots: int, accelerator: str, config: str, workdir: str,
                  extra: Sequence[str] = (), token: Optional[str] = None,
                  port: int = DEFAULT_PORT) -> list[dict]:
  """Secret (env token), env-server headless Service + StatefulSet, trainer headless
  Service + Indexed Job. A StatefulSet (not a Deployment) gives every env server a
  stable DNS name `<name>-env-<i>.<name>-env`, which the trainer needs because it keeps
  one connection (and its episodes' state) per server."""
  if accelerator not in ACCELERATORS:
    raise ValueError(f"unknown accelerator {accelerator!r}; choose one of {sorted(ACCELERATORS)}")
  if num_hosts < 1 or env_servers < 1:
    raise ValueError("--num-hosts and --env-servers must be >= 1")
  acc = ACCELERATORS[accelerator]
  env_name, trainer = f"{name}-env", f"{name}-trainer"
  secret = f"{name}-env-token"
  labels = lambda role: {"app": name, "role": role}
  token_volume = {"name": "env-token", "secret": {"secretName": secret, "defaultMode": 0o400}}
  token_mount = {"name": "env-token", "mountPath": TOKEN_MOUNT, "readOnly": True}
  token_file = f"{TOKEN_MOUNT}/token"
  endpoints = [f"{env_name}-{i}.{env_name}:{ENV_PORT}" for i in range(env_servers)]

  secret_doc = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": secret, "labels": labels("env")},
                "type": "Opaque",
                "stringData": {"token": token if token is not None else "REPLACE-WITH-A-LONG-RANDOM-SECRET"}}
  env_service = {
      "apiVersion": "v1", "kind": "Service",
      "metadata": {"name": env_name, "labels": labels("env")},
      "spec": {"clusterIP": "None", "selector": labels("env"),
               "ports": [{"name": "grpc", "port": ENV_PORT, "targetPort": ENV_PORT}]}}
  env_set = _env_server_set(env_name, image, env, env_servers, env_slots, token_file,
                            labels("env"), token_mount, token_volume)
  trainer_service = {
      "apiVersion": "v1", "kind": "Service",
      "metadata": {"name": trainer, "labels": labels("trainer")},
      # Not-ready pods resolve too: every process dials host 0 while it starts up.
      "spec": {"clusterIP": "None", "selector": labels("trainer"), "publishNotReadyAddresses": True,
               "ports": [{"name": "coordinator", "port": port, "targetPort": port}]}}
  # Process id = the Indexed Job's completion index; host i is reachable as
  # <job>-<i>.<service> because the pods' subdomain is the headless trainer Service. The
  # pod runs this renderer with --exec, so its command is exactly `render_commands`'s. It
  # first builds the venv for the accelerator (`make venv ACCEL=tpu|cuda12`, in the image's
  # checkout of the repository: a no-op when the image was built with the same command), so
  # JAX runs on the chips, not on the pod's CPUs (launch.main refuses a CPU run of a pod).
  hosts = [f"{trainer}-{i}.{trainer}" for i in range(num_hosts)]
  python = ".venv/bin/python"
  argv = [python, "-m", "launch.pod.render", "commands", "--hosts", ",".join(hosts),
          "--port", str(port), "--process-id", "${JOB_COMPLETION_INDEX}", "--exec",
          "--python", python, "--config", config, "--workdir", workdir,
          "--env-endpoints", ",".join(endpoints), "--token-file", token_file]
  if extra:
    argv += ["--"] + list(extra)
  shell = f"make venv ACCEL={acc['accel']} && exec " + " ".join(a if a == "${JOB_COMPLETION_INDEX}" else shlex.quote(a) for a in argv)
  job = _trainer_job(trainer, image, num_hosts, acc, shell, port, labels("trainer"),
                     token_mount, token_volume)
  return [secret_doc, env_service, env_set, trainer_service, job]


def _yaml(docs: list[dict]) -> str:
  import yaml
  return "---\n".join(yaml.safe_dump(d, sort_keys=False, width=1000) for d in docs)


def main(argv: Optional[Sequence[str]] = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  extra: list[str] = []
  if "--" in argv:
    i = argv.index("--")
    argv, extra = argv[:i], argv[i + 1:]
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = ap.add_subparsers(dest="what", required=True)
  c = sub.add_parser("commands", help="per-host trainer commands (TPU VM, SLURM)")
  c.add_argument("--hosts", required=True, help="comma-separated host addresses; host 0 coordinates")
  c.add_argument("--port", type=int, default=DEFAULT_PORT, help="coordinator port on host 0")
  c.add_argument("--process-id", type=int, default=None, help="only this host's command")
  c.add_argument("--exec", action="store_true", help="execute --process-id's command in place")
  c.add_argument("--python", default=".venv/bin/python")
  k = sub.add_parser("k8s", help="Kubernetes manifests (YAML)")
  k.add_argument("--name", default="hgpo")
  k.add_argument("--image", default="ghcr.io/OWNER/hgpo_jax:latest")
  k.add_argument("--num-hosts", type=int, default=1, help="trainer pods (one per TPU/GPU host)")
  k.add_argument("--env-servers", type=int, default=4)
  k.add_argument("--env", default="alfworld")
  k.add_argument("--env-slots", type=int, default=32)
  k.add_argument("--accelerator", default="tpu-v5e-8", choices=sorted(ACCELERATORS))
  k.add_argument("--token", default=None, help="secret value (default: a placeholder to replace)")
  k.add_argument("--out", default="", help="directory: one file per manifest (default: stdout)")
  for p in (c, k):
    p.add_argument("--config", required=True)
    p.add_argument("--workdir", required=True)
  c.add_argument("--env-endpoints", default="", help="comma-separated host:port of env servers")
  c.add_argument("--token-file", default="", help="env servers' shared-secret file on every host")
  args = ap.parse_args(argv)
  if args.what == "commands":
    hosts = [h for h in args.hosts.split(",") if h]
    kw = dict(hosts=hosts, port=args.port, config=args.config, workdir=args.workdir,
              endpoints=[e for e in args.env_endpoints.split(",") if e],
              token_file=args.token_file, extra=extra, python=args.python)
    if args.process_id is None:
      if args.exec:
        ap.error("--exec needs --process-id")
      sys.stdout.write(render_commands(**kw))
      return 0
    cmd = host_command(process_id=args.process_id, **kw)
    if args.exec:
      sys.stdout.flush()
      os.execvp(cmd[0], cmd)
    print(shlex.join(cmd))
    return 0
  docs = k8s_manifests(name=args.name, image=args.image, num_hosts=args.num_hosts,
                       env_servers=args.env_servers, env=args.env, env_slots=args.env_slots,
                       accelerator=args.accelerator, config=args.config, workdir=args.workdir,
                       extra=extra, token=args.token)
  if not args.out:
    sys.stdout.write(_yaml(docs))
    return 0
  os.makedirs(args.out, exist_ok=True)
  for doc in docs:
    path = os.path.join(args.out, f"{doc['metadata']['name']}-{doc['kind'].lower()}.yaml")
    with open(path, "w") as f:
      f.write(_yaml([doc]))
    print(path)
  return 0


if __name__ == "__main__":
  sys.exit(main())
