"""Pod launch paths: per-host commands (TPU VM / SLURM dry runs) and Kubernetes manifests."""

import os
import shlex
import subprocess
import sys

import pytest
import yaml

from launch.pod import render

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = "configs/alfworld.py:algo=hgpo,k=2,model=qwen2.5-1.5b"
# The committed manifests in launch/pod/k8s/ are this call's output (docs/scaling.md,
# "Launch paths").
K8S_ARGS = ["k8s", "--num-hosts", "1", "--env-servers", "4", "--accelerator", "tpu-v5e-8",
            "--config", CONFIG, "--workdir", "gs://BUCKET/hgpo_k2", "--",
            "--config.model.path=/models/Qwen2.5-1.5B-Instruct", "--config.mesh.data=2",
            "--config.mesh.fsdp=4", "--config.mesh.tensor=1",
            "--config.train.micro_batch_rows=16", "--config.rollout.prefill_chunk_rows=16"]


def _flags(argv):
  return dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def test_host_commands_carry_process_id_coordinator_and_endpoint_share():
  hosts = ["10.0.0.2", "10.0.0.3", "10.0.0.4"]
  endpoints = [f"env{i}:50051" for i in range(7)]
  for i in range(3):
    argv = render.host_command(process_id=i, hosts=hosts, port=1234, config=CONFIG, workdir="/w",
                               endpoints=endpoints, token_file="/t", extra=["--config.mesh.fsdp=4"])
    f = _flags(argv)
    assert argv[:4] == [".venv/bin/python", "-m", "launch.main", "--distributed=explicit"]
    assert f["coordinator_address"] == "10.0.0.2:1234"
    assert f["num_processes"] == "3" and f["process_id"] == str(i)
    assert f["config.env.token_file"] == "/t" and argv[-1] == "--config.mesh.fsdp=4"
    # Round-robin: host i gets endpoints i, i+3, i+6.
    assert eval(f["config.env.endpoints"]) == tuple(endpoints[i::3])  # noqa: S307 (literal)
  # Fewer endpoints than hosts: everyone shares all of them.
  assert render.endpoints_for(2, 3, ["a:1", "b:2"]) == ["a:1", "b:2"]
  with pytest.raises(ValueError, match="outside 0..2"):
    render.host_command(process_id=3, hosts=hosts, port=1, config=CONFIG, workdir="/w")


def _run(cmd, env=None):
  full = dict(os.environ, **(env or {}))
  return subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


