#!/usr/bin/env bash
# with_sandbox.sh CMD [ARGS...]: run CMD (the test suite) against the tool sandboxes' host.
#
# As root, readies the host first (setup_host.sh: podman serving the Docker API, the
# sandbox image; about a minute from scratch, a second when present), then runs CMD with
# DOCKER_HOST, CONTAINERS_CONF and STREAMRL_REQUIRE_SANDBOX=1, so a sandbox test that cannot
# run fails instead of skipping. Not root, an engine already answering at $DOCKER_HOST
# counts as ready. Otherwise CMD runs without the sandbox, and the last line printed says
# that the sandbox tests were skipped and why. With STREAMRL_REQUIRE_SANDBOX=1 already set
# (CI), a host that cannot be readied is an error instead. STREAMRL_SANDBOX_HOST_READY=1:
# the caller ran setup_host.sh itself and it succeeded (ops/make_test.sh), so it is not run
# again. Exits with CMD's status.
set -uo pipefail

SOCK=${STREAMRL_PODMAN_SOCK:-/run/streamrl-podman.sock}
CONF=${CONTAINERS_CONF:-/etc/streamrl/containers.conf}
HERE=$(cd "$(dirname "$0")" && pwd)

answers() { # answers URL: the Docker API at unix://PATH replies to /_ping
  local path=${1#unix://}
  [ "$path" != "$1" ] && [ -S "$path" ] &&
    curl -sf --max-time 5 --unix-socket "$path" http://d/_ping >/dev/null 2>&1
}

why=""
if [ "$(id -u)" = 0 ]; then
  if [ "${STREAMRL_SANDBOX_HOST_READY:-}" = 1 ] || "$HERE/setup_host.sh"; then
    export DOCKER_HOST="unix://$SOCK" CONTAINERS_CONF="$CONF"
  else
    why="make sandbox-host (ops/sandbox/setup_host.sh) failed, see its output above"
  fi
elif [ -n "${DOCKER_HOST:-}" ] && answers "$DOCKER_HOST"; then
  : # readied by root before (make sandbox-host) and exported: use it
else
  why="not root and no engine answers at DOCKER_HOST=${DOCKER_HOST:-<unset>}: run"
  why="$why 'sudo make sandbox-host' and export DOCKER_HOST=unix://$SOCK"
  why="$why CONTAINERS_CONF=$CONF, or run 'make test' as root"
fi

if [ -z "$why" ]; then
  export STREAMRL_REQUIRE_SANDBOX=1
  "$@"
  exit $?
fi
if [ "${STREAMRL_REQUIRE_SANDBOX:-}" = 1 ]; then
  echo "with_sandbox.sh: STREAMRL_REQUIRE_SANDBOX=1 but the sandbox host is not ready: $why" >&2
  exit 1
fi
unset STREAMRL_REQUIRE_SANDBOX
"$@"
rc=$?
echo "make test: the sandbox tests were SKIPPED ($why)"
exit $rc
