# syntax=docker/dockerfile:1
# Airflow 3.3 image of verl-pipeline (api-server, scheduler, dag-processor, triggerer, celery worker).
# CPU-only: Airflow never trains; it submits Ray jobs. Build context is the repository root:
#   docker build -f docker/airflow.Dockerfile -t verl-pipeline/airflow:local .
FROM python:3.11-slim

# Same UID in the Airflow and Ray images, so both can write the shared /shared/* volumes.
ARG APP_UID=50000
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
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

# Dependencies first (cached layer): torch from the CPU index, so pip does not pull the CUDA build
# and its ~3 GB of nvidia-* wheels; then the pinned stack. torch 2.13.0+cpu satisfies the
# constraint torch==2.13.0 (a local version label is ignored by ==), so it is kept.
COPY requirements.txt ./requirements.txt
COPY requirements/ ./requirements/
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && pip install -r requirements.txt -c requirements/constraints.txt ${AIRFLOW_EXTRA_PIP_PACKAGES}

# The project itself (package verl_pipeline under include/, pyproject.toml at the root).
COPY . /opt/verl-pipeline
RUN pip install -e /opt/verl-pipeline -c requirements/constraints.txt \
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
