#!/usr/bin/env bash
# Build native llama.cpp (the peer a CPU user runs: llama-bench, llama-cli, llama-speculative-simple, llama-server,
# llama-perplexity)
# from the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp, once, into a cache folder; print where the binaries are.
# Not part of `make setup` or CI (~9 min on 2 cores). `specserve bench spec --llamacpp` finds them there.
#
#   scripts/build-llamacpp.sh            build (or reuse) and print the bin folder
#   LLAMACPP_NATIVE=OFF scripts/...      a portable build (-DGGML_NATIVE=OFF), e.g. where the native one dies
#   LLAMACPP_AMX=OFF scripts/...         native, without llama.cpp's AMX kernels (-mno-amx-*): on the Sapphire Rapids
#                                        machines of this project they crash in prompt processing (SIGSEGV in
#                                        ggml_backend_amx_mul_mat, ggml-org/llama.cpp#20824); decoding alone runs
#
# The flags are recorded beside the binaries (build-info.txt) and in every bench JSON that uses them.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36
NATIVE="${LLAMACPP_NATIVE:-ON}"
AMX="${LLAMACPP_AMX:-ON}"
SUFFIX=""
[ "$AMX" = "OFF" ] && SUFFIX="-noamx"
ROOT="${SPECSERVE_CACHE:-$HOME/.cache/specserve}/llamacpp/$VERSION-native-$NATIVE$SUFFIX"
BIN="$ROOT/build/bin"
TARGETS=(llama-bench llama-cli llama-speculative-simple llama-server llama-perplexity)
all_built() { local t; for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }
if [ -f "$ROOT/build-info.txt" ] && all_built; then
  echo "llama.cpp (native=$NATIVE) already built: $BIN" >&2
  echo "$BIN"
  exit 0
fi
mkdir -p "$ROOT"
PIP="${PIP:-.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"
if [ ! -d "$ROOT/src/vendor/llama.cpp" ]; then
  echo "fetching the llama-cpp-python $VERSION sdist (pip; the package registry is the only network)" >&2
  rm -rf "$ROOT/sdist" "$ROOT/src"
  $PIP download --quiet --no-deps --no-binary llama-cpp-python --dest "$ROOT/sdist" "llama-cpp-python==$VERSION"
  mkdir -p "$ROOT/src"
  tar -xzf "$ROOT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$ROOT/src" --strip-components=1
fi
FLAGS=(-DGGML_NATIVE="$NATIVE" -DGGML_OPENMP=ON -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
       -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release)
if [ "$AMX" = "OFF" ]; then
  FLAGS+=("-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
          "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
echo "configuring: cmake ${FLAGS[*]}" >&2
cmake -S "$ROOT/src/vendor/llama.cpp" -B "$ROOT/build" "${FLAGS[@]}" > "$ROOT/cmake-configure.log" 2>&1 \
  || { tail -30 "$ROOT/cmake-configure.log" >&2; exit 1; }
# an earlier build's targets are up to date: cmake builds only what is missing (a target added to TARGETS since)
echo "building ${TARGETS[*]} with $(nproc) jobs (~9 min on 2 cores from scratch); log: $ROOT/cmake-build.log" >&2
cmake --build "$ROOT/build" -j"$(nproc)" --target "${TARGETS[@]}" > "$ROOT/cmake-build.log" 2>&1 \
  || { tail -30 "$ROOT/cmake-build.log" >&2; exit 1; }
COMMIT="$(grep -m1 -oE 'LLAMA_BUILD_COMMIT[^)]*' "$ROOT/build/common/build-info.cpp" 2>/dev/null || true)"
{
  echo "llama-cpp-python sdist: $VERSION"
  echo "llama.cpp build: $("$BIN/llama-cli" --version 2>&1 | grep -m1 -i 'version' || echo unknown)"
  echo "cmake flags: ${FLAGS[*]}"
  echo "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) ${COMMIT}"
} > "$ROOT/build-info.txt"
echo "llama.cpp built: $BIN" >&2
echo "$BIN"
