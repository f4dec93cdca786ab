#!/usr/bin/env bash
# The GPU work of memattn on a lent H100 / H200 machine, in phases that each end well inside
# one 10-minute command. The machine has python3 with CUDA torch and Triton but no network:
# the packages memattn needs beyond its image travel as wheels in .whl/, made here by
# `bash benchmarks/gpu_wheels.sh` and carried on every call (`carry: [".whl"]`); they are
# installed under /tmp/site, ahead of the image's own.
#
#   bash benchmarks/gpu_session.sh tests     the whole suite there (the kernel tests with GPU
#                                            shapes run instead of skipping), log to $OUT
#   bash benchmarks/gpu_session.sh kernels   benchmarks/gpu_kernels.py: memattn's Triton kernels
#                                            against fla's chunk_abc / chunk_gsa and FlashAttention
#   bash benchmarks/gpu_session.sh bench [NAME ...]
#                                            memattn bench NAME ... (default all) --device cuda
#                                            --dtype bf16
#   bash benchmarks/gpu_session.sh profile   benchmarks/gpu_profile.py: the ABC kernels' time
#                                            per kernel against fla's, and against chunk size
#   bash benchmarks/gpu_session.sh all       the timing of the kernels in one call of at most
#                                            8 minutes: the kernel tests (GPU shapes) beside
#                                            the rest of the suite (CPU workers), then alone on
#                                            the GPU gpu_kernels.py (fwd+bwd at T 4k-32k of
#                                            every training op but chunk_gsa, GSA too;
#                                            decoding at batch 1 and 64, contexts 4k and
#                                            32k) and gpu_profile.py (every kernel's
#                                            time against its bound from kernel_model.py, D 64
#                                            and 128, M 32 and 64, the default launch choices
#                                            against a sub-block's own block without its
#                                            factors), each cut at its share of the time
#                                            (both keep the rows they measured)
#   bash benchmarks/gpu_session.sh verify    after changes to the kernels or the contracts,
#                                            in one call of at most 9 minutes: the kernel
#                                            tests beside the rest of the suite, then
#                                            gpu_profile.py for D = 64 and 128 at M = SLOTS
#                                            (64; M = 32 is in results/nvidia-h100: its
#                                            variants with every kernel's time), then bench
#                                            decode of softmax, abc-mlp and linear
#   bash benchmarks/gpu_session.sh gsa       gated slot attention's kernels in one call of at
#                                            most 7 minutes: their tests (GPU shapes), then,
#                                            if they pass, gpu_kernels.py timing memattn's GSA
#                                            against its plain ABC ("GSA / ABC", the gated
#                                            kernels' cost), T 2k-16k, D 64 and 128, M 32 and
#                                            64, and the fused decoding steps (not fla's
#                                            chunk_gsa: it did not finish its first
#                                            configuration, T 4k, in 266 s on an H200, fla-core
#                                            0.6.0; `kernels` times it with the rest)
#   bash benchmarks/gpu_session.sh experiment NAME [key=value ...]
#                                            `memattn experiment NAME` on the GPU for at most
#                                            EXPERIMENT_S seconds (540), JOBS models at once
#                                            (4), its run folders under runs/gpu-NAME, then
#                                            its tables and NAME.tgz (the folders, to go on
#                                            from on another machine: .gpu/NAME.tgz) to
#                                            $OUT. Data the machine cannot prepare travels in
#                                            .data/ (e.g. the Bible pairs of abc-mt:
#                                            data.path=.data/bible-en-es)
#
# $OUT (the device tool's) collects the logs and results; device.txt names the GPU, driver,
# torch and Triton versions.
set -euo pipefail
cd "$(dirname "$0")/.."
phase=${1:-}
OUT=${OUT:-benchmarks/results/gpu-session}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH="$PWD:/tmp/site" PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/device.txt"
# The kernel tests (GPU shapes, two processes sharing the GPU: ABC's, and the others; each
# file's GPU tests first) beside the rest of the suite (8 CPU workers), all cut at $1 seconds
# by an interrupt, so that pytest still names the tests that failed so far.
tests_beside() {
  abc_tests=(tests/ops/test_abc_triton.py)
  other_tests=(tests/ops/test_gsa_triton.py tests/ops/test_abc_decode_triton.py tests/ops/test_linear_triton.py)
  timeout -s INT -k 20 "$1" python3 -m pytest -q -rfE -p no:cacheprovider "${abc_tests[@]}" \
    > "$OUT/kernel-tests.log" 2>&1 &
  timeout -s INT -k 20 "$1" python3 -m pytest -q -rfE -p no:cacheprovider "${other_tests[@]}" \
    > "$OUT/kernel-tests-2.log" 2>&1 &
  timeout -s INT -k 20 "$1" python3 -m pytest -q -rfE -n 8 -p no:cacheprovider --durations=10 \
    $(printf -- '--ignore=%s ' "${abc_tests[@]}" "${other_tests[@]}") > "$OUT/tests.log" 2>&1 &
  wait || true
  grep -E "^(FAILED|ERROR) | passed| failed" "$OUT/kernel-tests.log" "$OUT/kernel-tests-2.log" \
    "$OUT/tests.log" | tail -n 20 || true
}
# The logs in one archive, $OUT/logs.tgz: the device tool brings back at most 8 files.
pack_logs() {
  (cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log) || true
}
case "$phase" in
  tests) python3 -m pytest -q -n 8 -p no:cacheprovider --durations=10 2>&1 | tee "$OUT/tests.log" ;;
  kernels) python3 benchmarks/gpu_kernels.py --out "$OUT/kernels" 2>&1 | tee "$OUT/kernels.log" ;;
  bench) shift; python3 -m memattn bench "${@:-all}" --device cuda --dtype bf16 --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" ;;
  profile) python3 benchmarks/gpu_profile.py --out "$OUT/profile" 2>&1 | tee "$OUT/profile.log" ;;
  all)
    tests_beside 120
    # not fla's chunk_gsa: on the H200 it did not finish its first configuration in 266 s
    timeout 210 python3 benchmarks/gpu_kernels.py --skip-tests --modes fwd+bwd --lengths 4096 8192 16384 32768 \
      --contexts 4096 32768 --ops softmax memattn-abc fla-abc memattn-gsa linear abc-step-graph gsa-step-graph \
      softmax-kv --out "$OUT/kernels" > "$OUT/kernels.log" 2>&1 || true
    tail -n 2 "$OUT/kernels.log"
    timeout 110 python3 benchmarks/gpu_profile.py --dims 64 128 --slots 32 64 --chunk-sizes 64 \
      --variants default "sub-blocks only (no whole chunks)" \
      --out "$OUT/profile" > "$OUT/profile.log" 2>&1 || true
    grep -E "^Bounds|^\*\*" "$OUT/profile/gpu_profile.md" || tail -n 5 "$OUT/profile.log"
    pack_logs ;;
  verify)
    tests_beside 130
    timeout 300 python3 benchmarks/gpu_profile.py --dims 64 128 --slots "${SLOTS:-64}" --chunk-sizes 64 \
      --out "$OUT/profile" > "$OUT/profile.log" 2>&1 || true
    tail -n 2 "$OUT/profile.log"
    timeout 100 python3 -m memattn bench decode --attention softmax abc-mlp linear --device cuda \
      --dtype bf16 --out "$OUT/bench" > "$OUT/bench.log" 2>&1 || true
    tail -n 3 "$OUT/bench.log"
    pack_logs ;;
  gsa)
    if timeout -s INT -k 20 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/ops/test_gsa_triton.py \
        > "$OUT/gsa-tests.log" 2>&1; then
      tail -n 1 "$OUT/gsa-tests.log"
      timeout 240 python3 benchmarks/gpu_kernels.py --skip-tests --lengths 2048 8192 16384 --contexts 4096 \
        --ops memattn-abc memattn-gsa abc-step-graph gsa-step-graph --out "$OUT/gsa" \
        > "$OUT/gsa.log" 2>&1 || true
      grep -A 8 "^## Gated" "$OUT/gsa/gpu_kernels.md" || tail -n 5 "$OUT/gsa.log"
    else
      grep -E "^(FAILED|ERROR) | passed| failed" "$OUT/gsa-tests.log" | tail -n 20; echo "gsa kernel tests fail: no timing"
    fi
    pack_logs ;;
  experiment)
    # Run folders travel between machines as $OUT/NAME.tgz (every file but the finished
    # runs' checkpoints); put it at .gpu/NAME.tgz here and carry .gpu to go on.
    name=${2:?experiment name}; shift 2
    dir=runs/gpu-$name
    mkdir -p "$dir"
    if [ -f ".gpu/$name.tgz" ]; then tar xzf ".gpu/$name.tgz" -C "$dir"; fi
    timeout "${EXPERIMENT_S:-540}" python3 -m memattn experiment "$name" --jobs "${JOBS:-4}" \
      --out-dir "$dir" train.device=cuda "$@" 2>&1 | tee "$OUT/$name.log" || true
    pkill -f multiprocessing.spawn || true  # the workers of a runner cut short
    sleep 2
    (cd "$dir" && find . -type f | while read -r f; do
       case "$f" in */checkpoint.safetensors) [ -f "$(dirname "$f")/row.json" ] && continue ;; esac
       echo "$f"; done) > /tmp/keep.txt
    tar czf "$OUT/$name.tgz" -C "$dir" -T /tmp/keep.txt
    cp "$dir"/results.md "$dir"/results.json "$OUT/" 2>/dev/null || true ;;
  *) echo "usage: $0 tests|kernels|bench [NAME ...]|profile|all|verify|gsa|experiment NAME [key=value ...]" >&2; exit 2 ;;
esac
