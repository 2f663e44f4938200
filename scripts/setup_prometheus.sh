#!/bin/sh
# Prometheus and promtool for tests/test_prometheus.py (`make setup`, `make prometheus`):
# Debian's `prometheus` package when they are missing and this user can install it;
# otherwise a line saying what to install, and setup carries on (those tests skip).
set -eu

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    echo "prometheus: $(command -v prometheus), promtool: $(command -v promtool)"
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "prometheus/promtool not found, and installing needs root and apt-get: install" \
        "Debian's or Ubuntu's 'prometheus' package (apt-get install prometheus), or put" \
        "Prometheus 2.x's prometheus and promtool on PATH; tests/test_prometheus.py skips" \
        "until then" >&2
    exit 0
fi

# the package's post-install starts a daemon on :9090; the tests start Prometheus
# servers of their own, so stop one that this install started (and only that one)
running_before=$(pgrep -x prometheus || true)
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus
if [ -z "$running_before" ] && pgrep -x prometheus >/dev/null; then
    invoke-rc.d prometheus stop || service prometheus stop || systemctl stop prometheus || true
fi
if [ -z "$running_before" ] && pgrep -x prometheus >/dev/null; then
    echo "warning: the prometheus package left a daemon running (pgrep -x prometheus)" >&2
fi
echo "prometheus: $(prometheus --version 2>&1 | head -n 1)"
