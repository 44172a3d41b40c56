#!/usr/bin/env bash
# Run dtrain's image on this node as one of NNODES nodes: run the same command on every node,
# each with its own NODE_RANK (0 on the node that hosts the rendezvous). Arguments are Hydra
# overrides for launch/train.py.
#
#   # on node0 (10.0.0.1) and node1, with /shared mounted on both:
#   NNODES=2 NODE_RANK=0 RDZV_HOST=10.0.0.1 launch/multinode.sh strategy=fsdp \
#       hydra.run.dir=/shared/runs/fsdp-1b model=1b
#   NNODES=2 NODE_RANK=1 RDZV_HOST=10.0.0.1 launch/multinode.sh strategy=fsdp \
#       hydra.run.dir=/shared/runs/fsdp-1b model=1b
#
# The data needs no setting for the number of nodes (any world size reads the same batches);
# data.num_streams at a multiple of the world size only saves tokenizing (docs/data.md).
#
#   IMAGE          the dtrain image (default dtrain:latest)
#   RDZV_HOST      address of the node hosting the c10d rendezvous (required for NNODES > 1)
#   RDZV_PORT      its port (default 29400)
#   RDZV_ID        one id per job (default: dtrain-<first override hash>, the same on every node)
#   SHARED_DIR     host directory mounted at the same path in the container (default /shared):
#                  the run dir (checkpoints) must be on it, see docs/multinode.md
#   MAX_RESTARTS   group restarts after a failure (default 3); each resumes from the newest
#                  complete checkpoint (resume=auto)
#   NPROC_PER_NODE processes per node (default: one per GPU)
#   NCCL_* GLOO_* TORCH_* variables set here are passed into the container.
set -euo pipefail

image="${IMAGE:-dtrain:latest}"
nnodes="${NNODES:-1}"
shared="${SHARED_DIR:-/shared}"
restarts="${MAX_RESTARTS:-3}"

env_args=(-e NNODES="${nnodes}" -e MAX_RESTARTS="${restarts}")
if [[ "${nnodes}" != "1" ]]; then
    [[ -n "${RDZV_HOST:-}" ]] || { echo "error: NNODES=${nnodes} needs RDZV_HOST" >&2; exit 2; }
    rdzv_id="${RDZV_ID:-dtrain-$(printf '%s' "$*" | cksum | cut -d' ' -f1)}"
    env_args+=(
        -e RDZV_ENDPOINT="${RDZV_HOST}:${RDZV_PORT:-29400}"
        -e RDZV_ID="${rdzv_id}"
    )
fi
[[ -n "${NPROC_PER_NODE:-}" ]] && env_args+=(-e NPROC_PER_NODE="${NPROC_PER_NODE}")
# NCCL/gloo/torch tuning from the host environment (interface names, IB HCAs, debug).
while IFS='=' read -r name _; do
    env_args+=(-e "${name}")
done < <(env | grep -E '^(NCCL|GLOO|TORCH|CUDA_VISIBLE_DEVICES|FI_)[A-Z0-9_]*=' || true)

# --network host: NCCL and the rendezvous see the node's real interfaces (IB/EFA included).
# --ipc host: NCCL's shared-memory transport between the GPUs of this node.
# --ulimit memlock=-1: RDMA registers (pins) memory. /dev/infiniband: the IB verbs devices.
devices=()
[[ -d /dev/infiniband ]] && devices+=(--device /dev/infiniband)
exec docker run --rm --gpus all --network host --ipc host \
    --ulimit memlock=-1 --ulimit stack=67108864 \
    "${devices[@]}" \
    -v "${shared}:${shared}" \
    "${env_args[@]}" \
    --name "dtrain-node${NODE_RANK:-0}" \
    "${image}" "$@"
