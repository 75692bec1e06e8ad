#!/usr/bin/env bash
# The GPU checks and benchmarks, for a session lent a device (one call, under 9 minutes:
# each step has its own timeout, so a hung one cannot eat the rest):
#
#   run(command="bash benchmarks/gpu_check.sh all", carry=["wheels"], timeout_s=570)
#   bash benchmarks/gpu_check.sh [all|tests|bench|kv] [--quick]    # any CUDA machine
#
# kv (under 4 minutes): the KV tiers' and transfer plane's CUDA tests, then the KV load and
#    transfer benchmarks below alone: the check to rerun after changing how KV moves.
#
# tests: the GPU tests: the kernels (Triton against the reference, sliding windows and LoRA
#    included), CUDA graphs against eager, the engine against transformers (every family,
#    fp32) and the host KV tier's side stream on CUDA; the whole log goes to
#    $OUT/gpu_tests.log (the device tool brings $OUT back), the summary is printed.
# bench: bench_decode_step on Llama-3.1-8B's layer shapes (bf16): transformers' modules
#    against kvroute's decoder with CUDA graphs, batch 1/16/64/128, with GPU kernel time and
#    launches per step (GPU_CHECK_IMPLS=transformers,kvroute-eager,kvroute adds the decoder
#    without graphs, one more model load); then bench_kv_load on the same shapes (issue 38):
#    a 2,048-token prefix loaded back from the host tier against its recompute, and 16
#    sequences' decode steps while it loads.
# Everything is printed; paste it into BENCHMARKS.md ("Engine speed") with the card's name.
#
# The device machine reaches no package registry. Its python3 has a CUDA torch,
# transformers, triton, peft, pytest and xxhash; kvroute itself is imported from a folder of
# links (nothing installed), and the small wheels it lacks (msgspec, pyzmq, cbor2) are
# installed into that folder from ./wheels, carried there (an ignored folder): first, here,
# `pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
# --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform
# manylinux2014_x86_64 -d wheels msgspec pyzmq cbor2 cryptography cffi pycparser`
# (3.12: the device's Python; cryptography seals the disk tier, cffi and pycparser are its).
set -uo pipefail
cd "$(dirname "$0")/.."
PHASE=all
QUICK=
for arg in "$@"; do
  case "$arg" in
    all|tests|bench|kv) PHASE=$arg ;;
    --quick) QUICK=--quick ;;
    *) echo "usage: $0 [all|tests|bench|kv] [--quick]" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}  # the device's python3 is the one with torch
OUT_DIR=${OUT:-/tmp}
export PYTHONUNBUFFERED=1
t0=$(date +%s)
say() { echo "[gpu_check +$(( $(date +%s) - t0 ))s] $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY - <<'PY'
import sys, torch
versions = []
for name in ("transformers", "triton"):
    try:
        versions.append(f"{name} {__import__(name).__version__}")
    except Exception as exc:  # noqa: BLE001 - reported, not fatal here
        versions.append(f"{name} missing ({type(exc).__name__})")
print("python", sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.cuda.is_available(), *versions)
PY

# kvroute.* from this tree without installing it: a folder whose kvroute/ links the packages.
site=$(mktemp -d)
mkdir -p "$site/kvroute"
for pkg in events replica kernels router sim deploy loadgen; do ln -s "$PWD/$pkg" "$site/kvroute/$pkg"; done
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

missing=$($PY - <<'PY'
import importlib.util
print(" ".join(m for m in ("msgspec", "zmq", "cbor2", "cryptography", "xxhash", "transformers", "triton")
               if importlib.util.find_spec(m) is None))
PY
)
if [ -n "$missing" ]; then
  say "missing: $missing; installing ./wheels into $site"
  if ls wheels/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --target "$site" wheels/*.whl \
      || say "pip install from ./wheels failed"
  else
    say "no ./wheels here: carry it (see the header)"
  fi
fi
$PY -c "import kvroute.kernels, kvroute.replica, kvroute.events; print('kvroute imports from', kvroute.kernels.__file__)" || exit 1

if [ "$PHASE" = kv ]; then
  say "KV tiers and transfer, CUDA tests (log: $OUT_DIR/gpu_kv_tests.log)"
  timeout 100 $PY -m pytest -q -rfE -p no:cacheprovider --timeout 60 \
    tests/replica/kv_tiers/test_block_copies.py tests/replica/kv_tiers/test_kv_tiers.py \
    tests/replica/kv_transfer/test_plane.py tests/replica/kv_transfer/test_prefix_fetch.py \
    > "$OUT_DIR/gpu_kv_tests.log" 2>&1
  say "pytest exit $?"
  grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT_DIR/gpu_kv_tests.log" | tail -30
fi

if [ "$PHASE" = all ] || [ "$PHASE" = tests ]; then
  say "GPU tests (log: $OUT_DIR/gpu_tests.log)"
  # The engine's exactness first; the kernels' many Triton compiles last.
  timeout 240 $PY -m pytest -q -rfE -p no:cacheprovider --timeout 120 \
    --deselect tests/replica/kv_transfer/test_pd_exactness.py::test_smollm2_split_equals_one_engine \
    tests/replica/model/test_engine_vs_transformers.py tests/replica/model/test_model_families.py \
    tests/replica/model/test_cuda_graphs.py tests/replica/kv_tiers/test_kv_tiers.py \
    tests/replica/kv_tiers/test_block_copies.py tests/replica/kv_transfer/test_pd_exactness.py tests/replica/kv_transfer/test_plane.py \
    tests/replica/kv_transfer/test_prefix_fetch.py tests/kernels/test_sliding_window.py \
    tests/kernels/test_lora_triton.py tests/kernels/test_triton.py \
    > "$OUT_DIR/gpu_tests.log" 2>&1
  say "pytest exit $?"
  grep -E "^(FAILED|ERROR)|passed|failed|error" "$OUT_DIR/gpu_tests.log" | tail -30
fi

if [ "$PHASE" = all ] || [ "$PHASE" = bench ]; then
  say "decode step, llama-8b shapes, bf16"
  steps=30
  batches=1,16,64,128
  impls=${GPU_CHECK_IMPLS:-transformers,kvroute}  # each loads the 8B model once (~30-60 s)
  [ "$QUICK" = "--quick" ] && steps=10 && batches=1,64
  timeout 150 $PY benchmarks/bench_decode_step.py --model llama-8b --batch "$batches" \
    --steps "$steps" --profile --impl "$impls" 2>&1 | tee "$OUT_DIR/decode_step.log" \
    | grep -E '^(\||#)|Error|error|CUDA graphs off|captured'
fi

if [ "$PHASE" != tests ]; then
  load_s=120 transfer_s=60
  [ "$PHASE" = kv ] && load_s=75 transfer_s=35  # kv: the whole phase in under 4 minutes
  say "KV host tier: load against recompute, decode beside the load (llama-8b shapes, bf16)"
  timeout $load_s $PY benchmarks/bench_kv_load.py --model llama-8b --prefix 2048 --decoders 16 \
    --steps 20 2>&1 | tee "$OUT_DIR/kv_load.log" | grep -vE '^(Loading|writing)'
  say "KV transfer between two processes on the device: 8B blocks, pinned D2H, loopback TCP, H2D"
  timeout $transfer_s $PY benchmarks/bench_kv_transfer.py --device cuda --shapes 8B --repeats 5 \
    --no-recompute 2>&1 | tee "$OUT_DIR/kv_transfer.log" | grep -E '^(#|shape|8B)|Error|error'
fi
say "done"
