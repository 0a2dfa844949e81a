#!/usr/bin/env bash
# Prepares a Debian 12 host (or CI machine) to run the tool sandboxes, as root:
#   1. packages: podman (serving the Docker API), runc, catatonit (the containers' init),
#      bubblewrap (the fallback backend), debootstrap (builds the image; nothing is pulled),
#      CNI's dnsname plugin (name resolution on the compose stack's network)
#   2. a containers.conf for podman: runc, cgroupfs, default ulimits
#   3. `podman system service` on $STREAMRL_PODMAN_SOCK, unless it already answers /_ping
#   4. the sandbox image, unless podman has it: a minbase Debian with python3 and a
#      non-root user `sandbox` (uid 20001), built by debootstrap; the base rootfs tarball
#      is cached, so only the first run on a machine pays for debootstrap (~30 s)
# Idempotent: a second run takes about a second. Then, for the code and the tests:
#   export DOCKER_HOST=unix:///run/streamrl-podman.sock CONTAINERS_CONF=/etc/streamrl/containers.conf
set -euo pipefail
# shellcheck source=ops/sandbox/rootfs.sh
. "$(dirname "${BASH_SOURCE[0]}")/rootfs.sh"

SOCK=${STREAMRL_PODMAN_SOCK:-/run/streamrl-podman.sock}
CONF=${CONTAINERS_CONF:-/etc/streamrl/containers.conf}
# Bump the tag (and so the cached tarball's name) whenever the image recipe below changes.
IMAGE=${STREAMRL_SANDBOX_IMAGE:-streamrl-sandbox:1}
CACHE=${STREAMRL_CACHE_DIR:-/var/cache/streamrl}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOG=${STREAMRL_PODMAN_LOG:-/var/log/streamrl-podman.log}
PIDFILE=${SOCK%.sock}.pid
SANDBOX_UID=20001  # the calls' uid: no stack process uses it (the images run as 10001)
export CONTAINERS_CONF=$CONF

if [ "$(id -u)" != 0 ]; then
  echo "setup_host.sh: run as root (it installs packages and starts podman)" >&2
  exit 1
fi

t0=$SECONDS
step() { # step NAME: prints how long the previous step took
  echo "setup_host: $1 ($((SECONDS - t0)) s)"
  t0=$SECONDS
}

# 1. Packages. catatonit is what `init=True` runs as PID 1; podman only recommends it.
# dnsname: containers of one compose network reach each other by service name (CNI).
want=(podman runc catatonit bubblewrap debootstrap curl
  golang-github-containernetworking-plugin-dnsname)
missing=()
for p in "${want[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
    >/dev/null
fi
step "packages ready (installed: ${missing[*]:-none})"

# 2. Podman's config. cgroupfs: there is no systemd to manage cgroups in a CI container.
# The file log keeps podman from needing journald. exit_command_delay: each exec's conmon
# lingers this long after the exec ends (default 300 s: at a few calls a second, thousands
# of processes and GBs of memory); the sandbox reads an exec's exit code at once.
mkdir -p "$(dirname "$CONF")"
conf_text='[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]
init_path = "/usr/bin/catatonit"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
exit_command_delay = 5'
conf_changed=0
if [ ! -f "$CONF" ] || [ "$(cat "$CONF")" != "$conf_text" ]; then
  printf '%s\n' "$conf_text" >"$CONF"
  conf_changed=1
fi
step "containers.conf at $CONF"

# 3. The Docker-API service. --time=0: never exit for idleness. A service this script
# started before a config change is restarted to read the new config.
ping() { curl -sf --max-time 2 --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; }
if [ "$conf_changed" = 1 ] && [ -f "$PIDFILE" ] && ping; then
  kill "$(cat "$PIDFILE")" 2>/dev/null || true
  for _ in $(seq 50); do ping || break; sleep 0.1; done
fi
if ! ping; then
  rm -f "$SOCK"
  # From /: conmon writes files (an `oom` marker) into its working directory.
  pushd / >/dev/null
  CONTAINERS_CONF=$CONF setsid nohup podman system service --time=0 "unix://$SOCK" \
    >>"$LOG" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  popd >/dev/null
  for _ in $(seq 100); do
    ping && break
    sleep 0.1
  done
  ping || { echo "podman service did not answer on $SOCK; see $LOG" >&2; exit 1; }
fi
step "podman answering on unix://$SOCK"

# 4. The image. Nothing is pulled: debootstrap fetches .debs from the Debian mirror into a
# base tarball, cached; the sandbox's own layout is added on top each time it is imported.
if ! podman image exists "$IMAGE"; then
  # python3, not python3-minimal: tools and the policy's code need the standard library
  # (json, decimal, dataclasses, ...), which python3-minimal leaves out. python3-venv too:
  # the compose images' base (ops/images/build.sh) is made from the same tarball, so a new
  # machine (CI) runs debootstrap once, not twice (about 40 s of work, 115 s under load).
  include=python3,python3-venv
  base="$CACHE/rootfs-bookworm-minbase-${include//,/-}.tar"
  if [ ! -f "$base" ]; then
    cached_rootfs "$include" "$base" || exit 1
    step "debootstrap base cached at $base"
  fi
  root=$(mktemp -d)
  tar -C "$root" -xf "$base"
  # The calls run as `sandbox`; the container's own processes (init, the keep-alive sleep)
  # run as nobody, so a call can neither signal them nor be signalled by them.
  echo "sandbox:x:$SANDBOX_UID:$SANDBOX_UID:sandbox:/work:/usr/sbin/nologin" >>"$root/etc/passwd"
  echo "sandbox:x:$SANDBOX_UID:" >>"$root/etc/group"
  # Mount point of the workdir tmpfs (the root file system is read-only at run time); podman
  # copies this directory's mode, not its owner, onto the tmpfs: so 1777, like /tmp.
  mkdir -p "$root/work" "$root/opt/streamrl"
  chmod 1777 "$root/work"
  # The per-call wrapper shell. Execute-only (not readable) makes the kernel mark the
  # process non-dumpable, so the call it runs cannot ptrace it or write its memory.
  install -o 0 -g 0 -m 0111 "$root/bin/dash" "$root/opt/streamrl/sh"
  tar -C "$root" -c . | podman import -q \
    --change "USER=65534:65534" \
    --change "WORKDIR=/work" \
    --change "ENV=PATH=/usr/local/bin:/usr/bin:/bin" \
    --change "ENV=LANG=C.UTF-8" \
    --change 'CMD=["/bin/sleep","infinity"]' \
    - "$IMAGE" >/dev/null
  rm -rf "$root"
fi
step "image $IMAGE present"
