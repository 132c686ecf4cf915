#!/usr/bin/env bash
# install-kvirt.sh NAME DEB [DAEMON]: install kvirt into the booted test host
# NAME from its .deb with apt, as an operator would, with the test settings
# as a drop-in (the packaged /etc/kvirt/kvirtd.toml stays untouched, so
# upgrades see an unmodified conffile); wait until kvirtd is ready.
# DAEMON is virtqemud (default) or libvirtd.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=lib.sh
source "$here/lib.sh"
name=$1 deb=$2 daemon=${3:-virtqemud}

th_copy_in "$name" "$deb" /root/kvirt.deb
th_sh "$name" "
# nspawn makes /dev/net/tun root-only; a real host's udev makes it 0666,
# which the VMs' unprivileged QEMU needs to open its tap.
chmod 0666 /dev/net/tun
mkdir -p /etc/kvirt/kvirtd.toml.d
cat > /etc/kvirt/kvirtd.toml.d/50-test.toml <<'EOF2'
# Test host: no KVM here, QEMU emulates.
[vm]
daemon = \"$daemon\"
emulation = \"always\"
[storage]
# The tests' registry, on the test host's loopback.
local_registries = [\"127.0.0.1:5000\"]
[network]
# Handed to guests by DHCP (a documentation address: nothing is sent there).
dns = [\"192.0.2.53\"]
# Short, so the tests see guests renew.
dhcp_lease_seconds = 20
EOF2
DEBIAN_FRONTEND=noninteractive apt-get install -y -q /root/kvirt.deb
"
th_wait 60 th_sh "$name" "systemctl is-active -q kvirtd" || {
  th_sh "$name" "journalctl -u kvirtd --no-pager -n 50" >&2 || true
  th_die "kvirtd did not become active"
}
th_log "kvirt installed from $(basename "$deb") in test host $name ($daemon)"
