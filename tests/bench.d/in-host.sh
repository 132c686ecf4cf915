#!/usr/bin/env bash
# Runs inside the benchmark's test host (see tests/bench): measures kvirt
# and the floor, prints one JSON object. Arguments: SEQ BURST MANY ROUNDS
# (the one-at-a-time and burst measures, kvirt's and the floor's, are
# taken ROUNDS times), or --churn N WINDOW (a host's life: see churn
# below), or --busy N BURST ROUNDS (a busy host: see busy below), or
# --burst N (kvirt's burst of N alone: the cluster benchmark's baseline).
set -euo pipefail
mode=figures busy_n=0
case $1 in
  --churn) mode=churn churn_n=$2 churn_w=$3 ;;
  --busy) mode=busy busy_n=$2 burst_n=$3 rounds=$4 ;;
  --burst) mode=burst burst_n=$2 ;;
  *) seq_n=$1 burst_n=$2 many_n=$3 rounds=$4 ;;
esac
# The guest ignores the power button: a delete waits out the grace. The
# one-at-a-time and burst VMs are made with none (their removal is not
# measured, and 5 s each made a round take 20 minutes); the many VMs'
# delete, which is measured, keeps 5 s.
grace=0
dir=/etc/kvirt/vmis.d
# The idle window: one resync period (kvirtd's default); shorter only for
# a quick look at the rest (BENCH_IDLE_S, passed on by tests/bench).
resync_s=${BENCH_IDLE_S:-300}
status=/run/kvirt/status
# Waiting polls without starting a process per look (bash builtins, a
# read that times out on a pipe that never speaks): the benchmark must not
# load the two CPUs it measures.
now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }
exec 9<> <(:)
nap() { read -rt "$1" -u 9 || true; }
shopt -s nullglob

# p50/p95/max of the numbers on stdin, as a JSON object (milliseconds).
stats() {
  sort -n | awk '{ v[NR] = $1 } END {
    if (NR == 0) { print "null"; exit }
    p50 = v[int((NR - 1) * 0.50) + 1]; p95 = v[int((NR - 1) * 0.95) + 1]
    printf "{\"n\": %d, \"p50_ms\": %d, \"p95_ms\": %d, \"max_ms\": %d}", NR, p50, p95, v[NR]
  }'
}

# A VMI of the test guest; $2 = net|nonet|multus (the pod network and one
# secondary network: Debian's bridge plugin with host-local addresses).
manifest() {
  local extra="" nets=""
  [[ $2 == nonet ]] && extra="      autoattachPodInterface: false"
  if [[ $2 == multus ]]; then
    extra="      interfaces: [{name: default, masquerade: {}}, {name: side, bridge: {}}]"
    nets="  networks: [{name: default, pod: {}}, {name: side, multus: {networkName: bench-side}}]"
  fi
  cat <<EOF
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: $1
  namespace: default
spec:
  terminationGracePeriodSeconds: $grace
$nets
  domain:
    memory: {guest: 128Mi}
    devices:
$extra
      disks:
      - name: boot
        disk: {bus: virtio}
  volumes:
  - name: boot
    hostDisk: {path: /var/lib/kvirt/images/$1.raw, type: Disk}
EOF
}

# The guest: a boot sector that halts with interrupts off once SeaBIOS
# hands it the CPU. Under TCG every booting guest costs CPU, and 100
# kernels booting at once would measure the two cores rather than kvirt;
# this one idles right after the firmware, and costs nothing after.
# The busy host's guests spin instead (cli; jmp to itself): each keeps
# one host CPU's worth of TCG busy for as long as it runs.
guest=/var/tmp/bench-guest.raw spinner=/var/tmp/bench-spinner.raw
make_guest() {
  { printf '\xfa\xf4\xeb\xfd'; head -c 506 /dev/zero; printf '\x55\xaa'; } >"$guest"
  truncate -s 1M "$guest"
  { printf '\xfa\xeb\xfe'; head -c 507 /dev/zero; printf '\x55\xaa'; } >"$spinner"
  truncate -s 1M "$spinner"
}

