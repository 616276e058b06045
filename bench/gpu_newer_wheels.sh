#!/usr/bin/env bash
# Wheels of this machine's transformers and of what it needs (numpy aside: the GPU machine's
# CuPy is built against its own), into .whl/newer, for gpu_owed.sh's `newer` step: the GPU
# machine's transformers (5.17) lacks model types moestream serves (qwen3_5_moe, inkling2,
# inkling2_loop) and transformers' newer GGUF mappings. Run from the repository root after
# ../shared/scripts/gpu-wheels.sh; carry .whl with the call (about 32 MB more).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
version=$(.venv/bin/python -c 'import transformers; print(transformers.__version__)')
rm -rf .whl/newer && mkdir -p .whl/newer
.venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl/newer "transformers==$version"
rm -f .whl/newer/numpy-*.whl
du -sh .whl/newer
