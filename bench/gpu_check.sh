#!/usr/bin/env bash
# The whole GPU check in one run on a bare GPU machine (at most ~8 minutes). First, before any timing, the Pallas GPU
# kernels (attention with dropout, the LayerNorms) compiled for the card and checked against XLA on it at BERT-base
# shapes, forward and gradients (bench/gpu_kernels.py: 14 cases of a few small compiles each, expected well under a
# minute; kernels.txt): if a case fails the script stops there with its lines and times nothing, the timing of a
# wrong program being no figure. The verdict is cached for jobs on this machine, and kernels.txt's last line is the
# entry to record in bertjax/model/kernels/gpu/gpu_kernel_check.py's PASSED_ON when all pass (`bertjax compile` then
# says no more that the card's kernels are unchecked). Then the BERT-base MLM+NSP AdamW step in
# bf16 with BERT's dropout 0.1/0.1 at seq 128 batch 256 and seq 512 batch 32, bertjax beside transformers + torch
# eager and transformers + torch.compile (bench/train_step.py, the sides taking turns), then a profile of bertjax's
# seq-128 step and its top kernels (bench/profile_top.py).
#
#   bash bench/gpu_check.sh [OUT_DIR]
#
# Uses the machine's own python3 with jax (CUDA), flax, optax, orbax, torch and transformers. Packages it lacks
# travel as wheels in .whl/ (e.g. ml-collections and zstandard, which bertjax imports; download them on another
# machine with `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux2014_x86_64
# -d .whl ml-collections==1.1.0 zstandard==0.25.0`) and are installed into a scratch directory first.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-/tmp/gpu_check}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c "import jax, torch, transformers; print('jax', jax.__version__, jax.devices()[0].device_kind, \
'| torch', torch.__version__, '| transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
date -u +%FT%TZ | tee -a "$out/gpu.txt"
if ! python3 bench/gpu_kernels.py 2>&1 | grep -v -e "^WARNING" -e "^W0000" | tee "$out/kernels.txt"; then
  echo "gpu_check: the Pallas kernels differ from XLA on this card (above; $out/kernels.txt): nothing timed" >&2
  exit 1
fi
common=(--dtype bfloat16 --lengths '' --repeats 3 --steps-per-turn 5 --torch-peers eager,compile)
python3 bench/train_step.py --batch 256 --seq 128 "${common[@]}" --trace "$out/trace128" 2>&1 \
  | grep -v -e "^WARNING" -e "^W0000" | tee "$out/seq128.txt"
python3 bench/train_step.py --batch 32 --seq 512 "${common[@]}" 2>&1 \
  | grep -v -e "^WARNING" -e "^W0000" | tee "$out/seq512.txt"
