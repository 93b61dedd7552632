#!/usr/bin/env bash
# Build Tandem's OCI image without a container registry (none is reachable here):
#   a Debian root filesystem from Debian's packages (mmdebstrap), the project and its pinned
#   dependencies installed offline into a venv inside it (wheels downloaded on the host), a
#   non-root user, OCI labels, committed with buildah and written to dist/ as an OCI archive.
#
#   scripts/build-image.sh [cpu|cuda]            (make image [VARIANT=cpu|cuda])
#   scripts/build-image.sh cpu|cuda packages     the Debian packages of the root filesystem
#   scripts/build-image.sh cuda wheels           the wheels the CUDA image gets, resolved from
#                                                PyPI without downloading them ("name version
#                                                url" lines; tests/deploy/test_image_recipe.py)
#
# The cuda variant is torch 2.13.0 from PyPI, built for CUDA 13 (as is nixl-cu13): its nodes
# need an NVIDIA driver of branch R580 or newer. The image carries no driver; the NVIDIA
# container runtime mounts the node's.
#
# Output: localhost/tandem:<version>-<variant> in buildah's local storage, and
# dist/tandem-<version>-<variant>.oci.tar (push with `skopeo copy oci-archive:... docker://...`).
# The root filesystem and the wheels are cached (/var/cache/tandem/image, pip's cache), so a
# rebuild after a code change only reinstalls the project.
set -euo pipefail
cd "$(dirname "$0")/.."

VARIANT="${1:-cpu}"
STEP="${2:-build}"
case "$VARIANT" in cpu|cuda) ;; *) echo "variant must be cpu or cuda, got $VARIANT" >&2; exit 2;; esac
case "$VARIANT/$STEP" in */build|*/packages|cuda/wheels) ;;
  *) echo "step must be build, packages or (cuda) wheels, got $STEP" >&2; exit 2;; esac
PYTHON="${PYTHON:-.venv/bin/python}"
VERSION="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)"
REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"
IMAGE="localhost/tandem:${VERSION}-${VARIANT}"
CACHE=/var/cache/tandem/image
SUITE=bookworm
# python3 of bookworm is 3.11, the wheels' Python. libibverbs + providers: RDMA for UCX.
PACKAGES=python3,python3-venv,ca-certificates,libgomp1,libibverbs1,ibverbs-providers,librdmacm1
# Triton compiles a small C launcher at its first kernel launch: a C compiler, the C library's
# headers and Python.h (python3-dev: /usr/include/python3.11). Without them warm-up dies.
[ "$VARIANT" = cuda ] && PACKAGES="$PACKAGES,gcc,libc6-dev,python3-dev"
REQUIREMENTS="deploy/image/requirements-${VARIANT}.txt"

log() { echo "[$(date +%T)] $*" >&2; }

if [ "$STEP" = packages ]; then echo "$PACKAGES" | tr , '\n'; exit 0; fi

# pip as PyPI alone sees it: no configuration file and none of the PIP_* variables that say
# where wheels come from (a find-links directory holding torch-2.13.0+cpu would win over
# PyPI's 2.13.0: a local version sorts above the plain one, and an empty PIP_FIND_LINKS= does
# not switch a configured one off). The CA bundle and network settings stay.
pypi_pip() {
  local unset=() name
  for name in $(compgen -e); do
    case "$name" in
      PIP_CERT|PIP_CLIENT_CERT|PIP_PROXY|PIP_DEFAULT_TIMEOUT|PIP_RETRIES|PIP_CACHE_DIR) ;;
      PIP_*) unset+=(-u "$name") ;;
    esac
  done
  env "${unset[@]}" PIP_CONFIG_FILE=/dev/null "$PYTHON" -m pip "$@"
}

# The CUDA image's wheels, resolved for the image's Python (3.11) and glibc (2.36) from PyPI
# metadata alone (nothing downloaded): "name version url" per line. pip does not widen a
# manylinux_2_X platform to older glibc versions, so every one is listed (nvidia-cudnn-cu13
# is manylinux_2_27, nccl manylinux_2_18). nixl requires both flavours; the image keeps
# nixl-cu13, the CUDA 13 one, like torch.
cuda_wheels() {
  local platforms=() v report
  for v in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
  report="$(mktemp)"
  pypi_pip install --quiet --dry-run --ignore-installed --report "$report" \
    --only-binary=:all: --python-version 3.11 --implementation cp "${platforms[@]}" \
    --platform manylinux2014_x86_64 -r "$REQUIREMENTS"
  "$PYTHON" - "$report" <<'PY'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if name != "nixl-cu12":
        print(name, version, item["download_info"]["url"])
PY
  rm -f "$report"
}

if [ "$STEP" = wheels ]; then cuda_wheels; exit 0; fi

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
  # The CUDA build of torch and its nvidia-* runtime wheels and triton, from PyPI alone
  # (several GB; not built in CI): exactly the wheels `cuda_wheels` resolved.
  resolved="$(cuda_wheels)"  # a failed resolution stops the build here (set -e)
  mapfile -t urls < <(cut -d' ' -f3 <<<"$resolved")
  pypi_pip download --quiet --no-deps --dest "$wheels" "${urls[@]}"
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
