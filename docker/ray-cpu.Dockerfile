# Ray 2.60 CPU node image of verl-pipeline (ray-head and ray-worker of the CPU way: a laptop, CI, a team
# before GPUs). The pins of the GPU image (requirements/ray-node.txt), torch's CPU build, no vLLM: verl
# cannot train on CPU, so the DAG's jobs run in preflight mode on it. Build context is the repository root:
#   docker build -f docker/ray-cpu.Dockerfile -t verl-pipeline/ray-cpu:local .
# Package sources as for the Airflow image (docker/pip-install.sh): PyPI by default; TORCH_INDEX_URL,
# PIP_INDEX, FIND_LINKS and docker/wheels/ name others. PyPI's Linux torch is the CUDA build (~3 GB more,
# it runs on CPU too): TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu or a CPU wheel in
# docker/wheels gives the CPU build.
ARG PYTHON_BASE_IMAGE=python:3.11-slim
FROM ${PYTHON_BASE_IMAGE}
# Marks this project's layers (tests/e2e/compose_stack.py removes exactly those for a cold build).
LABEL io.verl-pipeline.image=ray-cpu

# Same UID as the Airflow image, so both can write the shared /shared/* volumes.
ARG APP_UID=50000
# The lock's torch (requirements/constraints.txt holds this image to the versions the project tests).
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG PIP_INDEX=
ARG FIND_LINKS=

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VERL_PIPELINE_HOME=/shared \
    VERL_PIPELINE_CONFIGS=/opt/verl-pipeline/configs \
    RAY_USAGE_STATS_ENABLED=0

RUN apt-get update \
 && apt-get install -y --no-install-recommends tini procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/verl-pipeline

# Dependencies first (cached layers): torch alone, then the Ray node pins held to the lock.
COPY docker/pip-install.sh /usr/local/bin/pip-install.sh
COPY docker/wheels/ /opt/wheels/
RUN pip-install.sh "torch==${TORCH_VERSION}"
COPY requirements/ray-node.txt requirements/constraints.txt ./requirements/
RUN pip-install.sh -r requirements/ray-node.txt -c requirements/constraints.txt

# The project, so Ray nodes can import verl_pipeline, with the few packages it imports that the pins above
# do not bring (msgspec): jobs receive the package itself via runtime_env py_modules, not its dependencies.
COPY . /opt/verl-pipeline
RUN pip-install.sh -e /opt/verl-pipeline -c requirements/constraints.txt \
 && python -c "import verl_pipeline, ray, verl, torch; print('verl_pipeline', verl_pipeline.__version__, 'ray', ray.__version__, 'verl', verl.__version__, 'torch', torch.__version__)"

COPY docker/ray-user.sh /usr/local/bin/ray-user.sh
RUN ray-user.sh "${APP_UID}"

USER ray
WORKDIR /home/ray

ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["ray", "start", "--head", "--block"]
