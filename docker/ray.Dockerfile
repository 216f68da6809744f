# Ray 2.60 GPU node image of verl-pipeline (ray-head and ray-worker). Build context is the
# repository root:
#   docker build -f docker/ray.Dockerfile -t verl-pipeline/ray:local .
# The CPU way (no GPU, jobs in preflight mode) has its own image with the same pins: docker/ray-cpu.Dockerfile.
#
# CUDA: the torch/vLLM wheels that verl[vllm] pulls bundle their own CUDA runtime libraries, so the
# base image mainly provides the driver hooks (NVIDIA Container Toolkit) and cuDNN/NCCL tooling.
# What matters is the HOST driver: it must support the CUDA version of those wheels (torch 2.11.0 is
# built for CUDA 13: check `nvidia-smi`). Kernels compiled here or at run time (FLASH_ATTN=build,
# FlashInfer's JIT) need nvcc: then build with a devel base image (CUDA_BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-devel-ubuntu22.04).
# Package sources as for the other images (docker/pip-install.sh): PyPI by default; PIP_INDEX,
# FIND_LINKS and docker/wheels/ name others. No BuildKit-only feature (DOCKER_BUILDKIT=0 builds it).
# CUDA 13 like the wheels (torch 2.11.0+cu130): the container toolkit then refuses a host driver too old for them.
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu22.04
FROM ${CUDA_BASE_IMAGE}
# Marks this project's layers (tests/e2e/compose_stack.py removes exactly those for a cold build).
LABEL io.verl-pipeline.image=ray

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
 && python3.11 -m venv /opt/venv

WORKDIR /opt/verl-pipeline

ARG PIP_INDEX=
ARG FIND_LINKS=
COPY docker/pip-install.sh docker/flash-attn.sh /usr/local/bin/
COPY docker/wheels/ /opt/wheels/
RUN pip-install.sh --upgrade pip

# GPU stack (cached layer): the pins every Ray node image shares (requirements/ray-node.txt) plus verl's
# vllm extra, which pins torch/vLLM/transformers together (see requirements/gpu.txt).
COPY requirements/gpu.txt requirements/ray-node.txt ./requirements/
RUN pip-install.sh -r requirements/gpu.txt

# flash-attn matching this image's torch / CUDA / Python (PyPI has only its source). FLASH_ATTN:
# - none (default): left out; critic-free profiles (GRPO) run with the sdpa override, PPO (a critic) does not;
# - build: compiled here (a CUDA 13 devel CUDA_BASE_IMAGE; ~20 min on 16 cores for one GPU generation,
#   FLASH_ATTN_CUDA_ARCHS, e.g. "90" for H100/H200, "80;90" with A100); the wheel stays at /opt/flash-attn/;
# - wheels: the flash_attn-*.whl in docker/wheels/ (e.g. the one a `build` left in /opt/flash-attn/);
# - a URL or path of such a wheel.
# The build prints what a wheel must match and fails unless flash-attn then loads (docker/flash-attn.sh).
ARG FLASH_ATTN=none
ARG MAX_JOBS=4
ARG FLASH_ATTN_CUDA_ARCHS=90
RUN MAX_JOBS="${MAX_JOBS}" FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" flash-attn.sh "${FLASH_ATTN}"

# The project, so Ray nodes can import verl_pipeline, with the few packages it imports that verl's pins do
# not bring (msgspec; what is installed already is kept): jobs receive the package itself via runtime_env
# py_modules, not its dependencies.
COPY . /opt/verl-pipeline
RUN pip-install.sh -e /opt/verl-pipeline \
 && python -c "import verl_pipeline, ray; print('verl_pipeline', verl_pipeline.__version__, 'ray', ray.__version__)"

COPY docker/ray-user.sh /usr/local/bin/ray-user.sh
RUN ray-user.sh "${APP_UID}"

USER ray
WORKDIR /home/ray

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["ray", "start", "--head", "--block"]
