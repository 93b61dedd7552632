#!/usr/bin/env bash
# Makes a real kube-apiserver (+ kube-controller-manager) and etcd available for the
# Kubernetes tests. No kube-apiserver binary is packaged for Debian, so it is built once from
# Debian's `kubernetes` source package (1.20.2, Go dependencies vendored) with Debian's Go,
# offline, and cached outside the clone (~9 min cold on 2 cores, then instant).
#
# Prints the directory holding kube-apiserver on its last line of stdout.
set -euo pipefail

CACHE=${TANDEM_KUBE_CACHE:-/var/cache/tandem/kube-1.20.2}
BIN=$CACHE/bin

need_apt=()
command -v go >/dev/null || need_apt+=(golang-go)
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v rsync >/dev/null || need_apt+=(rsync)
command -v jq >/dev/null || need_apt+=(jq)
command -v openssl >/dev/null || need_apt+=(openssl)  # the tests' service-account key pair
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "ensure-kube: apt-get install ${need_apt[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >&2
fi

if [ -x "$BIN/kube-apiserver" ] && [ -x "$BIN/kube-controller-manager" ]; then
    echo "$BIN"
    exit 0
fi

echo "ensure-kube: building kube-apiserver from Debian's kubernetes source (~9 min, once)" >&2
WORK=$(mktemp -d /var/tmp/tandem-kube-build.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/parts" "$WORK/lists"
# A private deb-src list, so the system's apt sources stay as they are.
printf 'Types: deb-src\nURIs: http://deb.debian.org/debian\nSuites: bookworm bookworm-updates\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    > "$WORK/parts/src.sources"
APTO=(-o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$WORK/parts"
      -o "Dir::State::Lists=$WORK/lists")
apt-get "${APTO[@]}" update -qq >&2
(cd "$WORK" && apt-get "${APTO[@]}" source --download-only kubernetes >&2)
tar xzf "$WORK"/kubernetes_*.orig.tar.gz -C "$WORK"
SRC=$(find "$WORK" -maxdepth 1 -type d -name 'kubernetes-*' | head -1)
mkdir -p "$SRC/.go/src/k8s.io"
ln -s ../../.. "$SRC/.go/src/k8s.io/kubernetes"
(cd "$SRC" && GOPATH=$SRC/.go CGO_ENABLED=0 GOPROXY=off HOME=$WORK \
    GOCACHE=$WORK/gocache make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" >&2)
mkdir -p "$BIN.tmp"
cp "$SRC"/_output/bin/kube-apiserver "$SRC"/_output/bin/kube-controller-manager "$BIN.tmp/"
rm -rf "$BIN" && mv "$BIN.tmp" "$BIN"
echo "$BIN"
