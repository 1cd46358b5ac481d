#!/usr/bin/env bash
# Creates (or reuses) the separate venv in which SGLang 0.5.23's own DSA hierarchical-cache code
# runs on a CPU-only machine, for tests/integration/sglang. Prints one line on stdout, last: the
# absolute path of the venv's python. Everything else goes to stderr, and pip runs quiet.
#
#   PY="$(bash .ci/sglang-env.sh)" && "$PY" -m pytest -q tests/integration/sglang
#
# The venv lives outside the repository: ${DSA_SGLANG_VENV:-$HOME/.cache/dsa_async/sglang-venv}.
# A complete venv is reused at once: two stamp files record what was installed (a hash of the
# requirement lists below, and a hash of this checkout's path and pyproject.toml for the
# editable install), so a changed list rebuilds the venv and a moved or changed checkout only
# reinstalls the project.
#
# Never installed: sglang's own dependency list (it pins a CUDA torch, torchvision, flashinfer,
# sgl-kernel ...; sglang goes in with --no-deps) and torchvision (its wheel would replace the
# CPU torch; the tests stub it, see tests/integration/sglang/cpu_shims.py).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# HOME may be unset in a bare CI environment (set -u): fall back to the account's home.
home="${HOME:-$(getent passwd "$(id -u)" | cut -d: -f6)}"
VENV="$(realpath -m "${DSA_SGLANG_VENV:-$home/.cache/dsa_async/sglang-venv}")"
BASE_PYTHON="${PYTHON:-python3}"

# The CPU build of torch; this machine keeps its wheel locally, so it installs fast. Every later
# install runs under a constraints file pinning it, so nothing swaps in a CUDA build.
TORCH_REQ="torch==2.13.0"
SGLANG_REQ="sglang==0.5.23"
# What importing SGLang's cache modules needs (pool_host.*, memory_pool, l2_transfer,
# managers.cache_controller, hybrid_cache.*, unified_radix_cache, registry, server_args,
# configs.model_config, managers.tp_worker/schedule_batch, the "file" L3 backend): each of these
# is imported unconditionally somewhere on that import graph (checked one by one: hiding any of
# them makes the import fail). triton is the big one (~1 GB): sglang.srt.utils.common imports it
# at module level. Versions pinned where sglang 0.5.23's own metadata pins them.
IMPORT_REQS=(
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec triton pydantic
    pyzmq tqdm ipython aiohttp dill gguf partial-json-parser setproctitle einops "uvicorn>=0.51"
    fastapi "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1"
    "compressed-tensors==0.18.0" "apache-tvm-ffi==0.1.11" "openai==2.8.0"
)

log() { echo "sglang-env: $*" >&2; }

PY="$VENV/bin/python"
ENV_STAMP="$VENV/.dsa-async-env-stamp"
PROJECT_STAMP="$VENV/.dsa-async-project-stamp"

env_hash="$(
    {
        "$BASE_PYTHON" -c 'import sys; print(sys.version_info[:2])'
        printf '%s\n' "$TORCH_REQ" "$SGLANG_REQ" "${IMPORT_REQS[@]}"
    } | sha256sum | cut -d' ' -f1
)"
project_hash="$({ echo "$REPO"; cat "$REPO/pyproject.toml"; } | sha256sum | cut -d' ' -f1)"

stamp_is() { [ -f "$1" ] && [ "$(cat "$1")" = "$2" ]; }

# SGLang's "file" L3 backend compiles a small C++ extension (hicache_hash_cpp) on first use:
# it needs a C++ compiler and the OpenSSL headers (0.5.23 has no Python fallback).
if ! command -v g++ >/dev/null 2>&1 || [ ! -f /usr/include/openssl/sha.h ]; then
    log "installing g++ and libssl-dev (SGLang's file backend builds an extension with them)"
    as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi; }
    export DEBIAN_FRONTEND=noninteractive
    as_root apt-get update -qq >&2
    as_root apt-get install -y -qq --no-install-recommends g++ libssl-dev >/dev/null
fi

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # two runs at once would install into the same venv

if [ -x "$PY" ] && stamp_is "$ENV_STAMP" "$env_hash" && stamp_is "$PROJECT_STAMP" "$project_hash"; then
    echo "$PY"
    exit 0
fi

export PIP_DISABLE_PIP_VERSION_CHECK=1
pip_install() {
    # sglang is installed without its dependencies on purpose: skip pip's report of them.
    "$PY" -m pip install -q --no-warn-conflicts -c "$VENV/constraints.txt" "$@" >&2
}

if ! [ -x "$PY" ] || ! stamp_is "$ENV_STAMP" "$env_hash"; then
    log "building $VENV (torch CPU, $SGLANG_REQ, its import-time packages; a few minutes) ..."
    rm -rf "$VENV"
    "$BASE_PYTHON" -m venv "$VENV" >&2
    {
        echo "$TORCH_REQ"
        # Nothing here needs torchvision; if anything ever asks for it, fail instead of
        # letting its wheel replace the CPU torch.
        echo "torchvision<0"
    } >"$VENV/constraints.txt"
    pip_install "$TORCH_REQ"
    pip_install --no-deps "$SGLANG_REQ"
    pip_install "${IMPORT_REQS[@]}"
    if ! "$PY" -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then
        log "the venv's torch is a CUDA build; this script expects the CPU wheel of $TORCH_REQ"
        exit 1
    fi
    echo "$env_hash" >"$ENV_STAMP"
    rm -f "$PROJECT_STAMP"
fi

log "installing this checkout ($REPO) with its test extras into $VENV ..."
pip_install -e "$REPO[test]"
echo "$project_hash" >"$PROJECT_STAMP"

echo "$PY"
