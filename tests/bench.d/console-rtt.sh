#!/usr/bin/env bash
# In test host A of the cluster: console-rtt.sh N VMI. N console sessions of
# VMI (namespace default) through the API server as kubectl would open them
# (the admin's client certificate, to 127.0.0.1:6443): the aggregator sends
# each to a kvirtd, which serves or forwards it. For each: the websocket
# open (request sent -> 101 read) and the round trip of one typed byte
# (sent -> the guest's tty echo read). Prints JSON (microseconds); a session
# that fails prints what the server said and exits 1.
set -euo pipefail
n=$1 vmi=$2
pki=/etc/kvirt/pki
path=/apis/subresources.kubevirt.io/v1/namespaces/default/virtualmachineinstances/$vmi/console

# session OUT: one session, its socat's output in OUT; prints "OPEN ECHO".
session() {
  local out=$1 fifo pid t0 t1 t2 size
  fifo=$(mktemp -u)
  mkfifo "$fifo"
  timeout 20 socat -t 1 - "OPENSSL:127.0.0.1:6443,cafile=$pki/ca.crt,cert=$pki/admin.crt,key=$pki/admin.key,commonname=localhost" \
    <"$fifo" >"$out" 2>/dev/null &
  pid=$!
  exec 3>"$fifo"
  rm -f "$fifo"
  t0=$(date +%s%N)
  printf 'GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Protocol: plain.kubevirt.io\r\n\r\n' "$path" >&3
  until grep -aq "101 Switching" "$out"; do
    kill -0 $pid 2>/dev/null && ! grep -aq '"kind"' "$out" || return 1
    sleep 0.001
  done
  t1=$(date +%s%N)
  size=$(stat -c %s "$out")
  # One masked binary frame (mask 0) carrying a carriage return.
  printf '\x82\x81\x00\x00\x00\x00\r' >&3
  until (($(stat -c %s "$out") > size)); do
    kill -0 $pid 2>/dev/null || return 1
    sleep 0.001
  done
  t2=$(date +%s%N)
  exec 3>&-
  wait $pid || true
  echo "$(((t1 - t0) / 1000)) $(((t2 - t1) / 1000))"
}

opens=() echoes=()
for _ in $(seq "$n"); do
  out=$(mktemp)
  if ! times=$(session "$out"); then
    echo "a console session failed; the server said:" >&2
    cat -v "$out" >&2
    exit 1
  fi
  opens+=("${times% *}") echoes+=("${times#* }")
  rm -f "$out"
done
pct() { printf '%s\n' "${@:2}" | sort -n | awk -v p="$1" '{ a[NR] = $1 } END { i = int((NR - 1) * p / 100) + 1; print a[i] }'; }
printf '{"sessions": %d, "open_us": {"p50": %d, "p95": %d}, "echo_us": {"p50": %d, "p95": %d}}\n' \
  "$n" "$(pct 50 "${opens[@]}")" "$(pct 95 "${opens[@]}")" "$(pct 50 "${echoes[@]}")" "$(pct 95 "${echoes[@]}")"
