# Source on the GPU box: installs the carried wheels (.whl/) into /tmp/site and points Python at
# this checkout. The box has torch/tensorboard/lightning but not hydra, omegaconf, datasets, ...
# Installed once per machine and wheel set, under a lock: bench/lanes.sh's lanes source this
# side by side, and two pip runs writing one --target at once could leave it half-written.
mark=/tmp/site/.installed-$(cat .whl/*.whl | md5sum | cut -c1-8)  # the wheels' contents
mkdir -p /tmp/site
(
  flock 9  # a second lane waits here for the first one's install
  if [ ! -f "$mark" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch "$mark"
  fi
) 9>/tmp/site.lock
[ -f "$mark" ] || return 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
