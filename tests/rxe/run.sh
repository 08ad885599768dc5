#!/usr/bin/env bash
# Soft-RoCE (rxe) lane: boots Debian's own kernel under QEMU, creates rxe0 with the kernel's
# rdma_rxe driver (RoCEv2 in software), runs a command inside and exits with its status.
#
#   tests/rxe/run.sh [--image-only] [--stage DIR] -- COMMAND...
#
# COMMAND runs inside the guest from the stage directory (shared over 9p at /host), so put the
# host-built binaries it needs there first (tests/rxe/lane.sh does). Host and image are both
# Debian bookworm (glibc 2.36), so host-built test binaries run inside unchanged.
#
# Needs root. Installs qemu-system-x86, debootstrap and e2fsprogs when missing. The image is cached
# under /var/cache/fabriq-rxe/<recipe hash>/ and rebuilt when the recipe below changes. KVM is used
# only when kvm_intel or kvm_amd is loaded; otherwise TCG (software emulation). Traffic stays
# inside the guest: rxe runs on the guest's loopback and the NIC is user-mode with restrict=on.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
image_only=0
stage=""
while [ $# -gt 0 ]; do
  case "$1" in
    --image-only) image_only=1; shift ;;
    --stage) stage=$2; shift 2 ;;
    --) shift; break ;;
    *) break ;;
  esac
done

die() { echo "rxe lane: FAILED: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "must run as root (debootstrap, 9p share)"

need=()
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
if [ ${#need[@]} -gt 0 ]; then
  echo "rxe lane: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q "${need[@]}" >/dev/null || die "apt-get install ${need[*]}"
fi

# ---- image recipe (its hash names the cache entry) -----------------------------------------
SUITE=bookworm
PACKAGES=linux-image-amd64,rdma-core,ibverbs-providers,ibverbs-utils,perftest,rdmacm-utils,iproute2,kmod,procps
INIT_SCRIPT='#!/bin/sh
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mkdir -p /host /tmp
mount -t tmpfs tmp /tmp
modprobe 9pnet_virtio; modprobe 9p
mount -t 9p -o trans=virtio,version=9p2000.L,msize=1048576 host /host || { echo "9p mount failed"; echo o > /proc/sysrq-trigger; }
exec /bin/sh /host/.guest.sh'
recipe_hash=$(printf '%s\n%s\n%s\n' "$SUITE" "$PACKAGES" "$INIT_SCRIPT" | sha256sum | cut -c1-16)
cache=/var/cache/fabriq-rxe/$recipe_hash
mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
mirror=${mirror:-http://deb.debian.org/debian}

if [ ! -f "$cache/ready" ]; then
  echo "rxe lane: building image $recipe_hash (debootstrap $SUITE from $mirror; takes a few minutes)"
  rm -rf "$cache"; mkdir -p "$cache"
  root="$cache/rootfs"
  debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$mirror" \
    > "$cache/debootstrap.log" 2>&1 || { tail -20 "$cache/debootstrap.log"; die "debootstrap"; }
  printf '%s\n' "$INIT_SCRIPT" > "$root/fabriq-init"; chmod +x "$root/fabriq-init"
  cp "$root"/boot/vmlinuz-* "$cache/vmlinuz"
  cp "$root"/boot/initrd.img-* "$cache/initrd.img"
  rm -rf "$root/var/cache/apt/archives/"*.deb "$root/usr/share/doc" "$root/usr/share/man"
  mkfs.ext4 -q -F -L root -d "$root" "$cache/rootfs.img" 3G || die "mkfs.ext4"
  rm -rf "$root"
  touch "$cache/ready"
fi
echo "rxe lane: image $cache"
[ "$image_only" = 1 ] && exit 0
[ $# -gt 0 ] || die "no command given"
[ -n "$stage" ] || { stage=$(mktemp -d /tmp/fabriq-rxe.XXXXXX); }
mkdir -p "$stage"

# ---- the guest side ------------------------------------------------------------------------
printf '%s\n' "$*" > "$stage/.cmd"
cat > "$stage/.guest.sh" <<'GUEST'
#!/bin/sh
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
ip link set lo up
modprobe ib_uverbs; modprobe rdma_rxe; modprobe rdma_ucm 2>/dev/null
rdma link add rxe0 type rxe netdev lo || echo "rxe lane: rdma link add failed"
ulimit -l unlimited
echo "rxe lane: guest ready: $(uname -r), devices: $(ls /sys/class/infiniband 2>/dev/null)"
cd /host
sh -c "$(cat /host/.cmd)"
echo $? > /host/.status
sync
echo o > /proc/sysrq-trigger
sleep 30
GUEST
rm -f "$stage/.status"

accel="-accel tcg,thread=multi -cpu max"
if lsmod 2>/dev/null | grep -Eq '^kvm_(intel|amd)'; then accel="-accel kvm -cpu host"; fi
echo "rxe lane: booting ($accel)"
set +e
timeout "${FABRIQ_RXE_TIMEOUT:-1500}" qemu-system-x86_64 $accel -smp 2 -m 3072 -nographic -no-reboot \
  -kernel "$cache/vmlinuz" -initrd "$cache/initrd.img" \
  -append "console=ttyS0 root=/dev/vda rw init=/fabriq-init net.ifnames=0 panic=-1 quiet loglevel=3" \
  -drive "file=$cache/rootfs.img,format=raw,if=virtio,snapshot=on" \
  -virtfs "local,path=$stage,mount_tag=host,security_model=none,id=host" \
  -nic user,model=virtio-net-pci,restrict=on </dev/null
qrc=$?
set -e
[ -f "$stage/.status" ] || die "the guest did not finish (qemu exit $qrc): qemu could not run the lane"
status=$(cat "$stage/.status")
echo "rxe lane: guest command exited with $status"
exit "$status"
