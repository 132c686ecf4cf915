#!/usr/bin/env bash
# install-kvirt.sh NAME BIN_DIR [DAEMON]: install kvirt's binaries, systemd
# files and a test configuration into the booted test host NAME, then start
# kvirtd and wait until it is ready. DAEMON is virtqemud (default) or libvirtd.
# (Until kvirt has its own package, this is the package's job done by hand.)
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
top=$(cd "$here/../.." && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
name=$1 bin=$2 daemon=${3:-virtqemud}

# Replaced by rename, as a package manager does: a running kvirtd keeps its file.
for b in kvirtd kvirtctl; do
  th_copy_in "$name" "$bin/$b" "/usr/bin/.$b.new"
  th_sh "$name" "mv -f /usr/bin/.$b.new /usr/bin/$b"
done
th_copy_in "$name" "$top/systemd/kvirtd.service" /usr/lib/systemd/system/kvirtd.service
th_copy_in "$name" "$top/systemd/machine-kvirt.slice" /usr/lib/systemd/system/machine-kvirt.slice
th_copy_in "$name" "$top/systemd/kvirt.sysusers" /usr/lib/sysusers.d/kvirt.conf
th_copy_in "$name" "$top/systemd/kvirt.tmpfiles" /usr/lib/tmpfiles.d/kvirt.conf
th_sh "$name" "
# nspawn makes /dev/net/tun root-only; a real host's udev makes it 0666,
# which the VMs' unprivileged QEMU needs to open its tap.
chmod 0666 /dev/net/tun
mkdir -p /etc/kvirt/vmis.d
cat > /etc/kvirt/kvirtd.toml <<'EOF'
# Test host: no KVM here, QEMU emulates.
[vm]
daemon = \"$daemon\"
emulation = \"always\"
[network]
# Handed to guests by DHCP (a documentation address: nothing is sent there).
dns = [\"192.0.2.53\"]
# Short, so the tests see guests renew.
dhcp_lease_seconds = 20
EOF
systemd-sysusers
systemd-tmpfiles --create
systemctl daemon-reload
systemctl enable --now kvirtd
"
th_wait 60 th_sh "$name" "systemctl is-active -q kvirtd" || {
  th_sh "$name" "journalctl -u kvirtd --no-pager -n 50" >&2 || true
  th_die "kvirtd did not become active"
}
th_log "kvirtd active in test host $name ($daemon)"
