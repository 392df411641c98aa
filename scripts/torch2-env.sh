#!/usr/bin/env bash
# A Debian chroot with a newer LibTorch (trixie: 2.6 by default, sid: 2.14 on request), created once
# and cached outside the source tree, and a way to run a command inside it with this tree mounted.
#
#   scripts/torch2-env.sh [--release trixie|sid] [--] [command ...]
#
# Without a command it only creates (or checks) the chroot. With one, it runs the command as root
# inside the chroot, in the source tree mounted at /src, with USE_LIBUV=0 (Debian builds PyTorch
# without libuv). Mounts live in a private mount namespace, so nothing is left mounted afterwards,
# even if the command is killed.
#
#   FSDP_CHROOT_CACHE  where chroots live (default: /var/cache/fsdp-cpp); one folder per release
#
# Idempotent: a chroot is complete only once its marker file records the package list it holds;
# an interrupted creation is detected and finished, never trusted half-made.
set -euo pipefail

RELEASE=trixie
while (($#)); do
  case "$1" in
    --release) RELEASE="$2"; shift 2 ;;
    --release=*) RELEASE="${1#*=}"; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) break ;;
  esac
done
case "$RELEASE" in trixie|sid) ;; *) echo "torch2-env: unsupported release '$RELEASE' (trixie or sid)" >&2; exit 2 ;; esac

SRC=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${FSDP_CHROOT_CACHE:-/var/cache/fsdp-cpp}
ROOT="$CACHE/$RELEASE"
MARKER="$ROOT/.fsdp-cpp-ready"
PACKAGES=(cmake g++ make ccache libtorch-dev libgloo-dev libgtest-dev libbenchmark-dev nlohmann-json3-dev libxxhash-dev libcli11-dev libisal-dev
          python3-torch python3-safetensors python3-numpy)
WANT="release=$RELEASE packages=${PACKAGES[*]}"

die() { echo "torch2-env: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (debootstrap, chroot and mount need it)"

# The Debian mirror this machine already uses: never hard-code a host.
mirror() {
  local uri=""
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    uri=$(awk '/^URIs:/ {for (i = 2; i <= NF; i++) if ($i !~ /security/) {print $i; exit}}' \
      /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
    uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /:\/\//) {print $i; exit}}' \
      /etc/apt/sources.list)
  fi
  [ -n "$uri" ] || die "cannot find the Debian mirror in /etc/apt/sources.list{,.d/debian.sources}"
  echo "$uri"
}

create() {
  if ! command -v debootstrap >/dev/null; then
    echo "torch2-env: installing debootstrap"
    apt-get update -qq || die "apt-get update failed: is the Debian registry reachable?"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap \
      || die "cannot install debootstrap from the Debian registry"
  fi
  local uri; uri=$(mirror)
  mkdir -p "$CACHE"
  if [ ! -x "$ROOT/usr/bin/apt-get" ] || [ ! -f "$ROOT/.debootstrap-done" ]; then
    echo "torch2-env: debootstrap $RELEASE into $ROOT (a few minutes, ~2 GB once)"
    rm -rf "$ROOT"
    debootstrap --variant=minbase "$RELEASE" "$ROOT" "$uri" >"$CACHE/$RELEASE-debootstrap.log" 2>&1 \
      || { tail -20 "$CACHE/$RELEASE-debootstrap.log" >&2
           die "debootstrap of $RELEASE from $uri failed (log: $CACHE/$RELEASE-debootstrap.log)"; }
    touch "$ROOT/.debootstrap-done"
  fi
  echo "torch2-env: installing ${PACKAGES[*]} in the $RELEASE chroot"
  # The registry may serve a dated snapshot; sid's Release files expire within days of their
  # date, so expiry is not checked (signatures still are).
  # dpkg --configure -a first: finishes an installation that an earlier run left interrupted.
  in_chroot "" /bin/sh -c "DEBIAN_FRONTEND=noninteractive dpkg --configure -a >/dev/null 2>&1; \
    apt-get -o Acquire::Check-Valid-Until=false update -qq \
    >/var/log/fsdp-cpp-install.log 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends ${PACKAGES[*]} >>/var/log/fsdp-cpp-install.log 2>&1" \
    || { tail -20 "$ROOT/var/log/fsdp-cpp-install.log" >&2 2>/dev/null
         die "installing packages in the $RELEASE chroot failed (is the Debian registry reachable?)"; }
  echo "$WANT" >"$MARKER"
}

# in_chroot SRC_OR_EMPTY CMD...: runs CMD in the chroot in a private mount namespace.
in_chroot() {
  local src="$1"; shift
  cp -L /etc/resolv.conf "$ROOT/etc/resolv.conf" 2>/dev/null || true
  mkdir -p "$ROOT/src"
  unshare --mount --propagation private /bin/bash -s -- "$ROOT" "$src" "$@" <<'EOS'
set -e
root="$1"; src="$2"; shift 2
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/dev/shm" 2>/dev/null || true
mount -t tmpfs tmpfs "$root/tmp"
[ -z "$src" ] || mount --bind "$src" "$root/src"
cd "$root"
exec chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
  USE_LIBUV=0 CI="${CI:-}" CCACHE_DIR=/root/.ccache /bin/bash -c 'cd /src 2>/dev/null || cd /; exec "$@"' \
  in-chroot "$@"
EOS
}

if [ ! -f "$MARKER" ] || [ "$(cat "$MARKER")" != "$WANT" ]; then
  create
fi
(($#)) || { echo "torch2-env: $RELEASE chroot ready at $ROOT"; exit 0; }
in_chroot "$SRC" "$@"
