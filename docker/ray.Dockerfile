# syntax=docker/dockerfile:1
# Ray 2.60 GPU node image of verl-pipeline (ray-head and ray-worker). Build context is the
# repository root:
#   docker build -f docker/ray.Dockerfile -t verl-pipeline/ray:local .
#
# CUDA: the torch/vLLM wheels that verl[vllm] pulls bundle their own CUDA runtime libraries, so the
# base image mainly provides the driver hooks (NVIDIA Container Toolkit) and cuDNN/NCCL tooling.
# What matters is the HOST driver: it must support the CUDA version of those wheels (check
# `nvidia-smi` against the torch build). Kernels that are JIT-compiled at run time (e.g. FlashInfer)
# need nvcc: then build with CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04.
ARG CUDA_BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu22.04
FROM ${CUDA_BASE_IMAGE}

# Same UID as the Airflow image, so both can write the shared /shared/* volumes.
ARG APP_UID=50000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH} \
    VERL_PIPELINE_HOME=/shared \
    VERL_PIPELINE_CONFIGS=/opt/verl-pipeline/configs \
    RAY_USAGE_STATS_ENABLED=0

# Python 3.11 from the deadsnakes PPA (Ubuntu 22.04 ships 3.10). python3.11-dev and a C compiler
# are needed at run time: Triton compiles its launcher stubs against Python.h.
RUN apt-get update \
 && apt-get install -y --no-install-recommends software-properties-common gpg-agent ca-certificates \
 && add-apt-repository -y ppa:deadsnakes/ppa \
 && apt-get update \
 && apt-get install -y --no-install-recommends \
      python3.11 python3.11-venv python3.11-dev build-essential git tini procps curl \
 && apt-get purge -y software-properties-common \
 && apt-get autoremove -y \
 && rm -rf /var/lib/apt/lists/* \
 && python3.11 -m venv /opt/venv \
 && pip install --upgrade pip

WORKDIR /opt/verl-pipeline

# GPU stack (cached layer): verl[vllm] pins torch/vLLM/transformers together, see the file.
COPY requirements/gpu.txt ./requirements/gpu.txt
RUN pip install -r requirements/gpu.txt

# flash-attn as verl pins it for torch 2.11 / CUDA 13 (flash-attn==2.8.3). PyPI has no wheel of it, so:
# - FLASH_ATTN=build compiles it here against the installed torch; that needs CUDA 13's nvcc, i.e. a devel
#   base image (CUDA_BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu22.04) and time (MAX_JOBS parallel
#   nvcc jobs, several GB of RAM each);
# - FLASH_ATTN=<wheel URL> installs a wheel built once for torch 2.11 / cu130 / cp311 (e.g. by FLASH_ATTN=build);
# - FLASH_ATTN=none (default) leaves it out: then only critic-free profiles run, with
#   +actor_rollout_ref.model.override_config.attn_implementation=sdpa (the submit task's probe says so).
ARG FLASH_ATTN=none
ARG MAX_JOBS=4
COPY requirements/gpu-flash-attn.txt ./requirements/gpu-flash-attn.txt
RUN case "${FLASH_ATTN}" in \
      none) echo "flash-attn not installed (FLASH_ATTN=none): profiles with a critic will not run on this image" ;; \
      build) command -v nvcc >/dev/null \
               || { echo "FLASH_ATTN=build compiles flash-attn: use a CUDA 13 devel CUDA_BASE_IMAGE (needs nvcc)"; exit 1; } \
             && pip install ninja packaging psutil wheel \
             && MAX_JOBS="${MAX_JOBS}" pip install --no-build-isolation -r requirements/gpu-flash-attn.txt ;; \
      *) pip install --no-deps "${FLASH_ATTN}" ;; \
    esac \
 && if [ "${FLASH_ATTN}" != none ]; then pip show flash-attn | head -2; fi

# The project, without dependencies (verl's pins win), so Ray workers can import verl_pipeline.
# Jobs also receive the package via runtime_env py_modules; this makes the image self-sufficient.
COPY . /opt/verl-pipeline
RUN pip install --no-deps -e /opt/verl-pipeline \
 && python -c "import verl_pipeline, ray; print('verl_pipeline', verl_pipeline.__version__, 'ray', ray.__version__)"

RUN useradd --uid "${APP_UID}" --gid 0 --create-home --home-dir /home/ray --shell /bin/bash ray \
 && mkdir -p /shared/data /shared/models /shared/checkpoints /shared/runs \
 && chown -R "${APP_UID}:0" /shared \
 && chmod -R g+rwX /shared

USER ray
WORKDIR /home/ray

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["ray", "start", "--head", "--block"]
