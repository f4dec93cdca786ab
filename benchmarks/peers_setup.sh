#!/usr/bin/env bash
# A virtual environment with memattn and every peer library `memattn bench` measures beside it
# (research/bench/peers.py). `make setup` puts the pure-Python ones in .venv too; this one adds
# pytorch-fast-transformers, which only builds from source.
#
#     benchmarks/peers_setup.sh [VENV]        # default .venv-peers; or `make bench-peers`
#
# Pinned: torch 2.13.0 (as `make setup`), the Makefile's PEER_PINS (`make peer-pins`:
# x-transformers, local-attention, fla-core with einops; without Triton only fla's pure-PyTorch
# references load, which is what a CPU run measures), pytorch-fast-transformers 0.4.0.
#
# pytorch-fast-transformers ships as source only. Its setup.py adds CUDA extensions as soon
# as `nvcc` runs, and a CPU build of torch has no CUDA_HOME, so on a machine with nvcc but a
# CPU torch the build stops at "CUDA_HOME environment variable is not set". The build below
# hides nvcc (PATH holds only the venv and /usr/bin:/bin) and compiles the CPU extensions:
# about 11 minutes with g++ on 2 cores. PFT_WHEEL=path/to.whl installs a wheel built before
# (it is tied to torch 2.13.0's ABI) instead. Where the build fails, the other peers stay
# installed, the log is kept, and the linear-attention peer rows read "not installed".
#
# Afterwards the script checks that no peer replaced torch and that pip's requirements hold.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${1:-.venv-peers}
PY=$VENV/bin/python
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}
read -ra PEER_PINS <<< "$(make -s --no-print-directory peer-pins)"
PFT_PIN=pytorch-fast-transformers==0.4.0

${PYTHON:-python3} -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
"$PY" -m pip install --quiet "$TORCH_PIN"
TORCH_BEFORE=$("$PY" -c 'import torch; print(torch.__version__)')
"$PY" -m pip install --quiet -e ".[test,plot]"
"$PY" -m pip install --quiet "${PEER_PINS[@]}" "$TORCH_PIN"

if [[ -n "${PFT_WHEEL:-}" ]]; then
    "$PY" -m pip install --quiet --no-deps "$PFT_WHEEL"
else
    "$PY" -m pip install --quiet setuptools wheel ninja
    LOG=$VENV/pytorch-fast-transformers-build.log
    echo "building $PFT_PIN (CPU extensions only, about 11 minutes; log: $LOG)"
    if ! PATH="$(cd "$VENV/bin" && pwd):/usr/bin:/bin" MAX_JOBS=${MAX_JOBS:-2} \
            "$PY" -m pip install --no-build-isolation --no-deps "$PFT_PIN" >"$LOG" 2>&1; then
        echo "pytorch-fast-transformers did not build; the other peers are installed." >&2
        echo "Last lines of $LOG:" >&2
        tail -n 20 "$LOG" >&2
    fi
fi

TORCH_AFTER=$("$PY" -c 'import torch; print(torch.__version__)')
if [[ "$TORCH_AFTER" != "$TORCH_BEFORE" ]]; then
    echo "torch was replaced: $TORCH_BEFORE before the peers, $TORCH_AFTER after" >&2
    exit 1
fi
"$PY" -m pip check
"$PY" - <<'EOF'
import torch
from research.bench import peers
from research.bench.settings import LMShape
from memattn.layers.base import LayerSpec

print(f"torch {torch.__version__}")
for peer in peers.PEERS:
    try:
        peer.lm(LMShape(), {}) if peer.lm is not None else peer.layer(LayerSpec(64, 4), {})
        print(f"  {peer.label:45} against {peer.mechanism}: ready")
    except peers.PeerUnavailable as e:
        print(f"  {peer.label:45} against {peer.mechanism}: {e}")
op, why = peers.fla_naive_abc(torch.device("cpu"))
print(f"  {peers.FLA_NAIVE_ABC:45} against abc-mlp: {'ready' if op else why}")
EOF
