# shellcheck shell=bash
# kvirt test-host and guest-image harness. Source this file; see README.md.
#
# Public functions (the contract): th_host_deps th_mirror th_rootfs th_virtqemud
# th_guest th_boot th_exec th_sh th_copy_in th_pid1 th_share th_console_log th_stop
# th_wait th_log
#
# All logging goes to stderr; functions that "echo a path" print only that on stdout.

TH_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TH_CACHE=${KVIRT_TEST_CACHE:-/var/cache/kvirt-test}
TH_STATE=${KVIRT_TEST_STATE:-/var/tmp/kvirt-th}
TH_SUITE=${TH_SUITE:-trixie}
TH_HOSTNAME=kvirt-testhost

TH_HOST_PKGS=(debootstrap systemd-container busybox-static cpio dosfstools mtools
  syslinux syslinux-common qemu-utils libvirt-clients libvirt-dev pkg-config
  util-linux xz-utils zstd debian-archive-keyring ca-certificates lintian rpm rpmlint
  xorriso docker-registry grub-efi-amd64-bin libxml2-utils nftables
  containernetworking-plugins iproute2)

TH_ROOTFS_PKGS=(systemd systemd-sysv dbus libpam-systemd libvirt-daemon
  libvirt-daemon-driver-qemu libvirt-clients qemu-system-x86 qemu-utils seabios
  ipxe-qemu iproute2 nftables busybox-static procps socat util-linux kmod
  ca-certificates systemd-container xorriso docker-registry ovmf libnss-systemd
  swtpm swtpm-tools containernetworking-plugins)

# Units that fail or only make noise in an nspawn container.
TH_ROOTFS_MASK=(systemd-modules-load.service apt-daily.timer apt-daily-upgrade.timer
  dpkg-db-backup.timer e2scrub_all.timer e2scrub_reap.service fstrim.timer
  systemd-networkd-wait-online.service docker-registry.service)

