#!/bin/sh
# Builds a python:3.11 base image from Debian bookworm's own packages, for a machine that reaches
# Debian's mirror and PyPI but no image registry: `docker build --build-arg BASE=<the tag printed>`.
#
# usage: docker/base-image.sh [TAG]   (default reshard-base:bookworm; needs root, debootstrap and docker)
#
# The image trusts what this host trusts (its /etc/ssl/certs bundle), so pip inside a build reaches
# PyPI through whatever TLS proxy the host itself goes through, and it finds the wheels the host's pip
# finds on disk (the folders of PIP_FIND_LINKS, copied to /opt/wheels), such as a CPU build of torch.
set -eu
TAG=${1:-reshard-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ROOTFS=$(mktemp -d /tmp/reshard-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
# minbase: dpkg, apt and essentials only; python3 is 3.11 on bookworm; python3-venv brings ensurepip.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR" >/dev/null
cp /etc/ssl/certs/ca-certificates.crt "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
rm -rf "$ROOTFS/var/cache/apt/archives/"*.deb "$ROOTFS/var/lib/apt/lists/"*
# python:3.11-slim's `python` and pip's use of the system trust store, as the Dockerfile expects.
ln -sf python3 "$ROOTFS/usr/bin/python"
set -- -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    -c 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]'
for dir in ${PIP_FIND_LINKS:-}; do
    if [ -d "$dir" ]; then
        mkdir -p "$ROOTFS/opt/wheels" && find "$dir" -maxdepth 1 -name '*.whl' -exec cp {} "$ROOTFS/opt/wheels/" \;
    fi
done
if [ -d "$ROOTFS/opt/wheels" ]; then
    set -- "$@" -c 'ENV PIP_FIND_LINKS=/opt/wheels'
fi
tar -C "$ROOTFS" -c . | docker import "$@" - "$TAG" >/dev/null
echo "$TAG"
