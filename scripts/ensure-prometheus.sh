#!/usr/bin/env bash
# Makes Prometheus and promtool available for the metrics tests (`promtool check metrics`
# on each service's /metrics; a real Prometheus server scraping a `tandem up` cluster).
# Installs Debian's `prometheus` package (2.42; the package does not start the server) once,
# if `promtool` is missing; otherwise does nothing.
#
# Prints promtool's path on its last line of stdout.
set -euo pipefail

if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    echo "ensure-prometheus: apt-get install prometheus" >&2
    DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >&2
fi
if ! promtool --version >/dev/null 2>&1; then
    echo "ensure-prometheus: no working promtool" >&2
    exit 1
fi
command -v promtool
