#!/usr/bin/env bash
# The GPU checks and benchmarks in one call, for a session lent a device (under 8 minutes):
#
#   run(command="bash benchmarks/gpu_check.sh", timeout_s=540)          # the device tool
#   bash benchmarks/gpu_check.sh [--quick]                              # any CUDA machine
#
# 1. the GPU tests: the kernels (Triton against the reference, sliding windows and LoRA included),
#    the engine against transformers (every family, fp32) on CUDA;
# 2. bench_decode_step on Llama-3.1-8B's layer shapes (bf16): transformers' modules against
#    kvroute's decoder with CUDA graphs, batch 1/16/64/128, with GPU kernel time and
#    launches per step (GPU_CHECK_IMPLS=transformers,kvroute-eager,kvroute adds the decoder
#    without graphs, one more model load);
# 3. bench_kv_load on the same shapes (issue 38): a 2,048-token prefix loaded back from the
#    host tier against its recompute, and 16 sequences' decode steps while it loads.
# Everything is printed; paste it into BENCHMARKS.md ("Engine speed") with the card's name.
#
# The device machine reaches no package registry. It has a CUDA torch and transformers;
# kvroute itself is imported from a folder of links (nothing installed), and the few
# small wheels it lacks (msgspec, pyzmq, cbor2, xxhash) are installed from ./wheels when
# carried there: `pip download --only-binary=:all: --python-version 3.X --dest wheels
# msgspec pyzmq cbor2 xxhash` here first, with the device's Python version.
set -uo pipefail
cd "$(dirname "$0")/.."
QUICK=${1:-}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python - <<'PY'
import sys, torch
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())
PY

missing=$(python - <<'PY'
import importlib.util
print(" ".join(m for m in ("msgspec", "zmq", "cbor2", "xxhash", "transformers", "triton")
               if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  say "missing: $missing"
  if [ -d wheels ]; then
    python -m pip install -q --no-index --find-links wheels msgspec pyzmq cbor2 xxhash || true
  fi
fi

# kvroute.* from this tree without installing it: a folder whose kvroute/ links the packages.
site=$(mktemp -d)
mkdir -p "$site/kvroute"
for pkg in events replica kernels router sim deploy bench; do ln -s "$PWD/$pkg" "$site/kvroute/$pkg"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
python -c "import kvroute.kernels, kvroute.replica; print('kvroute imports from', kvroute.kernels.__file__)" || exit 1

say "GPU tests"
timeout 200 python -m pytest -q -x -p no:cacheprovider \
  tests/kernels/test_triton.py tests/kernels/test_sliding_window.py tests/kernels/test_lora_triton.py \
  tests/replica/test_cuda_graphs.py tests/replica/test_model_families.py \
  tests/replica/test_engine_vs_transformers.py tests/replica/test_kv_tiers.py 2>&1 | tail -15

say "decode step, llama-8b shapes, bf16"
steps=30
batches=1,16,64,128
impls=${GPU_CHECK_IMPLS:-transformers,kvroute}  # each loads the 8B model once (~30-60 s)
[ "$QUICK" = "--quick" ] && steps=10 && batches=1,64
timeout 240 python benchmarks/bench_decode_step.py --model llama-8b --batch "$batches" \
  --steps "$steps" --profile --impl "$impls" 2>&1 | grep -E '^(\||#)|Error|error'

say "KV host tier: load against recompute, decode beside the load (llama-8b shapes, bf16)"
timeout 120 python benchmarks/bench_kv_load.py --model llama-8b --prefix 2048 --decoders 16 \
  --steps 20 2>&1 | grep -vE '^(Loading|writing)'
say "done"
