# Sourced by ops/sandbox/setup_host.sh and ops/images/build.sh: one way to get a Debian
# rootfs tarball, built by debootstrap once and cached (nothing is pulled from a registry).
#   cached_rootfs INCLUDE TARBALL   # debootstrap bookworm minbase + INCLUDE (comma list)
# Needs $CACHE (a directory) and $MIRROR (a Debian mirror URL); debootstrap's log goes to
# TARBALL.log and its last lines to stderr when it fails.

cached_rootfs() {
  local include=$1 tarball=$2 boot
  [ -f "$tarball" ] && return 0
  mkdir -p "$CACHE"
  boot=$(mktemp -d "$CACHE/debootstrap.XXXXXX")
  debootstrap --variant=minbase --include="$include" bookworm "$boot" "$MIRROR" \
    >"$tarball.log" 2>&1 || {
    tail -20 "$tarball.log" >&2
    rm -rf "$boot"
    return 1
  }
  # What neither a sandbox nor a worker needs: package caches, docs, man pages, locales.
  rm -rf "$boot"/var/cache/apt/* "$boot"/var/lib/apt/lists/* "$boot"/usr/share/doc \
    "$boot"/usr/share/man "$boot"/usr/share/locale "$boot"/usr/share/info
  tar -C "$boot" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
  rm -rf "$boot"
}
