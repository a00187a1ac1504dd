#!/usr/bin/env bash
# Build the local base image the compose test stands on, with no image registry:
# debootstrap Debian bookworm, add Python, PostgreSQL 15 and Redis from Debian's packages,
# and `docker import` the tree. The app image, the test's Postgres and its Redis all build FROM it.
# Idempotent: an image already labelled with this script's hash is kept.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
image="${1:-toolledger-test/base:bookworm}"
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
hash="$(sha256sum "$here/base-image.sh" | cut -c1-16)"

if [ "$(docker image inspect -f '{{index .Config.Labels "toolledger.base"}}' "$image" 2>/dev/null)" = "$hash" ]; then
  echo "base image $image is current ($hash)"
  exit 0
fi

root="$(mktemp -d /var/tmp/toolledger-base.XXXXXX)"
chmod 755 "$root"  # it becomes the image's /: mktemp's 0700 would lock out every non-root user
log="$root.log"
cleanup() {
  # debootstrap mounts /proc and /sys in the tree; never delete through a mount
  { grep -o " $root/[^ ]*" /proc/mounts || true; } | sort -r | while read -r m; do umount -l "$m" || true; done
  rm -rf --one-file-system "$root" "$log"
}
trap cleanup EXIT
echo "debootstrap bookworm into $root"
quiet() { "$@" >>"$log" 2>&1 || { tail -n 30 "$log"; echo "failed: $*" >&2; exit 1; }; }
quiet debootstrap --variant=minbase bookworm "$root" "$mirror"
# Services must not start inside the chroot while their packages install.
printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"
chmod +x "$root/usr/sbin/policy-rc.d"
quiet chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
  python3 python3-venv ca-certificates postgresql-15 redis-server gosu procps
# The host's trust store: where the machine reaches PyPI through a proxy of its own, so must pip.
cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
quiet chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root/usr/sbin/policy-rc.d"
# The package made a cluster we do not use: the entrypoint makes its own, like the official image.
rm -rf "$root"/var/lib/postgresql/15/main "$root"/etc/postgresql/15/main
tar -C "$root" -c . | docker import \
  -c "LABEL toolledger.base=$hash" \
  -c 'ENV PATH=/usr/lib/postgresql/15/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  - "$image" >/dev/null
echo "base image $image built ($hash)"