def _commands(text):
  """{process id: argv} from a dry run's output."""
  lines = text.strip().splitlines()
  assert [l.startswith("# host ") for l in lines] == [i % 2 == 0 for i in range(len(lines))]
  return {i: shlex.split(lines[2 * i + 1]) for i in range(len(lines) // 2)}


@pytest.mark.parametrize("script", ["launch/pod/tpu_pod.sh", "launch/pod/slurm_gpu.sbatch"])
def test_template_dry_run_renders_each_hosts_exact_command(script):
  env = dict(DRY_RUN="1", HOSTS="h0,h1", TPU="t", ZONE="z", ENV_ENDPOINTS="e0:1,e1:1,e2:1,e3:1",
             TOKEN_FILE="/etc/tok", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
  out = _run(["bash", script, CONFIG, "/runs/x", "--config.mesh.fsdp=4"], env)
  assert out.returncode == 0, out.stderr
  cmds = _commands(out.stdout)
  assert set(cmds) == {0, 1}
  for i, argv in cmds.items():
    expected = render.host_command(process_id=i, hosts=["h0", "h1"], port=8476, config=CONFIG,
                                   workdir="/runs/x", endpoints=["e0:1", "e1:1", "e2:1", "e3:1"],
                                   token_file="/etc/tok", extra=["--config.mesh.fsdp=4"])
    assert argv == expected


def test_exec_runs_exactly_the_rendered_command(monkeypatch):
  seen = []
  monkeypatch.setattr(render.os, "execvp", lambda prog, argv: seen.append(argv))
  render.main(["commands", "--hosts", "a,b", "--process-id", "1", "--exec", "--config", CONFIG,
               "--workdir", "/w", "--", "--config.seed=3"])
  assert seen == [render.host_command(process_id=1, hosts=["a", "b"], port=8476, config=CONFIG,
                                      workdir="/w", extra=["--config.seed=3"])]
  with pytest.raises(SystemExit):
    render.main(["commands", "--hosts", "a", "--exec", "--config", CONFIG, "--workdir", "/w"])


def _docs():
  kw = dict(name="hgpo", image="ghcr.io/OWNER/hgpo_jax:latest", num_hosts=2, env_servers=4,
            env="alfworld", env_slots=32, accelerator="tpu-v5e-8", config=CONFIG,
            workdir="gs://BUCKET/hgpo_k2", extra=K8S_ARGS[K8S_ARGS.index("--") + 1:])
  return render.k8s_manifests(**kw)


def test_k8s_manifests_are_structurally_complete():
  docs = _docs()
  kinds = {d["kind"]: d for d in docs}
  assert sorted(kinds) == ["Job", "Secret", "Service", "StatefulSet"] and len(docs) == 5
  for d in docs:
    assert d["apiVersion"] and d["metadata"]["name"]
  secret = kinds["Secret"]
  job = next(d for d in docs if d["kind"] == "Job")
  env = next(d for d in docs if d["kind"] == "StatefulSet")
  services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
  # Trainer: an Indexed Job, one pod per host, addressed through its headless Service.
  spec = job["spec"]
  assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
  pod = spec["template"]["spec"]
  assert services[pod["subdomain"]]["spec"]["clusterIP"] == "None"
  container = pod["containers"][0]
  assert container["resources"]["limits"] == {"google.com/tpu": 8}
  # Env fleet: headless Service over the StatefulSet's pods; both mount the token Secret.
  assert services[env["spec"]["serviceName"]]["spec"]["selector"] == env["spec"]["selector"]["matchLabels"]
  for workload in (job, env):
    vols = workload["spec"]["template"]["spec"]["volumes"]
    assert vols[0]["secret"]["secretName"] == secret["metadata"]["name"]
  serve = env["spec"]["template"]["spec"]["containers"][0]["command"]
  assert serve[serve.index("--token-file") + 1] == f"{render.TOKEN_MOUNT}/token"
  assert env["spec"]["replicas"] == 4


def test_k8s_trainer_pod_command_renders_the_host_command(monkeypatch):
  """The trainer container runs the renderer with --exec: with JOB_COMPLETION_INDEX=i it
  executes host i's command, endpoints dealt over the StatefulSet's stable names."""
  job = next(d for d in _docs() if d["kind"] == "Job")
  shell = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
  argv = shlex.split(shell.replace("${JOB_COMPLETION_INDEX}", "1"))
  # the venv for the TPU first (a no-op in an image built with the same command)
  assert argv[:8] == ["make", "venv", "ACCEL=tpu", "&&", "exec", ".venv/bin/python", "-m",
                      "launch.pod.render"]
  seen = []
  monkeypatch.setattr(render.os, "execvp", lambda prog, a: seen.append(a))
  render.main(argv[8:])
  assert seen[0][0] == ".venv/bin/python"
  f = _flags(seen[0])
  assert f["process_id"] == "1" and f["num_processes"] == "2"
  assert f["coordinator_address"] == "hgpo-trainer-0.hgpo-trainer:8476"
  assert eval(f["config.env.endpoints"]) == ("hgpo-env-1.hgpo-env:50051", "hgpo-env-3.hgpo-env:50051")  # noqa: S307
  assert f["config.env.token_file"] == f"{render.TOKEN_MOUNT}/token"


@pytest.mark.parametrize("accelerator,accel", [("tpu-v5e-8", "tpu"), ("tpu-v5p-8", "tpu"),
                                               ("h100-8", "cuda12")])
def test_k8s_trainer_installs_jax_for_its_accelerator(accelerator, accel):
  docs = render.k8s_manifests(name="h", image="i", num_hosts=1, env_servers=1, env="alfworld",
                              env_slots=1, accelerator=accelerator, config=CONFIG, workdir="/w")
  job = next(d for d in docs if d["kind"] == "Job")
  shell = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
  assert shell.startswith(f"make venv ACCEL={accel} && exec .venv/bin/python -m launch.pod.render ")


@pytest.mark.parametrize("script,line", [
    ("launch/pod/slurm_gpu.sbatch", 'make venv ACCEL="${ACCEL:-cuda12}"'),
    ("launch/pod/tpu_pod.sh", "cd $REPO_DIR && make venv ACCEL=tpu && .venv/bin/python")])
def test_templates_install_jax_for_their_accelerator(script, line):
  """The real (not DRY_RUN) path of each template builds the venv for its chips before the
  trainer starts: without it `make venv` installs the CPU jaxlib only."""
  with open(os.path.join(ROOT, script), encoding="utf-8") as f:
    text = f.read()
  assert text.count(line) == 1 and text.index(line) > text.index("\nfi\n")  # after DRY_RUN's exec


def test_k8s_manifests_validate_against_the_kubernetes_schema():
  kubernetes_validate = pytest.importorskip("kubernetes_validate")
  for doc in _docs():
    kubernetes_validate.validate(doc, "1.32", strict=True)
  bad = dict(_docs()[2])
  bad["spec"] = dict(bad["spec"], replicas="four")
  with pytest.raises(kubernetes_validate.ValidationError):
    kubernetes_validate.validate(bad, "1.32", strict=True)


def test_committed_manifests_equal_the_renderer_output(tmp_path):
  out = _run([sys.executable, "-m", "launch.pod.render", *K8S_ARGS[:K8S_ARGS.index("--")],
              "--out", str(tmp_path), *K8S_ARGS[K8S_ARGS.index("--"):]])
  assert out.returncode == 0, out.stderr
  committed = os.path.join(ROOT, "launch", "pod", "k8s")
  names = sorted(f for f in os.listdir(tmp_path))
  assert names == sorted(f for f in os.listdir(committed) if f.endswith(".yaml"))
  for name in names:
    with open(tmp_path / name) as a, open(os.path.join(committed, name)) as b:
      assert yaml.safe_load(a) == yaml.safe_load(b), name
