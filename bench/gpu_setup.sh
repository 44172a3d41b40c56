# Source on the GPU box: installs the carried wheels (.whl/) into /tmp/site and points Python at
# this checkout. The box has torch/tensorboard/lightning but not hydra, omegaconf, datasets, ...
# Installed once per machine and wheel set: bench/lanes.sh's lanes source this side by side, and
# two pip runs writing one --target at once could leave it half-written.
mark=/tmp/site/.installed-$(ls .whl | md5sum | cut -c1-8)
if [ ! -f "$mark" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || return 1
  touch "$mark"
fi
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
