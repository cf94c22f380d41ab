#!/usr/bin/env bash
# The GPU checks in one go, on one NVIDIA GPU (not runnable on the CPU machines this project is
# built on): the `gpu`-marked tests -- sft on GPU (nccl, bf16), colocated vLLM with sleep level 1,
# the hybrid engine (vLLM sleep level 2 + DeepSpeed state offload while generating), the separate
# layout with every role (trainer, engine, reference, reward model) on its GPU share, LoRA rl with
# vLLM and QLoRA sft (bitsandbytes), and with two GPUs a tensor-parallel vLLM engine.
#
# Needs: an NVIDIA driver, python3.11 and pip access to PyPI (torch with CUDA, vllm, deepspeed,
# bitsandbytes: `pip install -e ".[gpu,dev]"`, ~10 GB, several minutes).  The checks themselves
# are sized for under 8 minutes on one H100 (never run yet: the project's machines have no GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-gpu}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -e ".[gpu,dev]"
"$VENV/bin/python" -m pytest -m gpu -n 0 -p no:cacheprovider tests/gpu
