#!/usr/bin/env bash
# Runs inside the fleet benchmark's test host (see tests/bench --fleet),
# which runs the control plane (etcd, kube-apiserver with an audit log of
# the group kvirt:nodes) and kvirt's package. Arguments: HOSTS VMIS IDLE_S
# CHURN_S. Starts HOSTS simulated hosts (`kvirtd --simulate`: the real API
# server, every host part the recording fake: no VM runs), each with
# VMIS VMIs of its own; once all run, an idle window, then a churn window
# (10 % of the VMIs deleted and as many new ones created per minute, the
# new ones unassigned: the leading host places them). Each window's audit log lands
# in /share (the outer script counts it); prints one JSON object.
set -euo pipefail
hosts=$1 per=$2 idle_s=$3 churn_s=$4
export KUBECONFIG=/etc/kvirt/admin.kubeconfig
fleet=/var/tmp/fleet
audit=/var/log/kube-audit.log
now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }

wait_for() { # deadline_s what command...
  local end=$((EPOCHSECONDS + $1)) what=$2; shift 2
  until "$@"; do
    ((EPOCHSECONDS < end)) || { echo "timed out waiting for $what" >&2; return 1; }
    sleep 2
  done
}

# A simulated host: its config (its own paths; virtctl's API on an
# address of its own, on a bridge of its own: Endpoints take no loopback one; no
# migration port, no metrics) and a transient unit running kvirtd
# --simulate.
sim_up() { # i kubeconfig
  local n=sim-$1 dir=$fleet/sim-$1 addr=10.99.$(($1 / 200)).$(($1 % 200 + 1))
  ip link show fleet0 >/dev/null 2>&1 || { ip link add fleet0 type bridge && ip link set fleet0 up; }
  ip addr add "$addr/16" dev fleet0
  mkdir -p "$dir"
  install -m 0600 "$2" "$dir/kubeconfig"
  cat >"$dir/kvirtd.toml" <<EOF
node_name = "$n"
[paths]
state_dir = "$dir/lib"
runtime_dir = "$dir/run"
cache_dir = "$dir/cache"
[source]
kind = "kubernetes"
[vm]
emulation = "always"
[kubernetes]
kubeconfig = "$dir/kubeconfig"
bootstrap_kubeconfig = "$dir/bootstrap.kubeconfig"
claim = true
[api]
listen = "$addr:8443"
address = "$addr"
[metrics]
listen = ""
EOF
  systemd-run --quiet --unit "kvirt-sim-$1" -E KVIRT_LOG=warn /usr/sbin/kvirtd --simulate --config "$dir/kvirtd.toml"
}

vmi() { # name [node]
  local labels=""
  [[ -n ${2:-} ]] && labels="  labels: {kubevirt.io/nodeName: $2}"
  cat <<EOF
---
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: $1
  namespace: default
$labels
spec:
  terminationGracePeriodSeconds: 0
  domain:
    memory: {guest: 64Mi}
    devices: {autoattachPodInterface: false}
EOF
}

leases() { kubectl get leases -n kube-node-lease -l kvirt.io/host --no-headers 2>/dev/null | wc -l; }
running() { kubectl get vmi -A -o jsonpath='{range .items[*]}{.status.phase}{"\n"}{end}' | grep -c '^Running$' || true; }
all_leases() { (($(leases) >= hosts)); }
all_running() { (($(running) >= $1)); }

