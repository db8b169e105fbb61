#!/usr/bin/env bash
# Launch the trainer on every host of a Cloud TPU VM pod slice (e.g. v5p-16: 2 hosts).
# Each host runs one trainer process with an explicit coordinator (worker 0), process
# id (its worker index) and host count, rendered by `python -m launch.pod.render`.
# Env servers: by default each process starts its own local servers (config
# env.num_servers); for a shared fleet set ENV_ENDPOINTS=envhost1:50051,envhost2:50051
# (dealt round-robin over hosts) and TOKEN_FILE=/path/on/every/host (serve --token-file).
# Every host first installs the venv for its TPU chips (`make venv ACCEL=tpu`).
# HOSTS=ip0,ip1 skips the `gcloud ... describe` lookup of the workers' internal IPs.
# DRY_RUN=1 prints each host's exact command and runs nothing:
#   DRY_RUN=1 HOSTS=10.0.0.2,10.0.0.3 TPU=x ZONE=y launch/pod/tpu_pod.sh CONFIG WORKDIR [overrides]
#
#   TPU=my-v5p-16 ZONE=us-east5-a launch/pod/tpu_pod.sh \
#       configs/alfworld.py:algo=hgpo,k=2,model=qwen2.5-1.5b gs://my-bucket/runs/hgpo_k2 \
#       --config.model.path=/models/Qwen2.5-1.5B-Instruct --config.mesh.fsdp=4
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE}"
CONFIG=${1:?config[:variant]}; WORKDIR=${2:?workdir}; shift 2
REPO_DIR=${REPO_DIR:-hgpo_jax}
HOSTS=${HOSTS:-$(gcloud compute tpus tpu-vm describe "$TPU" --zone "$ZONE" \
  --format='value[delimiter=","](networkEndpoints[].ipAddress)')}
RENDER=(-m launch.pod.render commands --hosts "$HOSTS" --config "$CONFIG" --workdir "$WORKDIR"
        --env-endpoints "${ENV_ENDPOINTS:-}" --token-file "${TOKEN_FILE:-}")
if [[ -n "${DRY_RUN:-}" ]]; then
  exec python3 "${RENDER[@]}" -- "$@"
fi
IFS=, read -ra WORKERS <<< "$HOSTS"
for i in "${!WORKERS[@]}"; do
  gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker="$i" --command \
    "cd $REPO_DIR && make venv ACCEL=tpu && .venv/bin/python $(printf '%q ' "${RENDER[@]}") --process-id $i --exec -- $(printf '%q ' "$@")" &
done
wait
