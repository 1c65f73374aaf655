#!/usr/bin/env bash
# Fills ./.whl (or the folder given) with the wheels the GPU machine lacks, for benchmarks/device.sh to install there
# (that machine has torch 2.11, triton and transformers but no network). Run it from the project root on a CPU
# machine with PyPI reachable, in a Python environment that has torch (mamba-ssm's build imports it):
#
#   bash benchmarks/make_wheels.sh [DEST]        then carry `.whl` in the device call (it is git-ignored)
#
# What and why:
# - cattrs (the config layer's dependency) and xxhash (the checkpoints' checksums; compiled: the wheel for that
#   machine's Python 3.12);
# - mamba-ssm built WITHOUT its CUDA extension: pure Python + Triton kernels (building CUDA there takes too long);
# - pure-Triton kernel peers: liger-kernel, flash-linear-attention + fla-core;
# - torchtitan 0.3.0 (the Llama 3 / MoE peer; pure Python) with the light packages its model code imports:
#   spmd_types, torch_checkpointing, tyro and tyro's docstring-parser and typeguard. Its declared datasets / wandb /
#   tensorboard / torchdata / pillow / einops are not needed by the model, compile, checkpointing and float8 code;
# - torchao 0.18.0 (torchtitan's float8 peer and blockzoo's `training.fp8`): its float8 training is pure Python over
#   torch._scaled_mm; the wheel's compiled extras (MX / CUTLASS kernels) are optional, torchao warns and runs without.
# Every download is pinned; the script fails when the folder passes the 64 MiB a device call can carry.
set -euo pipefail
dest=${1:-.whl}
limit_mib=64
if ! python3 -c "import torch" 2>/dev/null; then
  echo "make_wheels.sh: $(command -v python3) has no torch, which mamba-ssm's build imports: activate an environment" \
    "with torch (pip install torch==2.13.0) and run it again" >&2
  exit 2
fi
mkdir -p "$dest"
python3 -m pip install -q wheel setuptools packaging ninja
python3 -m pip download -q --no-deps --only-binary=:all: -d "$dest" cattrs==26.2.1 \
  liger-kernel==0.8.5 flash-linear-attention==0.6.0 fla-core==0.6.0 \
  torchtitan==0.3.0 spmd_types==0.2.3 torch_checkpointing==0.1.1 tyro==1.0.17 docstring-parser==0.18.0 \
  typeguard==4.6.1 torchao==0.18.0
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
  -d "$dest" xxhash==4.1.0
MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE \
  python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dest" mamba-ssm==2.3.2.post1
ls -la "$dest"
size_kib=$(du -sk "$dest" | cut -f1)
echo "# $dest: $((size_kib / 1024)) MiB of the $limit_mib MiB a device call carries"
if ((size_kib > limit_mib * 1024)); then
  echo "# too large for a device call: remove older wheels from $dest" >&2
  exit 1
fi
