#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the pinned llama-cpp-python sdist (issue 45, item 1).
#
# Optional step: the bench's `llamacpp` preset runs this binary as a peer over its HTTP API.
# Builds only the llama-server target (cmake, Release, CPU only, no CURL / OpenSSL / web UI
# download, static libs), cached outside the repo; a second run prints the cached path at once.
#
#   scripts/build_llama_server.sh            # builds if needed, prints the binary's path last
#   JOBS=1 scripts/build_llama_server.sh     # fewer compile jobs (default 2)
#   LCPP_SDIST=/path/llama_cpp_python-0.3.36.tar.gz scripts/build_llama_server.sh
#
# Without LCPP_SDIST the sdist is taken from the cache, else fetched from PyPI with
# `pip download llama-cpp-python==0.3.36 --no-binary :all: --no-deps`; either way its sha256
# must match the pinned one below. The build uses GGML_NATIVE (the host's instruction set), so
# the cache key includes the host's CPU model name. The cache folder is Outrider's
# ($OUTRIDER_CACHE_DIR, or $OUTRIDER_CACHE, else ~/.cache/outrider), where the bench looks for it.
# Measured on an Intel Xeon Ice Lake, 2 cores shared with other jobs (load 8-13): about 42 min.
set -euo pipefail

VERSION="0.3.36"
SHA256="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
JOBS="${JOBS:-2}"

cpu_key() {
    local name
    name="$(grep -m1 'model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- || true)"
    name="${name:-unknown}"
    printf '%s' "$name" | sha256sum | cut -c1-12
}

CACHE_ROOT="${OUTRIDER_CACHE_DIR:-${OUTRIDER_CACHE:-$HOME/.cache/outrider}}/llama-server/${VERSION}-$(cpu_key)"
BIN="$CACHE_ROOT/build/bin/llama-server"

if [[ -x "$BIN" ]]; then
    echo "$BIN"
    exit 0
fi

mkdir -p "$CACHE_ROOT"
TARBALL="$CACHE_ROOT/llama_cpp_python-${VERSION}.tar.gz"

if [[ ! -f "$TARBALL" ]]; then
    if [[ -n "${LCPP_SDIST:-}" ]]; then
        cp "$LCPP_SDIST" "$TARBALL.part"
    else
        dl="$CACHE_ROOT/download"
        mkdir -p "$dl"
        python3 -m pip download "llama-cpp-python==${VERSION}" --no-binary :all: --no-deps \
            --dest "$dl" >&2
        cp "$dl/llama_cpp_python-${VERSION}.tar.gz" "$TARBALL.part"
    fi
    got="$(sha256sum "$TARBALL.part" | cut -d' ' -f1)"
    if [[ "$got" != "$SHA256" ]]; then
        rm -f "$TARBALL.part"
        echo "build_llama_server: sdist sha256 $got does not match the pinned $SHA256" >&2
        exit 1
    fi
    mv "$TARBALL.part" "$TARBALL"
fi

SRC="$CACHE_ROOT/src/llama_cpp_python-${VERSION}/vendor/llama.cpp"
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    mkdir -p "$CACHE_ROOT/src"
    tar -xzf "$TARBALL" -C "$CACHE_ROOT/src"
fi

cmake -S "$SRC" -B "$CACHE_ROOT/build" \
    -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON \
    -DGGML_CUDA=OFF -DGGML_METAL=OFF -DGGML_VULKAN=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON >&2
nice -n 10 cmake --build "$CACHE_ROOT/build" --config Release --target llama-server -j "$JOBS" >&2

if [[ ! -x "$BIN" ]]; then
    echo "build_llama_server: the build finished but $BIN is missing" >&2
    exit 1
fi
echo "$BIN"
