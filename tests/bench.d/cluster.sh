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

# Every phase each VMI shows, timed as the watch delivers it.
: >/tmp/cl-watch.log
kubectl get vmi -l bench=cluster --watch -o custom-columns=N:.metadata.name,P:.status.phase --no-headers 2>/tmp/cl-watch.err |
  while read -r name phase; do echo "$(now_ms) $name $phase"; done >/tmp/cl-watch.log &
watcher=$!
trap 'kill $watcher 2>/dev/null || true' EXIT
# The watch is open once its (empty) list was answered: kubectl says "No
# resources found" then.
end=$((EPOCHSECONDS + 30))
until grep -q 'No resources found' /tmp/cl-watch.err; do
  ((EPOCHSECONDS < end)) || { echo "the watch did not start: $(cat /tmp/cl-watch.err)" >&2; exit 1; }
  nap 0.1
done
running() { (($(awk '$3 == "Running" && !seen[$2]++' /tmp/cl-watch.log | wc -l) >= n)); }
t0=$(now_ms)
kubectl apply -f /tmp/cl.yaml >/dev/null
applied=$(($(now_ms) - t0))
end=$((EPOCHSECONDS + 900))
until running; do
  ((EPOCHSECONDS < end)) || { echo "not all Running within 900 s" >&2; exit 1; }
  nap 0.2
done
all_ms=$(($(now_ms) - t0))
times=$(awk -v t0="$t0" '$3 == "Running" && !seen[$2]++ { print $1 - t0 }' /tmp/cl-watch.log | sort -n |
  awk '{ v[NR] = $1 } END { printf "{\"n\": %d, \"p50_ms\": %d, \"p95_ms\": %d, \"max_ms\": %d}", NR, v[int((NR - 1) * 0.5) + 1], v[int((NR - 1) * 0.95) + 1], v[NR] }')
# Phase changes each VMI showed (a new VMI has none: "<none>" first).
changes=$(awk '{ if (last[$2] != $3) { if ($2 in last) c[$2]++; last[$2] = $3 } } END { for (k in c) print c[k] }' /tmp/cl-watch.log |
  sort -n | awk '{ v[NR] = $1 } END { print v[int((NR - 1) * 0.5) + 1] + 0 }')
del_at=$(date +%s.%N)
t1=$(now_ms)
kubectl delete vmi -l bench=cluster --timeout=300s >/dev/null
deleted=$(($(now_ms) - t1))
gone() { local left=(/run/kvirt/vms/default_cl* /var/lib/kvirt/vms/default_cl*); ((${#left[@]} == 0)); }
end=$((EPOCHSECONDS + 300))
until gone; do ((EPOCHSECONDS < end)) || break; nap 0.2; done
left=(/run/kvirt/vms/default_cl* /var/lib/kvirt/vms/default_cl*)
rm -f /var/lib/kvirt/images/cl*.raw
cp /var/log/kube-audit.log /share/audit-cluster.log
printf '{"vmis": %d, "apply_ms": %d, "running": %s, "all_running_ms": %d, "phase_changes_p50": %d, "delete_ms": %d, "delete_at": %s, "left_on_host": %d}\n' \
  "$n" "$applied" "$times" "$all_ms" "$changes" "$deleted" "$del_at" "${#left[@]}"