disk() { cp --sparse=always "$guest" "/var/lib/kvirt/images/$1.raw"; }

put() {
  manifest "$1" "$2" >"$dir/.$1.tmp"
  mv "$dir/.$1.tmp" "$dir/$1.yaml"
}

running() {
  local s=""
  { IFS= read -r -d '' s <"$status/default_$1.json"; } 2>/dev/null || true
  [[ $s == *'"phase": "Running"'* ]]
}

wait_until() { # deadline_s, command...
  local end=$((EPOCHSECONDS + $1)); shift
  until "$@"; do
    ((EPOCHSECONDS < end)) || { echo "timed out: $*" >&2; return 1; }
    nap 0.02
  done
}

# kvirtd's metrics, read with bash alone.
metrics() {
  local line
  exec 8<>/dev/tcp/127.0.0.1/9477 || return 1
  printf 'GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n' >&8
  while IFS= read -r line <&8; do printf '%s\n' "$line"; done
  exec 8<&-
}

# Whether kvirtd's first pass after its start adopted at least N VMs.
adopted() {
  local line v sum=0
  while IFS= read -r line; do
    [[ $line == kvirt_adoptions_total* ]] || continue
    v=${line##* }; v=${v%%.*}; sum=$((sum + v))
  done < <(metrics)
  ((sum >= $1))
}

# Each step's count, total and slowest bucket since kvirtd started, as a
# JSON object by step (kvirt_step_duration_seconds).
step_times() {
  metrics | awk '
    /^kvirt_step_duration_seconds_(count|sum|bucket)/ {
      match($0, /step="[a-z_]*"/); st = substr($0, RSTART + 6, RLENGTH - 7)
      if ($0 ~ /_count/) n[st] = $NF
      else if ($0 ~ /_sum/) sum[st] = $NF
      else { match($0, /le="[^"]*"/); bucket[st, ++k[st]] = substr($0, RSTART + 4, RLENGTH - 5) " " $NF }
    }
    END {
      printf "{"; sep = ""
      for (st in sum) {
        # the smallest bucket that holds every observation
        max = "+Inf"
        for (i = 1; i <= k[st]; i++) { split(bucket[st, i], b, " "); if (b[2] >= n[st]) { max = b[1]; break } }
        printf "%s\"%s\": {\"count\": %d, \"total_s\": %.3f, \"mean_ms\": %.1f, \"max_le_s\": \"%s\"}", sep, st, n[st], sum[st], n[st] ? 1000 * sum[st] / n[st] : 0, max
        sep = ", "
      }
      printf "}"
    }'
}

all_gone() {
  local left=(/run/kvirt/vms/* /var/lib/kvirt/vms/* /run/netns/kvirt-* /sys/class/net/kv[0-9a-f]*)
  ((${#left[@]} == 0)) &&
    ! systemctl list-units --all --plain --no-legend 'kvirt-vm@*' | grep -q . &&
    ! ip netns list 2>/dev/null | grep -q kvirt-
}

remove_all() {
  rm -f "$dir"/*.yaml
  wait_until 300 all_gone
  rm -f /var/lib/kvirt/images/*.raw
}

# The VMs named $1* only (the busy host keeps its spinners meanwhile).
none_named() { local left=(/run/kvirt/vms/default_"$1"* /var/lib/kvirt/vms/default_"$1"*); ((${#left[@]} == 0)); }
remove_named() {
  rm -f "$dir/$1"*.yaml
  wait_until 300 none_named "$1"
  rm -f "/var/lib/kvirt/images/$1"*.raw
}

# kvirt, one VM at a time: manifest in → status Running; each is removed,
# and the host idle again (the kernel done with its namespace and cgroup),
# before the next, as the floor's is.
kvirt_seq() { # net|nonet
  local i t0
  for i in $(seq "$seq_n"); do
    disk "s$i"
    t0=$(now_ms)
    put "s$i" "$1"
    wait_until 120 running "s$i"
    echo $(($(now_ms) - t0))
    remove_all >&2
    wait_idle 60
  done
}

# kvirt, a burst: every manifest in at once, each VM's time to Running.
kvirt_burst() { # net|nonet
  local i t0 left
  for i in $(seq "$burst_n"); do disk "b$i"; done
  t0=$(now_ms)
  for i in $(seq "$burst_n"); do put "b$i" "$1"; done
  declare -A done_at=()
  left=$burst_n
  local end=$((EPOCHSECONDS + 600))
  while ((left > 0)); do
    for i in $(seq "$burst_n"); do
      [[ -n ${done_at[$i]:-} ]] && continue
      if running "b$i"; then done_at[$i]=$(($(now_ms) - t0)); left=$((left - 1)); fi
    done
    ((EPOCHSECONDS < end)) || { echo "burst timed out" >&2; return 1; }
    nap 0.05
  done
  for i in "${!done_at[@]}"; do echo "${done_at[$i]}"; done
  if ((busy_n)); then remove_named b >&2; else remove_all >&2; fi
}

# The floor: what systemd and libvirt alone take for the same VM (no pod
# network): a network namespace, a transient unit running a session
# virtqemud as an unprivileged user (returns at its READY), then virsh
# define and start of the domain XML kvirt makes for it. QEMU's
# capabilities are probed once, before, as kvirt's capability probe does.
floor_user=kvirt-floor
floor_setup() {
  id -u "$floor_user" >/dev/null 2>&1 || useradd --system --no-create-home "$floor_user"
  mkdir -p /var/tmp/floor/cache
  chown "$floor_user:" /var/tmp/floor/cache
}

floor_one() { # name → milliseconds
  local n=$1 base=/var/tmp/floor/$1 t0
  disk "$n"
  chown "$floor_user:" "/var/lib/kvirt/images/$n.raw"
  manifest "$n" nonet >"/tmp/$n.yaml"
  # kvirt's own paths for this VM, moved under the floor's directory.
  kvirtctl domxml --domain-type qemu "/tmp/$n.yaml" |
    sed -e "s#/run/kvirt/vms/default_$n#$base/run#g" -e "s#/var/lib/kvirt/vms/default_$n#$base/lib#g" \
      >"/tmp/$n.xml"
  mkdir -p "$base/run/xdg" "$base/lib" "$base/config"
  chown -R "$floor_user:" "$base"
  t0=$(now_ms)
  ip netns add "floor-$n"
  systemd-run --quiet --collect --unit "floor-$n" -p Type=notify -p User="$floor_user" \
    -p NetworkNamespacePath="/run/netns/floor-$n" \
    -E XDG_RUNTIME_DIR="$base/run/xdg" -E XDG_CONFIG_HOME="$base/config" \
    -E XDG_CACHE_HOME=/var/tmp/floor/cache -E HOME="$base/lib" \
    /usr/sbin/virtqemud --timeout 0
  local uri="qemu:///session?socket=$base/run/xdg/libvirt/virtqemud-sock"
  runuser -u "$floor_user" -- virsh -q -c "$uri" define "/tmp/$n.xml" >/dev/null
  runuser -u "$floor_user" -- virsh -q -c "$uri" start "default_$n" >/dev/null
  echo $(($(now_ms) - t0))
}

floor_teardown() { # name
  systemctl stop "floor-$1" 2>/dev/null || true
  ip netns delete "floor-$1" 2>/dev/null || true
  rm -rf "/var/tmp/floor/$1" "/var/lib/kvirt/images/$1.raw"
}

floor_seq() {
  local i
  floor_setup
  # Warm the shared capability cache (not measured).
  floor_one f0 >/dev/null && floor_teardown f0
  for i in $(seq "$seq_n"); do floor_one "f$i"; floor_teardown "f$i"; wait_idle 60; done
}

floor_burst() {
  local i
  floor_setup
  local pids=() out=/tmp/floor-burst
  rm -rf "$out"; mkdir -p "$out"
  for i in $(seq "$burst_n"); do
    (floor_one "g$i" >"$out/$i") &
    pids+=($!)
  done
  wait "${pids[@]}"
  cat "$out"/*
  for i in $(seq "$burst_n"); do floor_teardown "g$i"; done
}

# Every process of each VM's unit but QEMU: PSS and RSS in KiB, per VM
# (the unit from each process's cgroup).
helper_memory() {
  local p unit a b
  declare -A pss=() rss=()
  for p in /proc/[0-9]*; do
    unit=$(grep -o 'kvirt-vm@[^/]*[.]service' "$p/cgroup" 2>/dev/null | head -n1 || true)
    [[ -n $unit ]] || continue
    grep -qa qemu-system "$p/cmdline" 2>/dev/null && continue
    read -r a b < <(awk '/^Pss:/ {pss = $2} /^Rss:/ {rss = $2} END {print pss + 0, rss + 0}' \
      "$p/smaps_rollup" 2>/dev/null || echo "0 0")
    pss[$unit]=$((${pss[$unit]:-0} + a)) rss[$unit]=$((${rss[$unit]:-0} + b))
  done
  for unit in "${!pss[@]}"; do echo "${pss[$unit]} ${rss[$unit]}"; done
}

mem_json() { # from helper_memory lines: means in MiB
  awk '{ p += $1; r += $2; n++ } END {
    if (n == 0) { print "null"; exit }
    printf "{\"vms\": %d, \"pss_mib\": %.1f, \"rss_mib\": %.1f}", n, p / n / 1024, r / n / 1024 }'
}

kvirtd_pid() { systemctl show -P MainPID kvirtd; }
kvirtd_rss_mib() { awk '/^VmRSS:/ {printf "%.1f", $2 / 1024}' "/proc/$(kvirtd_pid)/status"; }
kvirtd_threads() { awk '/^Threads:/ {print $2}' "/proc/$(kvirtd_pid)/status"; }
# Files kvirtd holds open, and its limit (the soft one, which it raises).
kvirtd_fds() { local p; p=$(kvirtd_pid); find "/proc/$p/fd" -mindepth 1 -maxdepth 1 | wc -l; }
kvirtd_fd_limit() { awk '/^Max open files/ {print $4}' "/proc/$(kvirtd_pid)/limits"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$(kvirtd_pid)/stat"; }

# kvirtd's CPU over $1 seconds: the total in percent of one CPU, then
# the same by thread name as a JSON object (where idle time goes; threads
# that ended within the window count only in the total).
kvirtd_idle_cpu() {
  local pid t hz a0 b0; pid=$(kvirtd_pid); hz=$(getconf CLK_TCK)
  declare -A a=() b=()
  a0=$(cpu_ticks)
  for t in /proc/"$pid"/task/*; do a[$t]=$(awk '{print $14 + $15}' "$t/stat" 2>/dev/null || echo 0); done
  sleep "$1"
  b0=$(cpu_ticks)
  for t in /proc/"$pid"/task/*; do
    b[$t]="$(cat "$t/comm" 2>/dev/null) $(( $(awk '{print $14 + $15}' "$t/stat" 2>/dev/null || echo 0) - ${a[$t]:-0} ))"
  done
  awk -v d=$((b0 - a0)) -v s="$1" -v hz="$hz" 'BEGIN {printf "%.3f ", d / hz / s * 100}'
  printf '%s\n' "${b[@]}" | awk -v s="$1" -v hz="$hz" '{ n = $1; for (i = 2; i < NF; i++) n = n " " $i; d[n] += $NF }
    END { printf "{"; sep = ""; for (k in d) { printf "%s\"%s\": %.3f", sep, k, d[k] / hz / s * 100; sep = ", " } printf "}" }'
}

# Waits (up to $1 s) for the host to idle: under 10 % of its CPUs busy
# over two seconds, i.e. every guest done with its firmware.
wait_idle() {
  local end=$((EPOCHSECONDS + $1)) a b
  busy() { awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat; }
  while ((EPOCHSECONDS < end)); do
    a=$(busy); sleep 2; b=$(busy)
    awk -v a="$a" -v b="$b" 'BEGIN { split(a, x, " "); split(b, y, " ");
      u = y[1] - x[1]; i = y[2] - x[2]; exit !(u / (u + i) < 0.10) }' && return 0
  done
  echo "the host did not idle within $1 s" >&2
  return 1
}

qemu_pids() { pgrep -f '[q]emu-system' | sort -n | tr '\n' ' '; }

# CPU seconds of the host's daemons, as "name seconds" lines, and the
# host's busy and total ticks: what a mass delete costs whom.
daemon_cpu() {
  local hz name pid; hz=$(getconf CLK_TCK)
  for name in systemd dbus-daemon kvirtd systemd-journal systemd-machine; do
    pid=$(pgrep -o -x "$name") || continue
    awk -v n="$name" -v hz="$hz" '{printf "%s %.3f\n", n, ($14 + $15) / hz}' "/proc/$pid/stat"
  done
  # The VMs' units together, ended ones included (a slice's cpu.stat
  # keeps its removed children's usage): their daemons, QEMUs and stops.
  local root
  for root in /sys/fs/cgroup /sys/fs/cgroup/unified; do
    [[ -r $root/machine.slice/machine-kvirt.slice/cpu.stat ]] || continue
    awk '/^usage_usec/ {printf "vm_units %.3f\n", $2 / 1e6}' "$root/machine.slice/machine-kvirt.slice/cpu.stat"
    break
  done
  awk '/^cpu / {printf "busy %d\ntotal %d\n", $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8}' /proc/stat
}

# The difference of two daemon_cpu readings as JSON: each daemon's CPU
# seconds, and the host's CPUs busy in percent.
cpu_json() {
  awk 'NR == FNR { a[$1] = $2; next } { d[$1] = $2 - a[$1] }
    END { printf "{\"host_busy_pct\": %.1f", d["total"] ? 100 * d["busy"] / d["total"] : 0
      for (k in d) if (k != "busy" && k != "total") printf ", \"%s_s\": %.2f", k, d[k]
      printf "}" }' "$1" "$2"
}

# Many VMs: a burst of MANY, then memory, idle CPU, a restart, a delete.
many() {
  local i t0 cpu_burst
  grace=5
  many_since=$EPOCHSECONDS
  for i in $(seq "$many_n"); do disk "m$i"; done
  local a0 hz; hz=$(getconf CLK_TCK); a0=$(cpu_ticks)
  t0=$(now_ms)
  for i in $(seq "$many_n"); do put "m$i" net; done
  for i in $(seq "$many_n"); do wait_until 900 running "m$i"; done
  local up_ms=$(($(now_ms) - t0))
  cpu_burst=$(awk -v d=$(($(cpu_ticks) - a0)) -v ms="$up_ms" -v hz="$hz" 'BEGIN {printf "%.2f", d / hz / (ms / 1000) * 100}')
  # The delete's stops say where their time goes (debug lines of the
  # systemd adapter only), from the restart on.
  mkdir -p /run/systemd/system/kvirtd.service.d
  printf '[Service]\nEnvironment=KVIRT_LOG=info,kvirt::host::systemd=debug\n' \
    >/run/systemd/system/kvirtd.service.d/bench-log.conf
  systemctl daemon-reload
  # Idle figures once the guests have finished booting.
  wait_idle 300
  local mem; mem=$(helper_memory | mem_json)
  local rss threads idle by_thread
  rss=$(kvirtd_rss_mib); threads=$(kvirtd_threads)
  local fds fd_limit; fds=$(kvirtd_fds); fd_limit=$(kvirtd_fd_limit)
  # Idle over one whole resync period (kvirtd's default, 5 minutes): the
  # figure includes exactly one resync of every VM, as any such stretch
  # of an idle host's life does.
  read -r idle by_thread < <(kvirtd_idle_cpu "$resync_s")
  local before after r0 ready_ms since
  before=$(qemu_pids)
  since=$((EPOCHSECONDS - 1))
  r0=$(now_ms)
  systemctl restart kvirtd
  ready_ms=$(($(now_ms) - r0))
  after=$(qemu_pids)
  local same=true; [[ $before == "$after" ]] || same=false
  # Where a restart's time went, and a delete's: kvirtd's journal.
  journalctl -q -u kvirtd -o short-precise --since "@$since" >/share/many-restart.log || true
  # The delete is measured from a settled kvirtd: once READY, the
  # restart's first passes go on adopting the rest (a VM has one pass at
  # a time, so a delete meanwhile waits for its VM's).
  local end=$((EPOCHSECONDS + 120))
  until adopted "$many_n"; do ((EPOCHSECONDS < end)) || break; nap 0.2; done
  local adopted_ms=$(($(now_ms) - r0))
  # ...and once its start-up probe of QEMU (a QEMU of its own, seconds of
  # CPU) is done.
  until journalctl -q -u kvirtd --since "@$since" -o cat | grep -q 'QEMU capabilit'; do
    ((EPOCHSECONDS < end)) || break; nap 0.5
  done
  daemon_cpu >/tmp/cpu-before
  t0=$(now_ms)
  since=$((EPOCHSECONDS - 1))
  rm -f "$dir"/*.yaml
  wait_until 600 all_gone
  local gone_ms=$(($(now_ms) - t0))
  daemon_cpu >/tmp/cpu-after
  local delete_cpu; delete_cpu=$(cpu_json /tmp/cpu-before /tmp/cpu-after)
  # Where the delete's time went, step by step (the restart before it
  # adopted, which runs no steps).
  local steps; steps=$(step_times) || steps='{}'
  journalctl -q -u kvirtd -o short-precise --since "@$since" >/share/many-delete.log || true
  # systemd's own lines about the VMs' units over it (when each stopped
  # and was deactivated), stamped in seconds since the epoch like t0.
  journalctl -q _PID=1 -o short-unix --since "@$since" | grep 'kvirt-vm@' >/share/many-units.log || true
  local delete_t0_ms=$t0
  # What kvirtd logged as warnings or errors over all of it (the bus
  # refusing calls says "D-Bus: ..."), from the burst on.
  local warnings dbus
  warnings=$(journalctl -q -u kvirtd -p warning --since "@$many_since" -o cat | wc -l)
  dbus=$(journalctl -q -u kvirtd -p warning --since "@$many_since" -o cat | grep -c 'D-Bus' || true)
  local leftovers
  leftovers=$( { ip netns list 2>/dev/null | grep -c kvirt- || true; } )
  local veths; veths=$(find /sys/class/net -maxdepth 1 -name 'kv[0-9a-f]*' | wc -l)
  local leases; leases=$(grep -o '"default_m[0-9]*"' /var/lib/kvirt/network/leases.json 2>/dev/null | wc -l)
  local nft; nft=$(nft list ruleset 2>/dev/null | grep -c 'default_m' || true)
  rm -f /var/lib/kvirt/images/*.raw
  printf '{"vms": %d, "all_running_ms": %d, "helper": %s, "kvirtd_rss_mib": %s, "kvirtd_threads": %s, "kvirtd_open_files": %d, "kvirtd_open_files_limit": %d, "kvirtd_idle_cpu_pct": %s, "kvirtd_idle_cpu_by_thread": %s, "kvirtd_burst_cpu_pct": %s, "restart_ready_ms": %d, "qemu_pids_unchanged": %s, "adopted_ms": %d, "delete_all_ms": %d, "delete_t0_ms": %d, "delete_steps": %s, "delete_cpu": %s, "left": {"netns": %d, "veths": %d, "leases": %d, "nft_rules": %d}, "kvirtd_warnings": %d, "kvirtd_dbus_errors": %d}' \
    "$many_n" "$up_ms" "$mem" "$rss" "$threads" "$fds" "$fd_limit" "$idle" "$by_thread" "$cpu_burst" "$ready_ms" "$same" "$adopted_ms" "$gone_ms" "$delete_t0_ms" "$steps" "$delete_cpu" "$leftovers" "$veths" "$leases" "$nft" "$warnings" "$dbus"
}

# A host's life: N VMs made and deleted in sequence, WINDOW at a time (a
# new one starts as the one WINDOW before it is deleted), with a grace
# of 0 (the guest halts: nothing to wait for). Disk used where kvirt and
# journald keep per-VM things, and kvirtd's RSS, once warmed up (20 VMs)
# and at the end, each after a minute idle (kvirtd trims its heap once a
# minute). The journal is made persistent first, as on an installed
# host: journald splits files per uid only there.
churn_gone() { [[ ! -e /run/kvirt/vms/default_$1 && ! -e /var/lib/kvirt/vms/default_$1 ]]; }
churn_cycle() { # first last: each made, Running, and the one WINDOW before deleted
  local i j
  for ((i = $1; i <= $2; i++)); do
    disk "c$i"
    put "c$i" nonet
    wait_until 120 running "c$i"
    j=$((i - churn_w))
    if ((j >= $1)); then churn_drop "c$j"; fi
  done
  for ((j = $2 - churn_w + 1; j <= $2; j++)); do ((j >= $1)) && churn_drop "c$j"; done
  return 0
}
churn_drop() {
  rm -f "$dir/$1.yaml"
  wait_until 120 churn_gone "$1"
  rm -f "/var/lib/kvirt/images/$1.raw"
}
churn_disk() { # KiB used under each place, as JSON
  local d sep="" out="{"
  for d in /var/log/journal /run/log/journal /var/lib/kvirt /run/kvirt /run/userdb /run/systemd/transient; do
    out+="$sep\"$d\": $(du -sk "$d" 2>/dev/null | cut -f1 || echo 0)"; sep=", "
  done
  echo "$out}"
}
churn_state() {
  sleep 65
  printf '{"kvirtd_rss_mib": %s, "disk_kib": %s, "user_journal_files": %d, "identities": %d}' \
    "$(kvirtd_rss_mib)" "$(churn_disk)" \
    "$(find /var/log/journal -name 'user-*.journal' | wc -l)" \
    "$(grep -o '"default_[^"]*": *[0-9]*' /var/lib/kvirt/identities/identities.json 2>/dev/null | wc -l)"
}
churn() {
  grace=0
  mkdir -p /var/log/journal
  journalctl --flush
  local t0 warm=20
  churn_cycle 1 "$warm" >&2
  local before; before=$(churn_state)
  t0=$(now_ms)
  churn_cycle $((warm + 1)) $((warm + churn_n)) >&2
  local took_ms=$(($(now_ms) - t0))
  wait_until 120 all_gone
  local after; after=$(churn_state)
  printf '{"churn": {"vms": %d, "window": %d, "took_ms": %d, "before": %s, "after": %s}}\n' \
    "$churn_n" "$churn_w" "$took_ms" "$before" "$after"
}

# The floor of an adoption on the busy host: one call to each spinning
# VM's own libvirt daemon, all at once, each as its VM's user (a client
# that starts, connects and asks, as a restarted kvirtd does for each).
floor_ping() {
  local i pid pids=() t0
  t0=$(now_ms)
  for i in $(seq "$busy_n"); do
    pid=$(systemctl show -P MainPID "kvirt-vm@default_u$i.service")
    setpriv --reuid="$(stat -c %u "/proc/$pid")" --regid="$(stat -c %g "/proc/$pid")" --clear-groups \
      virsh -q -c "qemu:///session?socket=/run/kvirt/vms/default_u$i/xdg/libvirt/virtqemud-sock" \
      domstate "default_u$i" >/dev/null &
    pids+=($!)
  done
  wait "${pids[@]}"
  echo $(($(now_ms) - t0))
}

# A busy host: N spinning guests (every host CPU busy), then ROUNDS of
# the floor's and kvirt's bursts of BURST halting guests beside them, and
# kvirtd restarted with them all running (its journal from the restart
# on kept in /share, where the time went).
busy() {
  local i t0
  for i in $(seq "$busy_n"); do cp --sparse=always "$spinner" "/var/lib/kvirt/images/u$i.raw"; put "u$i" nonet; done
  for i in $(seq "$busy_n"); do wait_until 600 running "u$i"; done
  local a b; a=$(awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat)
  sleep 5
  b=$(awk '/^cpu / {print $2 + $3 + $4 + $7 + $8, $5 + $6}' /proc/stat)
  local busy_pct; busy_pct=$(awk -v a="$a" -v b="$b" 'BEGIN { split(a, x, " "); split(b, y, " ");
    u = y[1] - x[1]; i = y[2] - x[2]; printf "%.1f", u / (u + i) * 100 }')
  echo "{\"spinning\": $busy_n, \"host_cpu_busy_pct\": $busy_pct, \"rounds\": ["
  for r in $(seq "$rounds"); do
    ((r == 1)) || echo ','
    echo "{\"floor_burst\": $(floor_burst | stats),"
    echo "\"kvirt_burst_nonet\": $(kvirt_burst nonet | stats)}"
  done
  echo '],'
  local before after ping since
  ping=$(floor_ping)
  before=$(qemu_pids)
  since=$((EPOCHSECONDS - 1))
  t0=$(now_ms)
  systemctl restart kvirtd
  local ready_ms=$(($(now_ms) - t0))
  after=$(qemu_pids)
  local same=true; [[ $before == "$after" ]] || same=false
  journalctl -q -u kvirtd -o short-precise --since "@$since" >/share/busy-restart.log || true
  echo "\"floor_ping_ms\": $ping, \"restart_ready_ms\": $ready_ms, \"qemu_pids_unchanged\": $same}"
  remove_all >&2
}

make_guest
remove_all >&2
if [[ $mode == churn ]]; then churn; exit 0; fi
if [[ $mode == busy ]]; then busy; exit 0; fi
if [[ $mode == burst ]]; then kvirt_burst nonet | stats; exit 0; fi
# One round: every one-at-a-time and burst measure, the floor's beside
# kvirt's, as one JSON object (each round's ratios are its own).
round() {
  echo '{'
  echo "\"floor_seq\": $(floor_seq | stats),"
  echo "\"kvirt_seq_nonet\": $(kvirt_seq nonet | stats),"
  echo "\"kvirt_seq_net\": $(kvirt_seq net | stats),"
  # The network, as JSON (remove_all takes every .yaml); its host bridge is
  # not named kv<hex>... (all_gone takes those for VMs' veths).
  cat >"$dir/bench-side.json" <<'NAD'
{"apiVersion": "k8s.cni.cncf.io/v1", "kind": "NetworkAttachmentDefinition", "metadata": {"name": "bench-side"},
 "spec": {"config": "{\"cniVersion\":\"1.0.0\",\"type\":\"bridge\",\"bridge\":\"sidebr0\",\"ipam\":{\"type\":\"host-local\",\"subnet\":\"10.76.0.0/16\"}}"}}
NAD
  echo "\"kvirt_seq_multus\": $(kvirt_seq multus | stats),"
  rm -f "$dir/bench-side.json"
  echo "\"floor_burst\": $(floor_burst | stats),"
  echo "\"kvirt_burst_nonet\": $(kvirt_burst nonet | stats),"
  echo "\"kvirt_burst_net\": $(kvirt_burst net | stats)"
  echo '}'
}

echo '{"rounds": ['
for r in $(seq "$rounds"); do
  ((r == 1)) || echo ','
  round
done
echo '],'
# Helper memory at SEQ VMs: a burst of SEQ, measured, removed.
for i in $(seq "$seq_n"); do disk "h$i"; put "h$i" net; done
for i in $(seq "$seq_n"); do wait_until 300 running "h$i"; done
wait_idle 120
echo "\"helper_at_seq\": $(helper_memory | mem_json),"
remove_all >&2
echo "\"many\": $(many)"
echo '}'
