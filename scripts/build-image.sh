#!/usr/bin/env bash
# Build Tandem's OCI image without a container registry (none is reachable here):
#   a Debian root filesystem from Debian's packages (mmdebstrap), the project and its pinned
#   dependencies installed offline into a venv inside it (wheels downloaded on the host), a
#   non-root user, OCI labels, committed with buildah and written to dist/ as an OCI archive.
#
#   scripts/build-image.sh [cpu|cuda]      (make image [VARIANT=cpu|cuda])
#
# Output: localhost/tandem:<version>-<variant> in buildah's local storage, and
# dist/tandem-<version>-<variant>.oci.tar (push with `skopeo copy oci-archive:... docker://...`).
# The root filesystem and the wheels are cached (/var/cache/tandem/image, pip's cache), so a
# rebuild after a code change only reinstalls the project.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT="${1:-cpu}"
case "$VARIANT" in cpu|cuda) ;; *) echo "variant must be cpu or cuda, got $VARIANT" >&2; exit 2;; esac
PYTHON="${PYTHON:-.venv/bin/python}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"
IMAGE="localhost/tandem:${VERSION}-${VARIANT}"
CACHE=/var/cache/tandem/image
SUITE=bookworm
# python3 of bookworm is 3.11, the wheels' Python. libibverbs + providers: RDMA for UCX.
PACKAGES=python3,python3-venv,ca-certificates,libgomp1,libibverbs1,ibverbs-providers,librdmacm1
REQUIREMENTS="deploy/image/requirements-${VARIANT}.txt"

log() { echo "[$(date +%T)] $*" >&2; }

if ! command -v mmdebstrap >/dev/null || ! command -v buildah >/dev/null; then
  log "installing mmdebstrap and buildah (Debian)"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    mmdebstrap buildah uidmap >/dev/null
fi
mkdir -p "$CACHE" dist

# 1. Root filesystem, cached by suite + package list.
key="$(echo "$SUITE $PACKAGES" | sha256sum | cut -c1-16)"
rootfs="$CACHE/rootfs-$key.tar"
if [ ! -f "$rootfs" ]; then
  log "debian $SUITE root filesystem: $PACKAGES"
  mmdebstrap --quiet --format=tar --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs.tmp"
  mv "$rootfs.tmp" "$rootfs"
fi

# 2. Wheels on the host: the project, and its dependencies at the pinned versions.
wheels="dist/wheels-$VARIANT"
rm -rf "$wheels" && mkdir -p "$wheels"
log "wheels: the project and $REQUIREMENTS"
"$PYTHON" -m pip wheel --quiet --no-deps --wheel-dir "$wheels" .
if [ "$VARIANT" = cpu ]; then
  # Every pin is in the file (the CPU torch wheel comes from this machine's disk).
  "$PYTHON" -m pip download --quiet --no-deps --dest "$wheels" -r "$REQUIREMENTS"
else
  # The CUDA build of torch brings its nvidia-* runtime wheels: let pip resolve those from
  # PyPI, never from this machine's CPU wheel (several GB; not built in CI).
  PIP_FIND_LINKS= "$PYTHON" -m pip download --quiet --dest "$wheels" \
    --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -r "$REQUIREMENTS"
  rm -f "$wheels"/nixl_cu12-*.whl  # nixl's extra; the image keeps one flavour
fi

# 3. The container: root filesystem, venv, user, config.
ctr="$(buildah from scratch)"
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true' EXIT
mnt="$(buildah mount "$ctr")"
tar -xf "$rootfs" -C "$mnt"
mkdir -p "$mnt/tmp/wheels" && cp "$wheels"/*.whl "$mnt/tmp/wheels/"
echo "tandem:x:10001:10001:tandem:/home/tandem:/usr/sbin/nologin" >>"$mnt/etc/passwd"
echo "tandem:x:10001:" >>"$mnt/etc/group"
mkdir -p "$mnt/home/tandem" && chown 10001:10001 "$mnt/home/tandem"
log "installing into /opt/tandem (offline)"
buildah run --isolation chroot "$ctr" -- sh -c \
  'python3 -m venv /opt/tandem && /opt/tandem/bin/pip install --quiet --no-index --no-deps \
     --no-compile --find-links /tmp/wheels /tmp/wheels/*.whl && rm -rf /tmp/wheels /root/.cache'
# Every requirement met, except the NIXL flavour the CUDA image leaves out on purpose.
problems="$(buildah run --isolation chroot "$ctr" -- /opt/tandem/bin/pip check | grep -v \
  -e 'No broken requirements' -e 'requires nixl-cu12, which is not installed' || true)"
if [ -n "$problems" ]; then echo "$problems" >&2; exit 1; fi
env_args=(--env PATH=/opt/tandem/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
          --env HOME=/home/tandem --env PYTHONUNBUFFERED=1)
if [ "$VARIANT" = cuda ]; then
  # Exactly one NIXL flavour is installed; pin UCX to its modules so it cannot load another's.
  ucx="$(cd "$mnt" && ls -d opt/tandem/lib/python3.11/site-packages/nixl_cu*.libs/ucx | head -1)"
  env_args+=(--env "UCX_MODULE_DIR=/$ucx")
fi
buildah config "${env_args[@]}" \
  --user 10001:10001 --workingdir /home/tandem \
  --entrypoint '["/opt/tandem/bin/tandem"]' --cmd '["up"]' \
  --label org.opencontainers.image.title=tandem \
  --label org.opencontainers.image.version="$VERSION" \
  --label org.opencontainers.image.revision="$REVISION" \
  --label org.opencontainers.image.source=https://github.com/tandem/tandem \
  --label io.tandem.variant="$VARIANT" \
  "$ctr"
buildah unmount "$ctr" >/dev/null
log "commit $IMAGE"
previous="$(buildah images --noheading --format '{{.ID}}' "$IMAGE" 2>/dev/null || true)"
buildah commit --quiet --timestamp "$SOURCE_DATE_EPOCH" "$ctr" "$IMAGE" >/dev/null
# The tag moved to the new image: the one it named (~2.7 GB) would stay behind untagged at
# every build. Remove it unless something still uses it.
current="$(buildah images --noheading --format '{{.ID}}' "$IMAGE")"
if [ -n "$previous" ] && [ "$previous" != "$current" ]; then
  buildah rmi "$previous" >/dev/null 2>&1 || true
fi
archive="dist/tandem-${VERSION}-${VARIANT}.oci.tar"
rm -f "$archive"
buildah push --quiet "$IMAGE" "oci-archive:$archive:$IMAGE"
log "wrote $archive ($(du -h "$archive" | cut -f1)); image $IMAGE"
