#!/bin/bash
# Smoke test of the harness: boot a test host, run a session-mode virtqemud as an
# unprivileged user in a transient unit inside a network namespace, and boot the
# guest disk through libvirt until its serial console marker is read.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

name=${TH_SMOKE_NAME:-kvirt-smoke}
unit=kvirt-vm@smoke_vm1.service
rt=/run/kvirt/vms/smoke_vm1
sock=$rt/libvirt/virtqemud-sock
uri="qemu:///session?socket=$sock"

t0=$(th__now)
th_host_deps
vq=$(th_virtqemud)
guest=$(th_guest)
th_log "artefacts ready in $(th__since "$t0")"

export TH_BIND_RO="$vq:/usr/sbin/virtqemud $guest:/guest"
cleanup() {
  local rc=$?
  if ((rc != 0)) && [[ -n ${pid1:-} ]]; then
    th_log "smoke failed (rc=$rc); unit status and logs:"
    nsenter -t "$pid1" -a systemctl status --no-pager -n 30 "$unit" >&2 || true
    nsenter -t "$pid1" -a sh -c "cat $rt/cache/libvirt/qemu/log/*.log" >&2 || true
  fi
  th_stop "$name" || true
  exit "$rc"
}
trap cleanup EXIT
pid1=$(th_boot "$name")

th_log "system state: $(th_exec "$name" systemctl is-system-running || true)"
th_log "installed: $(th_exec "$name" /usr/sbin/virtqemud --version)"

t=$(th__now)
th_sh "$name" "
  useradd --create-home --user-group kvirt
  ip netns add vm1
  ip -n vm1 link set lo up
  install -d -o kvirt -g kvirt $rt $rt/config/libvirt $rt/cache
  printf 'stdio_handler = \"file\"\n' >$rt/config/libvirt/qemu.conf
  chown kvirt: $rt/config/libvirt/qemu.conf
  systemd-run --unit=$unit --description='kvirt smoke VM' \
    -p User=kvirt -p NetworkNamespacePath=/run/netns/vm1 \
    -E XDG_RUNTIME_DIR=$rt -E XDG_CONFIG_HOME=$rt/config -E XDG_CACHE_HOME=$rt/cache \
    /usr/sbin/virtqemud --timeout 0
"
th__sock() { [[ -S /proc/$pid1/root$sock ]]; }
th_wait 20 th__sock
th_log "namespace + unit + libvirt socket in $(th__since "$t")"

cat >"$TH_STATE/$name/share/vm1.xml" <<XML
<domain type='qemu'>
  <name>smoke_vm1</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os><type arch='x86_64' machine='pc'>hvm</type><boot dev='hd'/></os>
  <features><acpi/></features>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <disk type='file' device='disk'>
      <driver name='qemu' type='raw'/>
      <source file='/guest/run.raw'/>
      <target dev='vda' bus='virtio'/>
      <readonly/>
    </disk>
    <serial type='unix'>
      <source mode='bind' path='$rt/serial.sock'/>
      <target port='0'/>
    </serial>
  </devices>
</domain>
XML

virsh_() {
  TH_EXEC_OPTS="-p User=kvirt -E XDG_RUNTIME_DIR=$rt -E XDG_CONFIG_HOME=$rt/config -E XDG_CACHE_HOME=$rt/cache" \
    th_exec "$name" virsh -q -c "$uri" "$@"
}
t=$(th__now)
virsh_ define /share/vm1.xml >&2
th_log "define in $(th__since "$t")"
t=$(th__now)
virsh_ start smoke_vm1 >&2
th_log "start in $(th__since "$t")"

# QEMU runs as kvirt, inside the unit's cgroup and inside the namespace (libvirt
# daemonizes it, so its parent is PID 1, not the unit's main process).
th_sh "$name" "
  q=\$(pgrep -u kvirt -f qemu-system-x86_64) || { echo 'no qemu running as kvirt'; exit 1; }
  grep -q 'kvirt-vm@smoke_vm1.service' /proc/\$q/cgroup || { echo 'qemu not in the unit'; cat /proc/\$q/cgroup; exit 1; }
  [ \"\$(ip netns identify \$q)\" = vm1 ] || { echo 'qemu not in netns vm1'; exit 1; }
  echo \"qemu pid \$q: user kvirt, unit $unit, netns vm1\"
" >&2

t=$(th__now)
marker=$(th_sh "$name" "timeout 90 socat -u UNIX-CONNECT:$rt/serial.sock - 2>/dev/null | grep -a -m1 -o 'KVIRT-GUEST-[A-Z]*'")
th_log "serial console: $marker after $(th__since "$t") more"
[[ $marker == KVIRT-GUEST-READY || $marker == KVIRT-GUEST-ALIVE ]]

t=$(th__now)
virsh_ destroy smoke_vm1 >&2
th_exec "$name" systemctl stop "$unit"
th_log "destroy + unit stop in $(th__since "$t")"
th_log "smoke OK in $(th__since "$t0")"
