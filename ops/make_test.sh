#!/usr/bin/env bash
# make_test.sh: the steps of `make test` (and so of CI), overlapped where they do not depend
# on each other, each timed:
#   1. the virtual environment, then ruff, mypy and the docs site (mkdocs build --strict),
#      while (as root) the sandbox host is readied beside them
#      (ops/sandbox/setup_host.sh: podman, the sandbox image) and the
#      default config's warm start is trained into the tests' model cache (ops/prewarm.py,
#      its log build/logs/prewarm.log; it may run on into pytest, whose tests wait for it);
#   2. pytest on everything not marked slow, in TEST_WORKERS processes, while (as root) the
#      compose stack's images and secrets are built beside it (ops/images/build.sh; its log
#      is build/logs/images.log, printed when it fails); as root the compose tests (what
#      `make compose-test` runs) are in the same session, collected last, and wait there
#      for the images (tests/compose/conftest.py): one test process runs them while the
#      other runs its last tests, rather than after every other test. A timeline of the
#      session follows the durations table (ops/test_timeline.py).
# Any step that fails stops the rest (a background step is waited for first) and the script
# exits with its status. Not root: no sandbox host unless one already answers at DOCKER_HOST
# (ops/sandbox/with_sandbox.sh says what was skipped), no images, no compose test.
# Environment (set by the Makefile): VENV, TEST_WORKERS, PYTEST_ARGS, CONFIG.
set -uo pipefail
cd "$(dirname "$0")/.."
# Modules compile once into __pycache__ and are read from there after (the Makefile says
# why: with PYTHONDONTWRITEBYTECODE set, every process compiled all it imported).
unset PYTHONDONTWRITEBYTECODE

VENV=${VENV:-.venv}
PY=$VENV/bin/python
TEST_WORKERS=${TEST_WORKERS:-2}
PYTEST_ARGS=${PYTEST_ARGS:-}
LOGS=build/logs
mkdir -p "$LOGS"
T0=$SECONDS
ROOT=0
[ "$(id -u)" = 0 ] && ROOT=1

say() { echo "make test: $* (at $((SECONDS - T0)) s)"; }
fail() { # fail STATUS WHAT: waits for background steps, then exits
  say "FAILED: $2 (exit $1)"
  [ -n "${bg:-}" ] && wait "$bg" 2>/dev/null
  [ -n "${warm:-}" ] && wait "$warm" 2>/dev/null
  exit "$1"
}
show() { # show LOG: a background step's log, indented
  sed 's/^/  | /' "$1"
}

# 1. The venv, ruff and mypy; the sandbox host beside them.
bg=""
if [ $ROOT = 1 ]; then
  ops/sandbox/setup_host.sh >"$LOGS/sandbox-host.log" 2>&1 &
  bg=$!
fi
make --no-print-directory "VENV=$VENV" "$VENV/.installed" || fail $? "the virtual environment"
say "venv ready"
# The default config's warm start, trained into the tests' persistent model cache beside ruff,
# mypy and the sandbox host (ops/prewarm.py; a cache hit when it is there already). Not a
# step that can fail the run: a test that needs it trains it (or waits on its lock).
MODEL_CACHE=${STREAMRL_TEST_MODEL_CACHE-$PWD/build/model-cache}
JAX_CACHE=${STREAMRL_TEST_JAX_CACHE-$PWD/build/jax-cache}
warm=""
if [ -n "$MODEL_CACHE" ]; then
  (
    if [ -n "$JAX_CACHE" ]; then
      export JAX_COMPILATION_CACHE_DIR=$JAX_CACHE JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
    fi
    exec "$PY" ops/prewarm.py "${CONFIG:-configs/tiny.toml}" "$MODEL_CACHE"
  ) >"$LOGS/prewarm.log" 2>&1 &
  warm=$!
fi
"$VENV/bin/ruff" format --check . || fail $? "ruff format --check"
"$VENV/bin/ruff" check . || fail $? "ruff check"
"$VENV/bin/mypy" || fail $? "mypy"
say "ruff and mypy passed"
# The documentation site, strict (mkdocs.yml): a broken link or anchor fails the run. Built
# into a scratch directory; tests/unit/test_docs.py checks docs/config.md against the schema.
# Not --quiet: mkdocs 1.6 then neither prints nor counts the warnings that --strict fails on.
site=$(mktemp -d)
"$VENV/bin/mkdocs" build --strict --site-dir "$site" || fail $? "mkdocs build --strict"
rm -rf "$site"
say "the docs site built (mkdocs build --strict)"
if [ $ROOT = 1 ]; then
  wait "$bg"
  rc=$?
  bg=""
  show "$LOGS/sandbox-host.log"
  if [ $rc != 0 ]; then
    # with_sandbox.sh tries again and decides: an error under STREAMRL_REQUIRE_SANDBOX=1
    # (CI), else the sandbox tests skip and it says why
    say "the sandbox host could not be readied (exit $rc)"
  else
    export STREAMRL_SANDBOX_HOST_READY=1
    say "sandbox host ready"
  fi
fi

# 2. pytest; as root the compose stack's images and secrets are built beside it, and the
# compose tests run in the same pytest session, last (tests/compose/conftest.py waits for
# the images: the build writes its exit status to STREAMRL_IMAGES_READY when it ends).
MARKS="not slow"
if [ $ROOT = 1 ]; then
  export STREAMRL_IMAGES_READY=$PWD/$LOGS/images.ready
  rm -f "$STREAMRL_IMAGES_READY"
  (
    VENV=$VENV ops/images/build.sh &&
      make --no-print-directory "VENV=$VENV" ${CONFIG:+"CONFIG=$CONFIG"} compose-secrets
    rc=$?
    printf '%s %s\n' "$rc" "$PWD/$LOGS/images.log" >"$STREAMRL_IMAGES_READY"
    exit $rc
  ) >"$LOGS/images.log" 2>&1 &
  bg=$!
  MARKS="not slow or compose"
  export CONTAINERS_CONF=${CONTAINERS_CONF:-/etc/streamrl/containers.conf}
  export STREAMRL_SECRETS=$PWD/${COMPOSE_SECRETS:-build/compose-secrets}
fi
# The test timeline (tests/conftest.py): where the wall time went, printed after the
# durations table whether pytest passed or not.
export STREAMRL_TEST_TIMELINE=$PWD/$LOGS/timeline
rm -rf "$STREAMRL_TEST_TIMELINE"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
ops/sandbox/with_sandbox.sh "$PY" -m pytest -m "$MARKS" -n "$TEST_WORKERS" --dist worksteal \
  --durations=30 $PYTEST_ARGS
rc=$?
"$PY" ops/test_timeline.py "$STREAMRL_TEST_TIMELINE" || true
unset STREAMRL_TEST_TIMELINE
if [ -n "$warm" ]; then
  wait "$warm" || say "the warm start ahead of the tests failed (the tests trained it):" \
    "$(tail -1 "$LOGS/prewarm.log")"
  warm=""
fi
if [ -n "$bg" ]; then
  wait "$bg"
  brc=$?
  bg=""
  if [ $brc != 0 ]; then
    show "$LOGS/images.log"
    fail $brc "the compose images or secrets (above)"
  fi
fi
[ $rc = 0 ] || fail $rc "pytest"
if [ $ROOT = 0 ]; then
  say "pytest passed"
  echo "make test: the compose test was SKIPPED (it needs root: make compose-test)"
  exit 0
fi
say "all passed (the compose tests with the rest)"
