# Airflow 3.3 image of verl-pipeline (api-server, scheduler, dag-processor, triggerer, celery worker).
# CPU-only: Airflow never trains; it submits Ray jobs (it imports verl and torch to compose and check
# verl's config before any cluster starts). Build context is the repository root:
#   docker build -f docker/airflow.Dockerfile -t verl-pipeline/airflow:local .
# No BuildKit-only feature: the classic builder (DOCKER_BUILDKIT=0) builds it offline from local images.
# Where packages come from (build arguments, see docker/pip-install.sh): PyPI by default;
# TORCH_INDEX_URL for torch alone, PIP_INDEX for everything, FIND_LINKS for a wheel directory URL,
# and any wheel put in docker/wheels/.
ARG PYTHON_BASE_IMAGE=python:3.11-slim
FROM ${PYTHON_BASE_IMAGE}
# Marks this project's layers (tests/e2e/compose_stack.py removes exactly those for a cold build).
LABEL io.verl-pipeline.image=airflow

# Same UID in the Airflow and Ray images, so both can write the shared /shared/* volumes.
ARG APP_UID=50000
# The lock's torch (requirements/constraints.txt). PyPI's Linux build of it is the CUDA one (~3 GB
# more); TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu or a CPU wheel in docker/wheels avoids that.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ARG PIP_INDEX=
ARG FIND_LINKS=
# Not in requirements.txt: the Celery provider, so that switching AIRFLOW_EXECUTOR to CeleryExecutor
# needs no rebuild. (The Postgres drivers psycopg2-binary + asyncpg are in requirements.txt.)
ARG AIRFLOW_EXTRA_PIP_PACKAGES="apache-airflow-providers-celery==3.26.0"

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    AIRFLOW_HOME=/opt/airflow \
    VERL_PIPELINE_HOME=/shared \
    VERL_PIPELINE_CONFIGS=/opt/verl-pipeline/configs

RUN apt-get update \
 && apt-get install -y --no-install-recommends tini procps ca-certificates \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/verl-pipeline

# Dependencies first (cached layers; code changes rebuild only the last ones): torch alone, pinned,
# then the pinned stack held to the lock. torch X+cpu satisfies torch==X (== ignores a local label).
COPY docker/pip-install.sh /usr/local/bin/pip-install.sh
COPY docker/wheels/ /opt/wheels/
RUN pip-install.sh "torch==${TORCH_VERSION}"
COPY requirements.txt ./requirements.txt
COPY requirements/ ./requirements/
RUN pip-install.sh -r requirements.txt -c requirements/constraints.txt ${AIRFLOW_EXTRA_PIP_PACKAGES}

# The project itself (package verl_pipeline under include/, pyproject.toml at the root).
COPY . /opt/verl-pipeline
RUN pip-install.sh -e /opt/verl-pipeline -c requirements/constraints.txt \
 && python -c "import verl_pipeline, airflow; print('verl_pipeline', verl_pipeline.__version__, 'airflow', airflow.__version__)"

# Airflow's local settings (the shared-cluster pool policy) go to $AIRFLOW_HOME/config.
# Non-root user (GID 0 like the official Airflow image, so an arbitrary UID with GID 0 works too).
# The directories below are the mount points of named volumes: a new named volume copies their
# ownership, so the user can write logs, the auth file and the shared data.
RUN useradd --uid "${APP_UID}" --gid 0 --create-home --home-dir /home/airflow --shell /bin/bash airflow \
 && mkdir -p /opt/airflow/dags /opt/airflow/plugins /opt/airflow/logs /opt/airflow/auth /opt/airflow/config \
             /shared/data /shared/models /shared/checkpoints /shared/runs \
 && cp /opt/verl-pipeline/docker/airflow_local_settings.py /opt/airflow/config/ \
 && chown -R "${APP_UID}:0" /opt/airflow /shared \
 && chmod -R g+rwX /opt/airflow /shared

USER airflow
WORKDIR /opt/airflow

ENTRYPOINT ["/usr/bin/tini", "--", "airflow"]
CMD ["--help"]
