#!/usr/bin/env bash
# Runs on the test cluster's host A (see tests/bench --cluster): N VMIs
# for node-a in one `kubectl apply`, each one's time until the API server
# says Running (from a watch), then one `kubectl delete` of them all (it
# returns once kvirtd released each finalizer). Prints one JSON object;
# the audit log goes to /share for the status writes per VMI.
set -euo pipefail
n=$1 grace=5
export KUBECONFIG=/etc/kvirt/admin.kubeconfig
now_ms() { echo $((${EPOCHREALTIME/./} / 1000)); }
exec 9<> <(:)
nap() { read -rt "$1" -u 9 || true; }
shopt -s nullglob

# The benchmark's guest (tests/bench.d/in-host.sh): a boot sector that
# halts once SeaBIOS hands it the CPU.
{ printf '\xfa\xf4\xeb\xfd'; head -c 506 /dev/zero; printf '\x55\xaa'; } >/var/tmp/bench-guest.raw
truncate -s 1M /var/tmp/bench-guest.raw
rm -f /tmp/cl.yaml
for i in $(seq "$n"); do
  cp --sparse=always /var/tmp/bench-guest.raw "/var/lib/kvirt/images/cl$i.raw"
  cat >>/tmp/cl.yaml <<VMI
---
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata: {name: cl$i, namespace: default, labels: {bench: cluster, kubevirt.io/nodeName: node-a}}
spec:
  terminationGracePeriodSeconds: $grace
  domain:
    memory: {guest: 128Mi}
    devices:
      autoattachPodInterface: false
      disks: [{name: boot, disk: {bus: virtio}}]
  volumes: [{name: boot, hostDisk: {path: /var/lib/kvirt/images/cl$i.raw, type: Disk}}]
VMI
done

# Every phase each VMI shows, timed as the watch delivers it. The API
# server may end a watch (it was restarted just before, for its audit
# log, and ended kubectl's once, 10 s in): kubectl then watches again, its
# list giving each VMI's phase as of then (each restart is counted).
: >/tmp/cl-watch.log
: >/tmp/cl-watch.err
watch_vmis() {
  while :; do
    kubectl get vmi -l bench=cluster --watch -v=6 -o custom-columns=N:.metadata.name,P:.status.phase,D:.metadata.deletionTimestamp --no-headers 2>>/tmp/cl-watch.err || true
    echo "$(now_ms) - rewatch"
    sleep 0.2 # a retry's pause, not a wait for anything
  done | while read -r name phase deleting; do
    if [[ $name =~ ^[0-9]+$ ]]; then echo "$name $phase"; else echo "$(now_ms) $name $phase $deleting"; fi
  done >/tmp/cl-watch.log
}
watch_vmis &
watcher=$!
trap 'pkill -P $watcher 2>/dev/null; kill $watcher 2>/dev/null; pkill -f "kubectl get vmi -l bench=cluster" || true' EXIT
# The watch is open once the API server answered its request (kubectl
# -v=6 logs each response; an empty list prints nothing in watch mode).
end=$((EPOCHSECONDS + 30))
until grep -q 'watch=true.*status="200 OK"' /tmp/cl-watch.err; do
  ((EPOCHSECONDS < end)) || { echo "the watch did not start: $(cat /tmp/cl-watch.err)" >&2; exit 1; }
  nap 0.1
done
running() { (($(awk '$3 == "Running" && !seen[$2]++' /tmp/cl-watch.log | wc -l) >= n)); }
# CPU seconds the control plane and kvirtd use meanwhile: they share
# this host's CPUs with the VMs being started.
cpu_s() { awk '/^usage_usec/ { printf "%.1f\n", $2 / 1e6 }' "/sys/fs/cgroup/system.slice/$1.service/cpu.stat" 2>/dev/null || echo 0; }
cpu0=$(for u in kube-apiserver etcd kvirtd; do cpu_s $u; done)
apply_at=$(date +%s.%N)
t0=$(now_ms)
kubectl apply -f /tmp/cl.yaml >/dev/null
applied=$(($(now_ms) - t0))
end=$((EPOCHSECONDS + 900))
until running; do
  ((EPOCHSECONDS < end)) || { echo "not all Running within 900 s" >&2; exit 1; }
  nap 0.2