pid_of() { systemctl show -P MainPID "$1"; }
ticks() { awk '{print $14 + $15}' "/proc/$(pid_of "$1")/stat"; }
rss_mib() { awk '/^VmRSS:/ {printf "%.1f", $2 / 1024}' "/proc/$(pid_of "$1")/status"; }
sims_rss_mib() {
  local u t=0 n=0
  for u in $(systemctl list-units --plain --no-legend 'kvirt-sim-*' | awk '{print $1}'); do
    t=$((t + $(awk '/^VmRSS:/ {print $2}' "/proc/$(pid_of "$u")/status"))); n=$((n + 1))
  done
  awk -v t="$t" -v n="$n" 'BEGIN {printf "%.1f", n ? t / n / 1024 : 0}'
}
# The API server's own counters: watches open (by resource) and watch
# events sent (by resource), as "name value" lines.
api_metrics() {
  kubectl get --raw /metrics | awk '
    function what(   k) {
      if (match($0, /resource="[^"]*"/)) return substr($0, RSTART + 10, RLENGTH - 11)
      if (match($0, /kind="[^"]*"/)) return substr($0, RSTART + 6, RLENGTH - 7)
      return "?"
    }
    /^apiserver_longrunning_requests\{/ && /verb="WATCH"/ { w[what()] += $NF }
    /^apiserver_watch_events_total\{/ { e[what()] += $NF }
    END { for (r in w) print "watches." r, w[r]; for (r in e) print "events." r, e[r] }'
}

# A window: the audit log's bytes in it (copied to /share), the API
# server's and etcd's CPU over it, their RSS and the counters at its end.
window_start() { w_off=$(stat -c %s "$audit"); w_api=$(ticks kube-apiserver); w_etcd=$(ticks etcd); w_t0=$(now_ms); api_metrics >/tmp/metrics-before; }
window_end() { # name
  local hz ms; hz=$(getconf CLK_TCK); ms=$(($(now_ms) - w_t0))
  tail -c +$((w_off + 1)) "$audit" >"/share/audit-$1.log"
  api_metrics >/tmp/metrics-after
  local events; events=$(awk 'NR == FNR { b[$1] = $2; next } $1 ~ /^events\./ { printf "%s\"%s\": %d", s, substr($1, 8), $2 - b[$1]; s = ", " }' /tmp/metrics-before /tmp/metrics-after)
  local watches; watches=$(awk '$1 ~ /^watches\./ { printf "%s\"%s\": %d", s, substr($1, 9), $2; s = ", " }' /tmp/metrics-after)
  printf '{"seconds": %.1f, "apiserver_cpu_pct": %.2f, "etcd_cpu_pct": %.2f, "apiserver_rss_mib": %s, "etcd_rss_mib": %s, "sim_rss_mib": %s, "watch_events": {%s}, "watches_open": {%s}}' \
    "$(awk -v m="$ms" 'BEGIN {print m / 1000}')" \
    "$(awk -v d=$(($(ticks kube-apiserver) - w_api)) -v hz="$hz" -v m="$ms" 'BEGIN {print d / hz / (m / 1000) * 100}')" \
    "$(awk -v d=$(($(ticks etcd) - w_etcd)) -v hz="$hz" -v m="$ms" 'BEGIN {print d / hz / (m / 1000) * 100}')" \
    "$(rss_mib kube-apiserver)" "$(rss_mib etcd)" "$(sims_rss_mib)" "$events" "$watches"
}

main() {
  local i j t0
  systemctl stop kvirtd
  for i in $(seq "$hosts"); do sim_up "$i" "/etc/kvirt/kubeconfigs/kvirt_node_sim-$i.kubeconfig"; done
  wait_for 300 "every simulated host's Lease" all_leases
  # Every host's VMIs at once, assigned.
  for i in $(seq "$hosts"); do for j in $(seq "$per"); do vmi "f-$i-$j" "sim-$i"; done; done >/tmp/fleet.yaml
  t0=$(now_ms)
  window_start
  kubectl apply -f /tmp/fleet.yaml >/dev/null
  wait_for 900 "$((hosts * per)) VMIs Running" all_running $((hosts * per))
  local up_ms=$(($(now_ms) - t0))
  local start; start=$(window_end start)
  sleep 60
  window_start
  sleep "$idle_s"
  local idle; idle=$(window_end idle)
  # Churn: every 6 s a tenth of a minute's share (10 % of the VMIs per
  # minute) deleted, oldest first, and as many new unassigned ones made.
  local total=$((hosts * per)) step k=0 gone=0 made=0
  step=$(((total + 99) / 100))
  window_start
  local end=$((EPOCHSECONDS + churn_s))
  local names=() ; for i in $(seq "$hosts"); do for j in $(seq "$per"); do names+=("f-$i-$j"); done; done
  # Oldest first, across hosts.
  mapfile -t names < <(printf '%s\n' "${names[@]}" | sort -t- -k3,3n -k2,2n)
  while ((EPOCHSECONDS < end)); do
    local tick=$((EPOCHSECONDS + 6)) batch=()
    for ((i = 0; i < step && gone < ${#names[@]}; i++)); do batch+=("${names[gone]}"); gone=$((gone + 1)); done
    ((${#batch[@]} == 0)) || kubectl delete vmi --wait=false "${batch[@]}" >/dev/null
    # (k counts here: the loop before the pipe runs in a subshell.)
    for ((i = 1; i <= step; i++)); do vmi "c-$((k + i))"; done | kubectl apply -f - >/dev/null
    k=$((k + step)) made=$((made + step))
    while ((EPOCHSECONDS < tick)); do sleep 0.5; done
  done
  local churn; churn=$(window_end churn)
  local claimed; claimed=$(kubectl get vmi -A -l kubevirt.io/nodeName -o name | grep -c '/c-' || true)
  printf '{"hosts": %d, "vmis_per_host": %d, "all_running_ms": %d, "churn_deleted": %d, "churn_created": %d, "churn_claimed": %d, "windows": {"start": %s, "idle": %s, "churn": %s}}\n' \
    "$hosts" "$per" "$up_ms" "$gone" "$made" "$claimed" "$start" "$idle" "$churn"
}

main