th_log() { printf '[th %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
th_die() { th_log "ERROR: $*"; return 1; }
th__now() { date +%s.%N; }
th__since() { awk -v a="$1" -v b="$(th__now)" 'BEGIN { printf "%.1fs", b - a }'; }
th__hash() { sha256sum | cut -c1-16; }
th__alive() { [[ -r /proc/$1/stat ]] && [[ $(awk '{ print $3 }' "/proc/$1/stat" 2>/dev/null) != Z ]]; }
th__dead() { ! th__alive "$1"; }
# th__in_use DIR: does a running process name DIR (or a path under it) on its command
# line (nspawn -D/--bind of a cached rootfs or guest)? Never delete such a directory:
# a booted container's overlay still reads its lower tree.
th__in_use() {
  local f
  for f in /proc/[0-9]*/cmdline; do
    tr '\0' '\n' <"$f" 2>/dev/null | grep -qF -- "$1" && return 0
  done
  return 1
}

# th_wait DEADLINE_S CMD... : poll CMD (every 0.1 s, backing off to 0.5 s) until it
# succeeds; fail with a message after DEADLINE_S seconds.
th_wait() {
  local deadline=$1; shift
  local end=$((SECONDS + ${deadline%.*})) delay=0.1
  until "$@"; do
    if ((SECONDS >= end)); then
      th_log "timed out after ${deadline}s waiting for: $*"
      return 1
    fi
    sleep "$delay"   # poll interval, not synchronisation
    [[ $delay == 0.5 ]] || delay=$(awk -v d="$delay" 'BEGIN { d *= 1.5; if (d > 0.5) d = 0.5; print d }')
  done
}

# ---------------------------------------------------------------- host side

th_host_deps() {
  local missing=() p
  for p in "${TH_HOST_PKGS[@]}"; do
    dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null | grep -q '^ii' || missing+=("$p")
  done
  ((${#missing[@]})) || return 0
  th_log "installing host packages: ${missing[*]}"
  local t; t=$(th__now)
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "${missing[@]}" >&2; then
    apt-get update >&2
    apt-get install -y --no-install-recommends "${missing[@]}" >&2
  fi
  # Only its binary is wanted (tests/image.rs starts its own on a loopback
  # port): no registry service left running on this machine.
  if [[ " ${missing[*]} " == *" docker-registry "* ]] && [[ -d /run/systemd/system ]]; then
    systemctl disable --now docker-registry.service >&2 || true
  fi
  th_log "host packages installed in $(th__since "$t")"
}

# Debian mirror URL, read from this machine's apt configuration (override: TH_MIRROR).
th_mirror() {
  if [[ -n ${TH_MIRROR:-} ]]; then echo "$TH_MIRROR"; return; fi
  local f
  {
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
      [[ -r $f ]] || continue
      awk '$1 == "deb" { i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ } print $i, $(i+1) }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
      [[ -r $f ]] || continue
      awk 'function flush() { if (types ~ /(^| )deb( |$)/) { n = split(uris, u, " "); m = split(suites, s, " ");
                               for (i = 1; i <= n; i++) for (j = 1; j <= m; j++) print u[i], s[j] }
                             types = uris = suites = "" }
           /^[ \t]*$/ { flush(); next }
           /^Types:/ { sub(/^Types:[ \t]*/, ""); types = $0 }
           /^URIs:/ { sub(/^URIs:[ \t]*/, ""); uris = $0 }
           /^Suites:/ { sub(/^Suites:[ \t]*/, ""); suites = $0 }
           END { flush() }' "$f"
    done
  } | awk '$2 ~ /^(buster|bullseye|bookworm|trixie|forky|sid|stable|testing|unstable|oldstable)(-updates|-backports)?$/ \
           && $1 !~ /security/ { sub(/\/$/, "", $1); print $1; exit }' | grep . ||
    th_die "no Debian mirror found in /etc/apt (set TH_MIRROR)"
}

# th__prune NAME KEEP: remove the other cached NAME-* entries (older recipes),
# except those a running process still uses. A new entry replaces its
# predecessors, so the cache does not grow with every recipe change.
th__prune() {
  local name=$1 keep=$2 d
  for d in "$TH_CACHE/$name"-*; do
    [[ -d $d && $d != "$keep" ]] || continue
    if th__in_use "$d"; then th_log "keeping old $(basename "$d"): in use"; continue; fi
    th_log "pruning old $(basename "$d")"
    rm -rf "$d" "$TH_CACHE/.log/$(basename "$d").log" "$TH_CACHE/.lock/$(basename "$d")"
  done
}

# th__cached NAME KEY BUILDER [ARGS...]: echo $TH_CACHE/NAME-KEY, building it first
# with "BUILDER TMPDIR ARGS..." if absent. Built in a temp dir and renamed into place,
# so an interrupted build is never reused; a lock serialises concurrent callers.
th__cached() {
  local name=$1 key=$2 builder=$3; shift 3
  local final=$TH_CACHE/$name-$key
  if [[ -d $final ]]; then echo "$final"; return; fi
  mkdir -p "$TH_CACHE/.tmp" "$TH_CACHE/.lock" "$TH_CACHE/.log"
  local lockfd
  exec {lockfd}>"$TH_CACHE/.lock/$name-$key"
  if ! flock -n "$lockfd"; then
    th_log "waiting for another build of $name-$key"
    flock "$lockfd"
  fi
  if [[ ! -d $final ]]; then
    rm -rf "$TH_CACHE/.tmp/$name-$key".*
    local tmp log t rc=0
    tmp=$(mktemp -d "$TH_CACHE/.tmp/$name-$key.XXXXXX")
    # Scratch space for the builder, removed afterwards either way.
    export TH_WORK=$tmp.work
    mkdir -p "$TH_WORK"
    log=$TH_CACHE/.log/$name-$key.log
    t=$(th__now)
    th_log "building $name ($key), log: $log"
    # A fresh bash, so that set -e holds in the builder even when our caller runs us
    # under "||" or "if" (bash ignores -e there, in subshells too).
    TH_CACHE=$TH_CACHE TH_SUITE=$TH_SUITE TH_MIRROR=$(th_mirror) \
      bash -c 'set -euo pipefail; . "$0"; "$@"' "$TH_DIR/lib.sh" "$builder" "$tmp" "$@" \
      </dev/null >"$log" 2>&1 || rc=$?
    rm -rf "$TH_WORK"
    if ((rc != 0)); then
      tail -n 40 "$log" >&2
      rm -rf "$tmp"
      exec {lockfd}>&-
      th_die "building $name failed (rc=$rc), full log: $log"
      return 1
    fi
    chmod 755 "$tmp"   # mktemp made it 0700; it may be a root directory or read by VM users
    mv -T "$tmp" "$final"
    grep -a '^\[th ' "$log" >&2 || true
    th_log "built $name in $(th__since "$t"), size $(du -sh "$final" | cut -f1)"
    [[ ${TH_PRUNE:-1} == 1 ]] && th__prune "$name" "$final"
  fi
  exec {lockfd}>&-
  echo "$final"
}

# Run a command in a directory tree with systemd-nspawn (not booted), sharing the
# host's network (for apt). Extra nspawn options go before "--".
th__nspawn_run() {
  local dir=$1; shift
  local opts=()
  while [[ $# -gt 0 && $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  systemd-nspawn -q --register=no --keep-unit --resolv-conf=replace-host \
    -E DEBIAN_FRONTEND=noninteractive -E LC_ALL=C.UTF-8 -D "$dir" "${opts[@]}" -- "$@"
}

# ---------------------------------------------------------------- rootfs

th__build_rootfs() {
  local d=$1 mirror; mirror=$(th_mirror)
  set -x
  debootstrap --variant=minbase "$TH_SUITE" "$d" "$mirror"
  th__nspawn_run "$d" -- apt-get update
  th__nspawn_run "$d" -- apt-get install -y --no-install-recommends "${TH_ROOTFS_PKGS[@]}"
  echo "$TH_HOSTNAME" >"$d/etc/hostname"
  printf '127.0.0.1 localhost\n127.0.1.1 %s\n::1 localhost ip6-localhost ip6-loopback\n' \
    "$TH_HOSTNAME" >"$d/etc/hosts"
  local u
  for u in "${TH_ROOTFS_MASK[@]}"; do ln -sfn /dev/null "$d/etc/systemd/system/$u"; done
  # No root password prompt trouble on the console, and a quiet login prompt.
  th__nspawn_run "$d" -- passwd -d root
  th__nspawn_run "$d" -- apt-get clean
  rm -rf "$d"/var/lib/apt/lists/* "$d"/var/log/apt/* "$d"/var/cache/debconf/*-old
  dpkg-query --admindir="$d/var/lib/dpkg" -W >"$d/.kvirt-packages"
}

th__rootfs_key() {
  { declare -f th__build_rootfs th__nspawn_run; echo "$TH_SUITE";
    echo "${TH_ROOTFS_PKGS[*]}"; echo "${TH_ROOTFS_MASK[*]}"; echo "$TH_HOSTNAME"; } | th__hash
}

# th_rootfs: echo the path of the cached Debian $TH_SUITE rootfs (read-only: boot it
# with --volatile=overlay, never modify it).
th_rootfs() {
  th__cached rootfs "$TH_SUITE-$(th__rootfs_key)" th__build_rootfs
}

# Version of a package installed in the rootfs.
th__rootfs_pkgver() {
  awk -v p="$2" '$1 == p || $1 == p":amd64" { print $2 }' "$1/.kvirt-packages"
}

# ---------------------------------------------------------------- guest images

# /init of the guest initramfs (busybox sh). Mode from the kernel command line:
# kvirt.mode=run (default) or kvirt.mode=poweroff.
th__guest_init() {
  cat <<'INIT'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /dev/pts /run /tmp && mount -t devpts devpts /dev/pts
mode=run
for a in $(cat /proc/cmdline); do
  case $a in kvirt.mode=*) mode=${a#kvirt.mode=} ;; esac
done
# Modules listed in load order (dependencies first) by the image builder.
while read -r m; do insmod "/lib/modules/$m.ko" 2>/dev/null || echo "kvirt-guest: insmod $m failed"; done </lib/modules/order
acpi=no
i=0; while [ $i -lt 20 ] && ! ls /dev/input/event* >/dev/null 2>&1; do i=$((i + 1)); sleep 0.1; done
if ls /dev/input/event* >/dev/null 2>&1 && acpid -c /etc/acpi -l /run/acpid.log; then acpi=yes; fi
# Network: DHCP on each NIC (virtio-net) in the background; eth0's lease is
# printed as KVIRT-GUEST-IP <address>, another's as KVIRT-GUEST-IP-ethN
# <address>, by /etc/udhcpc.script.
for nic in /sys/class/net/eth*; do
  [ -e "$nic" ] || continue
  ip link set "${nic##*/}" up
  udhcpc -f -i "${nic##*/}" -s /etc/udhcpc.script -t 5 -T 1 -A 2 -S >/dev/null 2>&1 &
done
# DHCPv6 on eth0 where the network offers it (KubeVirt's dual-stack
# masquerade); the lease is printed as KVIRT-GUEST-DHCP6 <address>.
# udhcpc6 sends from eth0's link-local address, so it starts once there is one.
if [ -e /sys/class/net/eth0 ]; then
  (
    i=0
    while [ $i -lt 50 ] && ! ip -6 addr show dev eth0 | grep -q fe80; do i=$((i + 1)); sleep 0.2; done
    exec udhcpc6 -f -i eth0 -s /etc/udhcpc6.script -t 5 -T 1 -A 2 >/dev/null 2>&1
  ) &
fi
if [ -e /sys/class/net/eth0 ]; then
  ip link set lo up
  # Two TCP listeners for the port-forwarding tests: each answers its port.
  for p in 8080 9090; do
    mkdir -p /www/$p && echo "KVIRT-HELLO $p" >/www/$p/index.html && httpd -p $p -h /www/$p
  done
fi
# cloud-init, as little of it as the tests need: a NoCloud (cidata) or
# ConfigDrive (config-2) seed's user-data runs when it is a script. Other
# ISOs (configMap/secret/serviceAccount disks) show their files: the first
# 24 bytes of each, one line per file.
for dev in /dev/vd? /dev/sd? /dev/sr?; do
  [ -b "$dev" ] || continue
  # The ISO 9660 volume id (busybox has no blkid): 32 bytes at 32808.
  [ "$(dd if="$dev" bs=1 skip=32769 count=5 2>/dev/null)" = CD001 ] || continue
  label=$(dd if="$dev" bs=1 skip=32808 count=32 2>/dev/null | tr -d ' ')
  mkdir -p /seed && mount -t iso9660 -o ro "$dev" /seed || continue
  echo "KVIRT-GUEST-SEED $label $(ls /seed | tr '\n' ' ')"
  case $label in
    cidata | config-2)
      for ud in /seed/user-data /seed/openstack/latest/user_data; do
        if [ -f "$ud" ] && [ "$(head -c 2 "$ud")" = "#!" ]; then sh "$ud"; fi
      done
      ;;
    *)
      for f in /seed/*; do
        [ -f "$f" ] && echo "KVIRT-GUEST-FILE $label/${f#/seed/} $(head -c 24 "$f" | tr -d '\n')"
      done
      ;;
  esac
  umount /seed
done
# A guest agent, as little of it as the tests need, on the agent's
# virtio-serial port: guest-sync (libvirt's handshake), guest-get-osinfo and
# guest-shutdown (a reboot says so on the console first; QGA sends no reply).
# One descriptor both ways (a port opens once at a time), kept open: a read
# returns EOF until the host end connects, which libvirt does only once it
# sees the port opened.
for p in /sys/class/virtio-ports/*; do
  [ "$(cat "$p/name" 2>/dev/null)" = org.qemu.guest_agent.0 ] || continue
  port=/dev/${p##*/}
  {
    while :; do
      if ! read -r line <&3; then sleep 1; continue; fi
      case $line in
        *guest-sync*) echo "{\"return\": $(echo "$line" | sed -n 's/.*"id": *\([0-9]*\).*/\1/p')}" >&3 ;;
        *guest-shutdown*reboot*) echo "KVIRT-GUEST-AGENT-REBOOT" >/dev/console; reboot -f ;;
        *guest-get-users*) echo '{"return": [{"user": "kvirt", "login-time": 1700000000.5}]}' >&3 ;;
        *guest-get-fsinfo*) echo '{"return": [{"name": "vda", "mountpoint": "/", "type": "ext4", "total-bytes": 104857600, "used-bytes": 52428800, "disk": []}]}' >&3 ;;
        *guest-get-osinfo*) echo "{\"return\": {\"id\": \"kvirt-test\", \"name\": \"kvirt test guest\", \"pretty-name\": \"kvirt test guest 1\", \"version-id\": \"1\", \"kernel-release\": \"$(uname -r)\", \"machine\": \"$(uname -m)\"}}" >&3 ;;
        *) echo '{"return": {}}' >&3 ;;
      esac
    done
  } 3<>"$port" &
  echo "KVIRT-GUEST-AGENT $port"