done
all_ms=$(($(now_ms) - t0))
cpu1=$(for u in kube-apiserver etcd kvirtd; do cpu_s $u; done)
cpu=$(paste <(echo "$cpu0") <(echo "$cpu1") | awk '{ d[NR] = $2 - $1 } END { printf "{\"apiserver_s\": %.1f, \"etcd_s\": %.1f, \"kvirtd_s\": %.1f}", d[1], d[2], d[3] }')
pct() { sort -n | awk '{ v[NR] = $1 } END { printf "{\"n\": %d, \"p50_ms\": %d, \"p95_ms\": %d, \"max_ms\": %d}", NR, v[int((NR - 1) * 0.5) + 1], v[int((NR - 1) * 0.95) + 1], v[NR] }'; }
times=$(awk -v t0="$t0" '$3 == "Running" && !seen[$2]++ { print $1 - t0 }' /tmp/cl-watch.log | pct)
# The same from each VMI's own creation (its first event): the apply
# creates them one by one over seconds, the directory all at once.
own=$(awk '$2 != "-" && !($2 in first) { first[$2] = $1 } $3 == "Running" && !seen[$2]++ { print $1 - first[$2] }' /tmp/cl-watch.log | pct)
# Phase changes each VMI showed (a new VMI has none: "<none>" first).
changes=$(awk '$2 != "-" { if (last[$2] != $3) { if ($2 in last) c[$2]++; last[$2] = $3 } } END { for (k in c) print c[k] }' /tmp/cl-watch.log |
  sort -n | awk '{ v[NR] = $1 } END { print v[int((NR - 1) * 0.5) + 1] + 0 }')
del_at=$(date +%s.%N)
t1=$(now_ms)
kubectl delete vmi -l bench=cluster --timeout=300s >/dev/null
deleted=$(($(now_ms) - t1))
# When each VMI left the API server: its last event, the watch's DELETED
# (kubectl's own wait, object by object, returns well after).
gone_api=$(awk -v t1="$t1" '$2 != "-" && $1 >= t1 { last[$2] = $1 } END { m = 0; for (k in last) if (last[k] - t1 > m) m = last[k] - t1; print m }' /tmp/cl-watch.log)
# The same from each VMI's own deletion (its first event with a
# deletionTimestamp): kubectl deletes them one by one over seconds, and
# each VMI's grace period counts from its own deletion.
gone_own=$(awk -v t1="$t1" '$2 != "-" && $1 >= t1 { if ($4 != "" && $4 != "<none>" && !($2 in del)) del[$2] = $1; last[$2] = $1 }
  END { for (k in last) if (k in del) print last[k] - del[k] }' /tmp/cl-watch.log | pct)
gone() { local left=(/run/kvirt/vms/default_cl* /var/lib/kvirt/vms/default_cl*); ((${#left[@]} == 0)); }
end=$((EPOCHSECONDS + 300))
until gone; do ((EPOCHSECONDS < end)) || break; nap 0.2; done
left=(/run/kvirt/vms/default_cl* /var/lib/kvirt/vms/default_cl*)
rm -f /var/lib/kvirt/images/cl*.raw
cp /var/log/kube-audit.log /share/audit-cluster.log
cp /tmp/cl-watch.log /tmp/cl-watch.err /share/ || true
# Where the time went: kvirtd's journal of the run.
journalctl -q -u kvirtd -o short-precise --since "@$((t0 / 1000 - 1))" >/share/cluster-kvirtd.log || true
rewatches=$(grep -c ' - rewatch' /tmp/cl-watch.log || true)
printf '{"vmis": %d, "rewatches": %d, "apply_ms": %d, "running": %s, "running_from_creation": %s, "cpu_during_create": %s, "all_running_ms": %d, "phase_changes_p50": %d, "delete_ms": %d, "gone_from_api_ms": %d, "gone_from_own_deletion": %s, "apply_at": %s, "delete_at": %s, "left_on_host": %d}\n' \
  "$n" "$rewatches" "$applied" "$times" "$own" "$cpu" "$all_ms" "$changes" "$deleted" "$gone_api" "$gone_own" "$apply_at" "$del_at" "${#left[@]}"
