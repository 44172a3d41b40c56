#!/usr/bin/env bash
# Start dtrain on this node under dtrain-torchrun (torchrun with graceful stops); rendezvous and sizes come from the environment.
# It is the Docker image's entrypoint, and what launch/slurm.sbatch and launch/k8s/ run on every
# node; arguments are Hydra overrides, passed through to launch/train.py unchanged.
#
#   NNODES           nodes in the job (default 1); "MIN:MAX" for an elastic range
#   NPROC_PER_NODE   processes on this node (default: one per visible GPU, or 1 without GPUs)
#   RDZV_ENDPOINT    host:port of the c10d rendezvous (any one node's address; torchrun on that
#                    node hosts it). Preferred for several nodes: needed for restarts.
#   RDZV_ID          job id shared by all nodes of one job (default: dtrain)
#   NODE_RANK        without RDZV_ENDPOINT: static rendezvous at MASTER_ADDR:MASTER_PORT
#                    (default port 29500), this node's index
#   MAX_RESTARTS     restarts of the worker group after a failure (default 0); with resume=auto
#                    each restart continues from the newest complete checkpoint
#   LOCAL_ADDR       address this node advertises to the rendezvous (default: its host name)
#   RDZV_CONF        extra rendezvous settings, e.g. join_timeout=900
#   TORCHRUN_ARGS    any further torchrun options, split on spaces
#   PYTHON           the interpreter (default: python)
#
# One node, two processes:   NPROC_PER_NODE=2 launch/entrypoint.sh strategy=ddp
# Node 1 of 2:  NNODES=2 RDZV_ENDPOINT=10.0.0.1:29400 RDZV_ID=job42 launch/entrypoint.sh ...
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
train="${here}/train.py"
python="${PYTHON:-python}"

die() {
    echo "error: $*" >&2
    exit 2
}

nnodes="${NNODES:-1}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    gpus=0
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)"
    fi
    NPROC_PER_NODE=$((gpus > 0 ? gpus : 1))
fi
[[ "${NPROC_PER_NODE}" =~ ^[1-9][0-9]*$ ]] ||
    die "NPROC_PER_NODE=${NPROC_PER_NODE} must be a positive integer"
[[ "${nnodes}" =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] ||
    die "NNODES=${nnodes} must be a positive integer or MIN:MAX"
max_restarts="${MAX_RESTARTS:-0}"
[[ "${max_restarts}" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=${max_restarts} must be an integer >= 0"

args=(--nnodes="${nnodes}" --nproc-per-node="${NPROC_PER_NODE}" --max-restarts="${max_restarts}")
if [[ -n "${RDZV_ENDPOINT:-}" ]]; then
    args+=(
        --rdzv-backend="${RDZV_BACKEND:-c10d}"
        --rdzv-endpoint="${RDZV_ENDPOINT}"
        --rdzv-id="${RDZV_ID:-dtrain}"
    )
    [[ -n "${RDZV_CONF:-}" ]] && args+=(--rdzv-conf="${RDZV_CONF}")
elif [[ -n "${NODE_RANK:-}" ]]; then
    [[ -n "${MASTER_ADDR:-}" ]] || die "NODE_RANK is set but MASTER_ADDR is not (or use RDZV_ENDPOINT)"
    args+=(
        --node-rank="${NODE_RANK}"
        --master-addr="${MASTER_ADDR}"
        --master-port="${MASTER_PORT:-29500}"
    )
elif [[ "${nnodes}" == "1" ]]; then
    args+=(--standalone)
else
    die "NNODES=${nnodes} needs RDZV_ENDPOINT (and RDZV_ID), or NODE_RANK with MASTER_ADDR"
fi
[[ -n "${LOCAL_ADDR:-}" ]] && args+=(--local-addr="${LOCAL_ADDR}")
if [[ -n "${TORCHRUN_ARGS:-}" ]]; then
    read -r -a extra <<<"${TORCHRUN_ARGS}"
    args+=("${extra[@]}")
fi

# Workers build their own store instead of sharing the rendezvous' one: a shared store keeps the
# keys of the failed attempt, and restarted workers then connect to dead peers and hang
# (pytorch/pytorch#135712, #167288).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# dtrain.launcher is torchrun (same options) that meets SIGTERM/SIGUSR1 with a checkpoint and
# exit 0, and passes dtrain's exit codes (2 bad input, 3 fault) through: docs/reliability.md.
echo "dtrain: dtrain-torchrun ${args[*]} ${train} $*" >&2
exec "${python}" -m dtrain.launcher "${args[@]}" "${train}" "$@"
