#!/usr/bin/env bash
# Run here, before a GPU session: downloads into .whl/ the wheels that gpu_session.sh installs
# on the lent machine (which has no network). Its image holds CUDA torch, Triton, numpy,
# pyarrow, pandas, lxml and the like, but not these, or older versions of them: the Makefile's
# pins (`make pins`: among them fla-core, the peer of gpu_kernels.py, with einops, its one
# requirement; the image may lack einops: then fla's reference ops do not load) and the needs
# of these that the image lacks.
# About 26 MB: name `.whl` in the device tool's `carry` on every call.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGES=(
  $(make -s --no-print-directory pins)
  dill==0.4.1 multiprocess==0.70.19 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
  click==8.5.1 hf-xet==1.8.0
)
rm -rf .whl && mkdir .whl
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${PACKAGES[@]}" \
  || { echo "gpu_wheels.sh: pip download failed (it needs PyPI); .whl/ is incomplete" >&2; exit 1; }
echo "$(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1) in .whl/"
