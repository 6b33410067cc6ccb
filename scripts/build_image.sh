#!/usr/bin/env bash
# Build the container image from the Dockerfile with buildah, where no
# registry of base images is reachable: the Dockerfile's Debian release is
# made from Debian's own packages with debootstrap, imported as the base, and
# passed as BASE; every step after FROM is the Dockerfile's own.
#
#   scripts/build_image.sh VERSION OUT.tar
#
# Writes the image (Docker format: it keeps the HEALTHCHECK) as an archive
# that `podman load` and `docker load` read, tagged fencepost-server:VERSION.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: build_image.sh VERSION OUT.tar}
out=${2:?usage: build_image.sh VERSION OUT.tar}

# the Dockerfile's default base names the Debian release: debian:SUITE-slim
suite=$(sed -n 's/^ARG BASE=debian:\([a-z]*\)-slim$/\1/p' Dockerfile)
[ -n "$suite" ] || { echo "Dockerfile: no 'ARG BASE=debian:SUITE-slim'" >&2; exit 2; }
base=localhost/fencepost-base:$suite
tag=localhost/fencepost-server:$version

# Where the sandbox has no overlay mounts or user namespaces, buildah still
# runs RUN steps with chroot isolation (host network, as root).
build_flags=(--isolation chroot --pull=never --format docker)
# a CA bundle pip is told to trust here (a proxy that re-signs TLS) goes in as a secret
cacert=${PIP_CERT:-${SSL_CERT_FILE:-}}
if [ -n "$cacert" ] && [ -f "$cacert" ]; then
  build_flags+=(--secret "id=cacert,src=$cacert")
fi

if ! buildah inspect --type image "$base" >/dev/null 2>&1; then
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  # minbase: essential packages and apt, as the slim image has
  debootstrap --variant=minbase "$suite" "$rootfs" >&2
  # as the slim image is: no documentation, manuals or translations (dpkg leaves
  # them out of later installs too), no package lists or downloaded packages
  cat > "$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'CFG'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/lintian/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
CFG
  find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  rm -rf "$rootfs"/usr/share/{man,groff,info,lintian,linda}/*
  find "$rootfs/usr/share/locale" -mindepth 1 -maxdepth 1 -not -name locale.alias \
    -exec rm -rf {} +
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/cache/apt/archives/*.deb
  ctr=$(buildah from scratch)
  mnt=$(buildah mount "$ctr")
  tar -C "$rootfs" -cf - . | tar -C "$mnt" -xf -
  buildah umount "$ctr" >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --cmd bash "$ctr"
  buildah commit --quiet --rm "$ctr" "$base" >/dev/null
fi

buildah bud "${build_flags[@]}" --build-arg "BASE=$base" -f Dockerfile -t "$tag" . >&2
rm -f "$out"
buildah push --quiet "$tag" "docker-archive:$out:$tag" >&2
echo "$tag"
