#!/usr/bin/env bash
# Idempotent machine setup: installs only what is missing, so a second run
# takes seconds. Called by `cargo xtask setup` (and by `xtask test`/`demo`).
set -euo pipefail

need_apt=()
# qemu-system-x86, busybox-static, kmod and xz-utils: the test VM (`cargo xtask vm`);
# nftables, ipvsadm: the kube-proxy stand-in's nftables and IPVS modes; containernetworking-plugins:
# ptp, host-local and loopback in /usr/lib/cni, which the CNI plugin tests chain ours after.
for pkg in llvm-22-dev bpftool iptables ipset ipvsadm conntrack nftables iproute2 iputils-ping iperf3 \
  qemu-system-x86 busybox-static kmod xz-utils containernetworking-plugins; do
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
# The test VM's kernel: Debian 12's generic 6.1 image (9p and virtio as
# modules), unpacked into the cache and never installed into /boot. The
# newest ABI that linux-image-amd64 points to is taken once; a cached one is
# kept (the archive drops old ABIs, the tests keep working).
vm_cache=${POLICY_AGENT_VM_CACHE:-/var/cache/policy-agent/vm}
vm_kernel_pkg() {
  apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-6\.1\./ {print $2; exit}'
}
if [ ! -e "$vm_cache/current/.complete" ]; then
  kdl=$(mktemp -d)
  chown _apt "$kdl" 2>/dev/null || true
  kpkg=$(vm_kernel_pkg)
  # Stale package lists may name an ABI the archive no longer has.
  if [ -z "$kpkg" ] || ! (cd "$kdl" && apt-get download -qq "$kpkg" 2>/dev/null); then
    apt-get update -qq
    kpkg=$(vm_kernel_pkg)
    [ -n "$kpkg" ] || { echo "setup: no linux-image-6.1.0-*-amd64 behind linux-image-amd64" >&2; exit 1; }
    (cd "$kdl" && apt-get download -qq "$kpkg")
  fi
  krel=${kpkg#linux-image-}
  echo "setup: fetched $kpkg for the test VM (unpacking into $vm_cache/$krel, not installing)"
  mkdir -p "$vm_cache"
  rm -rf "$vm_cache/$krel"
  dpkg-deb -x "$kdl"/"$kpkg"_*.deb "$vm_cache/$krel"
  rm -rf "$kdl" "$vm_cache/$krel/usr/share/doc"
  # The package leaves modules.dep to its postinst.
  depmod -b "$vm_cache/$krel" "$krel"
  touch "$vm_cache/$krel/.complete"
  ln -sfn "$krel" "$vm_cache/current"
fi
# The ELF inside the bzImage: QEMU boots it through its PVH entry, which
# saves the decompression (seconds under TCG). Without it the runner boots
# the bzImage.
vm_rel=$(readlink "$vm_cache/current")
if [ ! -e "$vm_cache/$vm_rel/boot/vmlinux-$vm_rel" ]; then
  vmlinuz="$vm_cache/$vm_rel/boot/vmlinuz-$vm_rel"
  xz_at=$(LC_ALL=C grep -abo $'\xfd7zXZ' "$vmlinuz" | head -1 | cut -d: -f1 || true)
  if [ -n "$xz_at" ]; then
    echo "setup: unpacking vmlinux-$vm_rel from its bzImage (the test VM boots it directly)"
    tail -c +"$((xz_at + 1))" "$vmlinuz" | xz -dcq >"$vm_cache/$vm_rel/boot/vmlinux.tmp" 2>/dev/null || true
    if [ "$(head -c 4 "$vm_cache/$vm_rel/boot/vmlinux.tmp" | od -An -c | tr -d ' ')" = '177ELF' ]; then
      mv "$vm_cache/$vm_rel/boot/vmlinux.tmp" "$vm_cache/$vm_rel/boot/vmlinux-$vm_rel"
    fi
  fi
  rm -f "$vm_cache/$vm_rel/boot/vmlinux.tmp"
fi
# The guest binds the kernel's modules over this; a host without a kernel
# package of its own (a container, a microVM) lacks the directory.
[ -d /lib/modules ] || mkdir -p /lib/modules
echo "setup: ok"
