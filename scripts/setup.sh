#!/usr/bin/env bash
# Idempotent machine setup: installs only what is missing, so a second run
# takes seconds. Called by `cargo xtask setup` (and by `xtask test`/`demo`).
set -euo pipefail

need_apt=()
for pkg in llvm-22-dev bpftool iptables ipset conntrack nftables iproute2 iputils-ping iperf3; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || need_apt+=("$pkg")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup: installing apt packages: ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

if ! rustup component list --toolchain nightly --installed 2>/dev/null | grep -q '^rust-src'; then
  echo "setup: adding rust-src to the nightly toolchain"
  rustup component add rust-src --toolchain nightly
fi

# bpf-linker must link against the same LLVM major as rustc nightly (22).
if ! command -v bpf-linker >/dev/null 2>&1; then
  echo "setup: building bpf-linker against LLVM 22 (takes a few minutes once)"
  LLVM_PREFIX=/usr/lib/llvm-22 cargo install bpf-linker --locked --version '^0.13' \
    --no-default-features --features llvm-22 --force
fi
# Offline schema validation of deploy/ (tests).
if ! command -v kubernetes-validate >/dev/null 2>&1; then
  echo "setup: installing kubernetes-validate (PyPI)"
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore 'kubernetes-validate==1.37.*'
fi
echo "setup: ok"
