#!/bin/sh
# flash-attn for the GPU image, matching the torch / CUDA / Python the image has (docker/ray.Dockerfile,
# build argument FLASH_ATTN; what each choice costs: docs/deployment.md, "Building the GPU image").
#   none     (default) not installed: critic-free profiles run with the sdpa override; PPO (a critic) does not run
#   build    compiled here against the installed torch: needs a CUDA 13 *devel* base image (nvcc); the
#            wheel stays in the image at /opt/flash-attn/ to be reused with `wheels` or a URL
#   wheels   the flash_attn-*.whl put in docker/wheels/ (built once for this torch/CUDA/Python)
#   URL|PATH a wheel's address
# Whatever the source, the build fails unless flash-attn then loads against the image's torch.
set -eu
mode=${1:?usage: flash-attn.sh none|build|wheels|URL}
# The build's package sources (as docker/pip-install.sh uses them), for every pip call below.
if [ -n "${PIP_INDEX:-}" ]; then export PIP_INDEX_URL="$PIP_INDEX"; fi
export PIP_FIND_LINKS="/opt/wheels${FIND_LINKS:+ $FIND_LINKS}"
# The version verl pins for its torch 2.11 / CUDA 13 stack (its extra flash-attn-cu130torch211).
pin=$(python - <<'PY'
from importlib.metadata import requires
print(next(r.split(";")[0].replace(" ", "") for r in requires("verl") or []
           if r.startswith("flash-attn") and "flash-attn-cu130torch211" in r))
PY
)
target=$(python - <<'PY'
import sys, torch
abi = "TRUE" if torch._C._GLIBCXX_USE_CXX11_ABI else "FALSE"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cp{sys.version_info.major}{sys.version_info.minor}, "
      f"cxx11abi{abi}, {sys.platform}_{__import__('platform').machine()}")
PY
)
echo "flash-attn: FLASH_ATTN=$mode; verl pins $pin; a wheel must be built for: $target"
case "$mode" in
  none)
    echo "flash-attn not installed (FLASH_ATTN=none): profiles with a critic (PPO) will not run on this image"
    exit 0 ;;
  build)
    command -v nvcc >/dev/null || {
      echo "FLASH_ATTN=build compiles flash-attn with nvcc: use a CUDA 13 devel base image," \
           "e.g. --build-arg CUDA_BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu22.04" >&2
      exit 1; }
    pip-install.sh ninja packaging psutil wheel
    # FLASH_ATTENTION_FORCE_BUILD: compile, never try to download a prebuilt wheel from GitHub.
    FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-4}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS:-90}" \
      python -m pip wheel --no-cache-dir --no-build-isolation --no-deps -w /opt/flash-attn "$pin"
    python -m pip install --no-cache-dir --no-deps /opt/flash-attn/flash_attn-*.whl ;;
  wheels)
    ls /opt/wheels/flash_attn-*.whl >/dev/null 2>&1 || {
      echo "FLASH_ATTN=wheels: no flash_attn-*.whl in docker/wheels/ (put the wheel built for $target there)" >&2
      exit 1; }
    python -m pip install --no-cache-dir --no-deps --no-index --find-links /opt/wheels flash-attn ;;
  *)
    python -m pip install --no-cache-dir --no-deps "$mode" ;;
esac
python - "$target" <<'PY'
import sys

import torch

try:
    import flash_attn  # imports its compiled kernels (flash_attn_2_cuda)
except ImportError as e:
    if "libcuda.so" in str(e):  # no NVIDIA driver on the build host: the kernels load on a GPU node
        print(f"flash-attn: not loaded here ({e}); it is checked again by the probe on the GPU nodes")
        sys.exit(0)
    sys.exit(f"flash-attn does not load against this image ({sys.argv[1]}): {e} "
             "(fix: a wheel built for exactly these, or FLASH_ATTN=build)")
print(f"flash-attn {flash_attn.__version__} loads with {sys.argv[1]}")
PY
