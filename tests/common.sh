# shellcheck shell=bash
# Shared by tests/run-all and tests/run-demo: host set-up and the build.
top=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=testhost/lib.sh
source "$top/tests/testhost/lib.sh"

# Rust comes from the machine (rustup); Debian's own is too old for the
# dependencies on bookworm. Say so clearly instead of failing mid-build.
kvirt_rust() {
  [[ -x $HOME/.cargo/bin/cargo ]] && export PATH=$HOME/.cargo/bin:$PATH
  if ! command -v cargo >/dev/null; then
    th_log "cargo not found: installing Debian's Rust toolchain"
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends cargo rustc >&2
  fi
  local v; v=$(rustc --version | awk '{print $2}')
  if [[ $(printf '%s\n1.85.0\n' "$v" | sort -V | head -n1) != 1.85.0 ]]; then
    th_die "Rust $v is too old: kvirt needs 1.85 or newer (rustup's stable)"
  fi
}

kvirt_build() {
  th_host_deps
  kvirt_rust
  local t; t=$(th__now)
  (cd "$top" && cargo build --locked --bins >&2)
  th_log "kvirt built in $(th__since "$t")"
}

# Boots test host NAME with kvirt installed; echoes its PID 1.
kvirt_testhost() {
  local name=$1 rootfs guest vq pid
  rootfs=$(th_rootfs)
  guest=$(th_guest)
  vq=$(th_virtqemud)
  pid=$(TH_BIND_RO="$guest:/srv/guest $vq:/usr/sbin/virtqemud" th_boot "$name")
  bash "$top/tests/testhost/install-kvirt.sh" "$name" "$top/target/debug" >&2
  echo "$pid"
}