done
echo "KVIRT-GUEST-READY mode=$mode acpi=$acpi cpus=$(grep -c ^processor /proc/cpuinfo)"
case $mode in
  poweroff)
    sleep 3
    echo "KVIRT-GUEST-POWEROFF"
    poweroff -f
    ;;
esac
n=0
while :; do
  n=$((n + 1))
  echo "KVIRT-GUEST-ALIVE $n"
  sleep 2
done
INIT
}

th__build_guest() {
  local out=$1 rootfs=$2
  local w=$TH_WORK
  set -x
  # The kernel: trixie's linux-image-amd64, downloaded with the rootfs's own apt.
  mkdir -p "$w/debs"
  th__nspawn_run "$rootfs" --volatile=overlay --bind="$w/debs:/debs" -- sh -euc '
    apt-get update -qq
    dep=$(apt-cache depends linux-image-amd64 | awk "/Depends: linux-image-[0-9]/ { print \$2; exit }")
    cd /debs && apt-get download "$dep"'
  dpkg-deb -x "$w"/debs/linux-image-*.deb "$w/k"
  local kver
  local moddir
  for moddir in "$w"/k/usr/lib/modules/* "$w"/k/lib/modules/*; do [[ -d $moddir ]] && break; done
  kver=$(basename "$moddir")
  cp "$w/k/boot/vmlinuz-$kver" "$out/vmlinuz"
  # The initramfs: busybox-static from the rootfs, /init, a few modules.
  local ir=$w/initrd
  mkdir -p "$ir"/{bin,dev,proc,sys,run,tmp,etc/acpi/PWRF,lib/modules}
  cp "$rootfs/usr/bin/busybox" "$ir/bin/busybox"
  th__guest_init >"$ir/init"
  chmod 755 "$ir/init"
  printf '#!/bin/sh\necho KVIRT-GUEST-ACPI-POWEROFF >/dev/console\npoweroff -f\n' >"$ir/etc/acpi/PWRF/00000080"
  cat >"$ir/etc/udhcpc.script" <<'DHCP'
#!/bin/sh
case $1 in
  bound|renew)
    ip -4 addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
    if [ "$interface" != eth0 ]; then
      echo "KVIRT-GUEST-IP-$interface $ip router=${router%% *} mtu=$mtu" >/dev/console
      exit 0
    fi
    [ -n "$router" ] && ip route replace default via "${router%% *}" dev "$interface"
    : >/etc/resolv.conf
    for d in $dns; do echo "nameserver $d" >>/etc/resolv.conf; done
    echo "KVIRT-GUEST-IP $ip router=${router%% *} dns=$(echo $dns | tr ' ' ,) mtu=$mtu" >/dev/console
    ;;
esac
DHCP
  # KubeVirt sends no router advertisements: a dual-stack guest is told its
  # prefix and route by its own configuration (cloud-init's networkData in
  # KubeVirt's docs), here: the masquerade's fd10:0:2::/120 and ::1.
  cat >"$ir/etc/udhcpc6.script" <<'DHCP6'
#!/bin/sh
case $1 in
  bound|renew)
    [ -n "$ipv6" ] || exit 0
    ip -6 addr add "$ipv6/120" dev "$interface" 2>/dev/null
    ip -6 route replace default via fd10:0:2::1 dev "$interface"
    echo "KVIRT-GUEST-DHCP6 $ipv6" >/dev/console
    ;;
esac
DHCP6
  chmod 755 "$ir/etc/acpi/PWRF/00000080" "$ir/etc/udhcpc.script" "$ir/etc/udhcpc6.script"
  # Kernel modules (the kernel package has no modules.dep: read depends= from each
  # module's .modinfo), written in load order.
  local -A seen=()
  th__guest_mod() {
    local m=$1 f dep deps
    [[ -n ${seen[$m]:-} ]] && return 0
    seen[$m]=1
    f=$(find "$moddir" -name "$m.ko" -o -name "$m.ko.xz" -o -name "$m.ko.zst" | head -n1)
    [[ -n $f ]] || { echo "module $m not found (built in?)"; return 0; }
    case $f in
      *.xz) xz -dc "$f" ;;
      *.zst) zstd -dcq "$f" ;;
      *) cat "$f" ;;
    esac >"$ir/lib/modules/$m.ko"
    deps=$(tr '\0' '\n' <"$ir/lib/modules/$m.ko" | sed -n 's/^depends=//p')
    for dep in ${deps//,/ }; do th__guest_mod "${dep//-/_}"; done
    echo "$m" >>"$ir/lib/modules/order"
  }
  : >"$ir/lib/modules/order"
  local m
  # ahci, sd_mod, sr_mod: SATA disks and cdroms, KubeVirt's default bus.
  # (tpm_tis and tpm_crb, for a vTPM, are built into Debian's kernel.)
  for m in evdev button virtio_net virtio_blk ahci sd_mod sr_mod isofs virtio_console; do
    th__guest_mod "$m"
  done
  (cd "$ir" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet --reproducible) |
    gzip -9n >"$out/initrd.img"
  echo "$kver" >"$out/kernel-version"
  # Two bootable raw disks: unpartitioned FAT "superfloppies" with syslinux
  # for BIOS and a standalone GRUB as the removable-media loader
  # (EFI/BOOT/BOOTX64.EFI) for UEFI. The GRUB is unsigned: Secure Boot
  # refuses it.
  local mode
  for mode in run poweroff; do
    local img=$out/$mode.raw
    rm -f "$img"
    mkfs.vfat -n KVIRTGUEST -C "$img" $((48 * 1024))
    printf 'DEFAULT linux\nPROMPT 0\nTIMEOUT 0\nLABEL linux\n  KERNEL vmlinuz\n  APPEND initrd=initrd.img console=ttyS0 quiet kvirt.mode=%s\n' \
      "$mode" >"$w/syslinux.cfg"
    mcopy -i "$img" "$out/vmlinuz" "$out/initrd.img" "$w/syslinux.cfg" ::
    syslinux --install "$img"
    printf 'set timeout=0\nset root=(hd0)\nlinux /vmlinuz console=ttyS0 quiet kvirt.mode=%s\ninitrd /initrd.img\nboot\n' \
      "$mode" >"$w/grub.cfg"
    grub-mkstandalone -O x86_64-efi --locales= --fonts= --themes= \
      -o "$w/BOOTX64.EFI" "boot/grub/grub.cfg=$w/grub.cfg"
    mmd -i "$img" ::EFI ::EFI/BOOT
    mcopy -i "$img" "$w/BOOTX64.EFI" ::EFI/BOOT/
  done
  set +x
  th__guest_verify "$out" "$rootfs"
}

# th__qemu_boot ROOTFS GUESTDIR NAME QEMU-ARGS...: start QEMU (TCG) from the rootfs in
# the background, serial console to GUESTDIR/NAME.serial, monitor on fifos
# GUESTDIR/NAME.mon.{in,out}. Sets TH_QEMU_PID (the nspawn process).
th__qemu_boot() {
  local rootfs=$1 dir=$2 name=$3; shift 3
  rm -f "$dir/$name.serial" "$dir/$name.mon".*
  mkfifo "$dir/$name.mon.in" "$dir/$name.mon.out"
  : >"$dir/$name.serial"
  th__nspawn_run "$rootfs" --volatile=overlay --bind="$dir:/g" --console=pipe -- \
    qemu-system-x86_64 -machine accel=tcg -m 256 -nographic -no-user-config -nodefaults \
    -serial file:"/g/$name.serial" -monitor pipe:"/g/$name.mon" "$@" \
    </dev/null >"$dir/$name.qemu.log" 2>&1 &
  TH_QEMU_PID=$!
}

# Kill an nspawn process started by th__qemu_boot together with its payload.
th__nspawn_kill() {
  local nspawn=$1 pid1
  pid1=$(th__find_pid1 "$nspawn" || true)
  kill -KILL ${pid1:+"$pid1"} "$nspawn" 2>/dev/null || true
  wait "$nspawn" 2>/dev/null || true
}

th__guest_verify() {
  local dir=$1 rootfs=$2 t pid mon
  # run.raw: boots, READY, keeps printing ALIVE; then ACPI power button.
  t=$(th__now)
  th__qemu_boot "$rootfs" "$dir" run -drive file=/g/run.raw,format=raw,if=virtio,readonly=on \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0
  pid=$TH_QEMU_PID
  exec {mon}<>"$dir/run.mon.out"   # keep the monitor's output drained
  th_wait 120 grep -q KVIRT-GUEST-READY "$dir/run.serial" || { th__nspawn_kill "$pid"; cat "$dir/run.serial" "$dir/run.qemu.log"; return 1; }
  th_log "run.raw: READY after $(th__since "$t")"
  th_wait 30 grep -q 'KVIRT-GUEST-ALIVE 2' "$dir/run.serial" || { th__nspawn_kill "$pid"; return 1; }
  th_wait 30 grep -q 'KVIRT-GUEST-IP 10.0.2.15' "$dir/run.serial" || { th__nspawn_kill "$pid"; cat "$dir/run.serial"; return 1; }
  th_log "run.raw: DHCP lease on virtio-net (QEMU user network) after $(th__since "$t")"
  echo system_powerdown >"$dir/run.mon.in"
  if th_wait 30 th__dead "$pid" && grep -q KVIRT-GUEST-ACPI-POWEROFF "$dir/run.serial"; then
    th_log "run.raw: ACPI power button -> guest powered off after $(th__since "$t")"
    echo yes >"$dir/acpi-powerdown"
  else
    th_log "run.raw: no reaction to the ACPI power button"
    echo no >"$dir/acpi-powerdown"
    th__nspawn_kill "$pid"
  fi
  wait "$pid" || true
  exec {mon}>&-
  # poweroff.raw: READY, POWEROFF, and QEMU exits by itself.
  t=$(th__now)
  th__qemu_boot "$rootfs" "$dir" poweroff -drive file=/g/poweroff.raw,format=raw,if=virtio,readonly=on
  pid=$TH_QEMU_PID
  exec {mon}<>"$dir/poweroff.mon.out"
  th_wait 120 grep -q KVIRT-GUEST-READY "$dir/poweroff.serial" || { th__nspawn_kill "$pid"; cat "$dir/poweroff.serial"; return 1; }
  th_wait 30 th__dead "$pid" || { th__nspawn_kill "$pid"; th_die "poweroff.raw did not power off"; }
  wait "$pid" || true
  exec {mon}>&-
  grep -q KVIRT-GUEST-POWEROFF "$dir/poweroff.serial" || th_die "no POWEROFF marker"
  th_log "poweroff.raw: READY, POWEROFF, QEMU exited after $(th__since "$t")"
  rm -f "$dir"/*.mon.* "$dir"/*.qemu.log
  mkdir -p "$dir/verify" && mv "$dir"/*.serial "$dir/verify/"
}

th__guest_key() {
  { declare -f th__build_guest th__guest_init th__guest_verify th__qemu_boot; basename "$1"; } | th__hash
}

# th_guest: echo a directory with run.raw, poweroff.raw (bootable raw disks),
# vmlinuz, initrd.img (direct kernel boot; cmdline "console=ttyS0 kvirt.mode=run|poweroff"),
# kernel-version, acpi-powerdown (yes/no).
th_guest() {
  local rootfs; rootfs=$(th_rootfs)
  th__cached guest "$(th__guest_key "$rootfs")" th__build_guest "$rootfs"
}

# ---------------------------------------------------------------- booted test hosts
#
# State of test host NAME: $TH_STATE/NAME/ with nspawn.pid, pid1, console.log and
# share/ (bound at /share inside). th_stop removes the pid files and keeps the log
# and share/ for post-mortems; th_boot of the same NAME wipes them.


# th_pid1 NAME: echo the container's PID 1 (as seen from the host).
th_pid1() {
  local f=$TH_STATE/$1/pid1 pid
  [[ -r $f ]] || th_die "test host $1 is not running (no $f)" || return
  pid=$(<"$f")
  th__alive "$pid" || th_die "test host $1: PID 1 ($pid) is gone" || return
  echo "$pid"
}

# The container's init: the process in a new PID namespace (NSpid ends in 1) whose
# ancestor is our nspawn process.
th__find_pid1() {
  local nspawn=$1 p st
  for st in /proc/[0-9]*/status; do
    p=${st#/proc/}; p=${p%/status}
    awk '/^NSpid:/ { exit !(NF == 3 && $3 == 1) }' "$st" 2>/dev/null || continue
    local q=$p i=0
    while ((q > 1 && i++ < 8)); do
      q=$(awk '/^PPid:/ { print $2 }' "/proc/$q/status" 2>/dev/null) || break
      if [[ $q == "$nspawn" ]]; then echo "$p"; return 0; fi
    done
  done
  return 1
}

th__system_running() {
  local s
  th__alive "$1" || return 0   # gone: stop waiting, the caller checks again
  s=$(nsenter -t "$1" -a systemctl is-system-running 2>/dev/null) || true
  [[ $s == running || $s == degraded ]]
}

# th_loop NAME: a loop device of the host on a fresh 64 MiB file kept for test
# host NAME (block claims' tests); echoes its /dev path. Fails where the
# kernel has no loop devices. th_stop NAME detaches it.
th_loop() {
  local img=$TH_STATE/$1.loop.img
  [[ -e /dev/loop-control ]] || { th_log "no /dev/loop-control: no loop device for $1"; return 1; }
  th__unloop "$1"
  rm -f "$img" && truncate -s 64M "$img" && losetup -f --show "$img"
}

th__unloop() {
  local img=$TH_STATE/$1.loop.img d
  [[ -e $img ]] || return 0
  for d in $(losetup -j "$img" -n -O NAME 2>/dev/null); do losetup -d "$d" || true; done
}

# th_boot NAME: boot the rootfs in a systemd-nspawn container named NAME; echo its PID 1.
# Env: TH_BIND_RO="src:dst ..." (read-only binds), TH_BIND="src:dst ..." (read-write),
# TH_NSPAWN_OPTS="..." (more nspawn options), TH_BOOT_TIMEOUT (s, default 60).
th_boot() {
  local name=$1 rootfs st t nspawn pid1 b
  rootfs=$(th_rootfs) || return
  st=$TH_STATE/$name
  if [[ -r $st/nspawn.pid ]] && th__alive "$(<"$st/nspawn.pid")"; then
    th_log "test host $name is already running: stopping it first"
    th_stop "$name"
  fi
  rm -rf "$st"
  mkdir -p "$st/share"
  # TH_NETNS_OF=OTHER shares test host OTHER's network namespace (and so its
  # loopback services) instead of a private one.
  local net=--private-network
  if [[ -n ${TH_NETNS_OF:-} ]]; then
    net=--network-namespace-path=/proc/$(th_pid1 "$TH_NETNS_OF")/ns/net
  fi
  local args=(-b -D "$rootfs" --register=no --keep-unit --capability=all "$net"
    --volatile=overlay --machine="$name" --console=read-only --bind="$st/share:/share")
  for b in ${TH_BIND_RO:-}; do args+=("--bind-ro=$b"); done
  for b in ${TH_BIND:-}; do args+=("--bind=$b"); done
  # shellcheck disable=SC2206
  args+=(${TH_NSPAWN_OPTS:-})
  t=$(th__now)
  th_log "booting test host $name"
  # Each test host in a cgroup of its own, as machines are: nspawn puts its
  # payload below its own cgroup, so two hosts booted from one shell would
  # share one tree, and a VM of one id on both (a migration) one unit
  # cgroup, which neither host's systemd could then collect.
  setsid bash -c 'for h in systemd unified; do
      d=/sys/fs/cgroup/$h/kvirt-th-$1
      [[ -d /sys/fs/cgroup/$h ]] || continue
      mkdir -p "$d" && echo $$ >"$d/cgroup.procs"
    done
    shift; exec systemd-nspawn "$@"' _ "$name" "${args[@]}" </dev/null >"$st/console.log" 2>&1 &
  nspawn=$!
  echo "$nspawn" >"$st/nspawn.pid"
  # Wait for the container's init (or for nspawn to die: then fail at once).
  th__pid1_found() { pid1=$(th__find_pid1 "$nspawn") || { pid1=; th__dead "$nspawn"; }; }
  if ! th_wait 30 th__pid1_found || [[ -z $pid1 ]]; then
    tail -n 30 "$st/console.log" >&2
    th_die "test host $name: no container init found"; return
  fi
  echo "$pid1" >"$st/pid1"
  if ! th_wait "${TH_BOOT_TIMEOUT:-60}" th__system_running "$pid1" || th__dead "$pid1"; then
    tail -n 30 "$st/console.log" >&2
    nsenter -t "$pid1" -a systemctl --failed --no-legend >&2 || true
    th_stop "$name" || true
    th_die "test host $name did not reach running/degraded"; return
  fi
  local state; state=$(nsenter -t "$pid1" -a systemctl is-system-running 2>/dev/null || true)
  if [[ $state == degraded ]]; then
    th_log "test host $name is degraded; failed units:"
    nsenter -t "$pid1" -a systemctl --failed --no-legend --plain >&2 || true
  fi
  th_log "test host $name $state in $(th__since "$t") (PID 1 = $pid1)"
  echo "$pid1"
}

# th_share NAME: the host directory bound at /share in test host NAME.
th_share() { echo "$TH_STATE/$1/share"; }
# th_console_log NAME: the host file with test host NAME's console output.
th_console_log() { echo "$TH_STATE/$1/console.log"; }

# th_exec NAME CMD...: run CMD inside test host NAME as a transient service (with the
# container's credentials and capabilities), stdin/stdout/stderr piped, exit code
# propagated. Extra systemd-run options: TH_EXEC_OPTS="-p User=kvirt ...".
th_exec() {
  local name=$1 pid; shift
  pid=$(th_pid1 "$name") || return
  # shellcheck disable=SC2086
  nsenter -t "$pid" -a systemd-run --wait --pipe --quiet --collect ${TH_EXEC_OPTS:-} -- "$@"
}

# th_sh NAME 'shell snippet'
th_sh() { local name=$1; shift; th_exec "$name" /bin/bash -euc "$1"; }

# th_copy_in NAME SRC DST: copy a file or directory tree into the running test host
# (DST is the full destination path; the overlay root takes the write).
th_copy_in() {
  local name=$1 src=$2 dst=$3 pid
  pid=$(th_pid1 "$name") || return
  if [[ -d $src ]]; then
    tar -C "$src" -cf - . | nsenter -t "$pid" -a /bin/sh -c 'mkdir -p "$1" && tar -C "$1" -xf -' sh "$dst"
  else
    nsenter -t "$pid" -a /bin/sh -c 'mkdir -p "$(dirname "$1")" && cat >"$1" && chmod "$2" "$1"' \
      sh "$dst" "$(stat -c %a "$src")" <"$src"
  fi
}

# th_stop NAME: stop kvirt-vm@* units inside, then the container (SIGTERM to nspawn,
# SIGKILL after TH_STOP_TIMEOUT s, default 30).
th_stop() {
  local name=$1 st nspawn pid1 t
  st=$TH_STATE/$name
  th__unloop "$name"
  [[ -r $st/nspawn.pid ]] || { th_log "test host $name: not running"; return 0; }
  nspawn=$(<"$st/nspawn.pid")
  pid1=$(cat "$st/pid1" 2>/dev/null || true)
  t=$(th__now)
  if [[ -n $pid1 ]] && th__alive "$pid1"; then
    timeout 20 nsenter -t "$pid1" -a systemctl stop 'kvirt-vm@*.service' >&2 || true
  fi
  if th__alive "$nspawn"; then
    kill -TERM "$nspawn" 2>/dev/null || true
    th__gone() { ! th__alive "$nspawn"; }
    if ! th_wait "${TH_STOP_TIMEOUT:-30}" th__gone; then
      th_log "test host $name: SIGKILL"
      kill -KILL "$nspawn" ${pid1:+"$pid1"} 2>/dev/null || true
      th_wait 10 th__gone || true
    fi
  fi
  wait "$nspawn" 2>/dev/null || true
  rm -f "$st/nspawn.pid" "$st/pid1"
  th_log "test host $name stopped in $(th__since "$t")"
}

# ---------------------------------------------------------------- virtqemud

# Debian builds virtqemud and leaves it out of its packages. Build only that target
# from Debian's own libvirt source (the version installed in the rootfs), in a
# throwaway copy of the rootfs, and keep just the binary.
th__build_virtqemud() {
  local out=$1 rootfs=$2 ver=$3 mirror
  local w=$TH_WORK
  mirror=$(th_mirror)
  set -x
  cp -a "$rootfs" "$w/root"
  echo "deb-src $mirror $TH_SUITE main" >"$w/root/etc/apt/sources.list.d/kvirt-src.list"
  mkdir -p "$w/src"
  th__nspawn_run "$w/root" --bind="$w/src:/src" -E VER="$ver" -- bash -euxc '
    log() { echo "[th $(date +%T)] virtqemud: $*"; }
    log "installing build dependencies"
    apt-get update
    apt-get install -y --no-install-recommends build-essential dpkg-dev fakeroot patchelf quilt
    apt-get build-dep -y --no-install-recommends "libvirt=$VER"
    log "fetching the source of libvirt $VER"
    cd /src
    # Some mirrors/proxies refuse .dsc files: apt still fetches (and checks against the
    # signed Sources index) the tarballs, which are unpacked by hand then.
    apt-get source --only-source "libvirt=$VER" || true
    if ! ls -d libvirt-*/debian >/dev/null 2>&1; then
      ls -l
      mkdir unpack
      tar -C unpack -xf libvirt_*.orig.tar.*
      d=$(echo unpack/*)
      tar -C "$d" -xf libvirt_*.debian.tar.*
      (cd "$d" && QUILT_PATCHES=debian/patches quilt push -a --quiltrc=/dev/null)
      mv "$d" "libvirt-${VER%%-*}"
    fi
    cd libvirt-*/
    log "configuring"
    debian/rules override_dh_auto_configure
    log "building src/virtqemud"
    ninja -C obj-x86_64-linux-gnu src/virtqemud
    log "built"
    cp obj-x86_64-linux-gnu/src/virtqemud /src/virtqemud
    patchelf --remove-rpath /src/virtqemud
    strip --strip-unneeded /src/virtqemud'
  cp "$w/src/virtqemud" "$out/virtqemud"
  echo "$ver" >"$out/libvirt-version"
  set +x
  # It must run against the rootfs's own libvirt libraries.
  th__nspawn_run "$rootfs" --volatile=overlay --bind-ro="$out/virtqemud:/usr/sbin/virtqemud" -- \
    /usr/sbin/virtqemud --version | tee "$out/version"
  grep -q "${ver%%-*}" "$out/version"
}

# th_virtqemud: echo the path of a virtqemud binary built from Debian's libvirt source,
# the same version as the rootfs's libvirt (install it at /usr/sbin/virtqemud).
th_virtqemud() {
  local rootfs ver key dir
  rootfs=$(th_rootfs) || return
  ver=$(th__rootfs_pkgver "$rootfs" libvirt-daemon)
  ver=${ver%+b[0-9]*}          # binNMU suffix: the source version is without it
  [[ -n $ver ]] || th_die "no libvirt-daemon in $rootfs" || return
  key=$({ declare -f th__build_virtqemud; echo "$TH_SUITE"; } | th__hash)
  dir=$(th__cached virtqemud "${ver//[:~]/_}-$key" th__build_virtqemud "$rootfs" "$ver") || return
  echo "$dir/virtqemud"
}
