# dtrain for GPU nodes: PyTorch + CUDA from the official image, DeepSpeed with its CUDA ops
# compiled here for sm_80 (A100) and sm_90 (H100/H200) so no node JIT-compiles at start-up,
# torchao, and launch/entrypoint.sh as the entrypoint (torchrun, rendezvous from env vars).
#
#   docker build -t dtrain:latest .
#   docker run --gpus all --network host --ipc host -e NNODES=2 -e RDZV_ENDPOINT=node0:29400 \
#       -e RDZV_ID=job1 -v /shared:/shared dtrain:latest strategy=ddp hydra.run.dir=/shared/runs/a
#
# Versions are pinned; change them together (DeepSpeed and torchao must suit the base's torch).
# torch 2.11.0 with CUDA 12.8: inside pyproject's torch>=2.6 (tests/test_install.py checks), the
# release the GPU figures in docs/benchmarks.md were measured on. Another CUDA build: pass
# --build-arg BASE_IMAGE=pytorch/pytorch:<torch>-cuda<X.Y>-cudnn9-devel.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ARG DEEPSPEED_VERSION=0.19.8
ARG TORCHAO_VERSION=0.17.0
ARG NINJA_VERSION=1.13.0
# The GPU architectures DeepSpeed's ops are built for: 8.0 = A100, 9.0 = H100/H200.
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# libaio: DeepSpeed's async I/O op (NVMe offload). rdma-core / ibverbs: NCCL over InfiniBand and
# RoCE (EFA needs the host's aws-ofi-nccl plugin mounted in; see docs/multinode.md).
# iproute2: `ip addr` to find the NCCL_SOCKET_IFNAME. Distribution packages follow the base
# image's release, so they are not pinned one by one.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        libaio-dev rdma-core ibverbs-providers libibverbs1 iproute2 \
    && rm -rf /var/lib/apt/lists/*

# Keep the base image's torch: every install below is constrained to it.
RUN python -c "import torch; print(f'torch=={torch.__version__}')" > /etc/pip-torch.txt

# DeepSpeed with its CUDA/C++ ops prebuilt (fused Adam, CPU Adam for offload, async I/O, the
# flatten utils ZeRO uses); the check fails the build if any was not compiled.
RUN pip install --no-cache-dir -c /etc/pip-torch.txt "ninja==${NINJA_VERSION}" \
    && TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" DS_BUILD_OPS=0 \
        DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 DS_BUILD_AIO=1 DS_BUILD_UTILS=1 \
        pip install --no-cache-dir --no-build-isolation -c /etc/pip-torch.txt \
        "deepspeed==${DEEPSPEED_VERSION}" \
    && python -c "from deepspeed.git_version_info import installed_ops as ops; \
missing = [k for k in ('fused_adam', 'cpu_adam', 'async_io', 'utils') if not ops.get(k)]; \
assert not missing, f'DeepSpeed ops not prebuilt: {missing}'" \
    && pip install --no-cache-dir -c /etc/pip-torch.txt "torchao==${TORCHAO_VERSION}"

# A fixed uid outside the range the base image or a distribution uses for its own users.
RUN groupadd --gid 10001 dtrain \
    && useradd --create-home --uid 10001 --gid 10001 --shell /bin/bash dtrain

# The checkout itself (conf/ and launch/ are found next to dtrain/), installed in place.
WORKDIR /opt/dtrain
COPY . /opt/dtrain
RUN pip install --no-cache-dir -c /etc/pip-torch.txt -e /opt/dtrain \
    && mkdir -p /opt/dtrain/outputs \
    && chown dtrain:dtrain /opt/dtrain/outputs \
    && chmod 0755 /opt/dtrain/launch/entrypoint.sh

USER 10001:10001
ENTRYPOINT ["/opt/dtrain/launch/entrypoint.sh"]
CMD []
