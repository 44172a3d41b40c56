# Source on the GPU box: installs the carried wheels (.whl/) into /tmp/site and points Python at
# this checkout. The box has torch/tensorboard/lightning but not hydra, omegaconf, datasets, ...
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
