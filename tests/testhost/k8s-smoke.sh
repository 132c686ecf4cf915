#!/bin/bash
# Smoke test of the test control plane: boot a test host, bring up etcd and
# kube-apiserver in it, drive it with kubectl (a CRD, a namespace, a custom object,
# a least-privilege user), restart the API server, and stop the host.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
. "$(dirname "${BASH_SOURCE[0]}")/k8s.sh"

name=${TH_K8S_SMOKE_NAME:-kvirt-k8s-smoke}

t0=$(th__now)
th_host_deps
t=$(th__now); bins=$(th_k8s_bins); th_log "kube-apiserver + kubectl: $(th__since "$t")  $bins"
t=$(th__now); etcd=$(th_etcd);     th_log "etcd:                     $(th__since "$t")  $etcd ($(cat "$etcd/etcd-version"))"

cleanup() {
  local rc=$?
  if ((rc != 0)) && [[ -n ${pid1:-} ]]; then
    th_log "k8s smoke failed (rc=$rc); units:"
    nsenter -t "$pid1" -a systemctl status --no-pager -n 30 etcd.service kube-apiserver.service >&2 || true
  fi
  th_stop "$name" || true
  exit "$rc"
}
trap cleanup EXIT

binds=$(th_k8s_binds)
export TH_BIND_RO="${TH_BIND_RO:-} $binds"
t=$(th__now); pid1=$(th_boot "$name"); th_log "boot: $(th__since "$t")"
t=$(th__now); th_k8s_up "$name"; th_log "th_k8s_up: $(th__since "$t")"

kc() { th_k8s_kubectl "$name" "$@"; }
th_log "server: $(kc version -o json | sed -n 's/.*"gitVersion": "\(.*\)".*/\1/p' | tr '\n' ' ')"

t=$(th__now)
kc apply -f - >&2 <<'YAML'
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.smoke.kvirt.io
spec:
  group: smoke.kvirt.io
  names: {kind: Widget, plural: widgets, singular: widget}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec:
            type: object
            properties:
              size: {type: integer}
---
apiVersion: v1
kind: Namespace
metadata:
  name: smoke
YAML
kc wait --for=condition=Established --timeout=30s crd/widgets.smoke.kvirt.io >&2
kc apply -f - >&2 <<'YAML'
apiVersion: smoke.kvirt.io/v1
kind: Widget
metadata: {name: w1, namespace: smoke}
spec: {size: 3}
YAML
[[ $(kc get -n smoke widget w1 -o 'jsonpath={.spec.size}') == 3 ]] || th_die "custom object not read back"
kc get ns smoke >&2
th_log "CRD + namespace + custom object: $(th__since "$t")"

# A least-privilege user: forbidden until RBAC allows it.
t=$(th__now)
ukc=$(th_k8s_kubeconfig "$name" system:kvirt:node-1 system:kvirt-nodes)
th_log "user kubeconfig: $ukc ($(th__since "$t"))"
if th_exec "$name" kubectl --kubeconfig="$ukc" get -n smoke widgets >/dev/null 2>&1; then
  th_die "system:kvirt:node-1 could list widgets without RBAC"
fi
kc create clusterrole smoke-widgets --verb=get,list,watch --resource=widgets.smoke.kvirt.io >&2
kc create clusterrolebinding smoke-widgets --clusterrole=smoke-widgets --group=system:kvirt-nodes >&2
th_wait 10 th_exec "$name" kubectl --kubeconfig="$ukc" get -n smoke widget w1 >&2
[[ $(th_exec "$name" kubectl --kubeconfig="$ukc" auth whoami -o 'jsonpath={.status.userInfo.username}') == system:kvirt:node-1 ]]
th_log "least-privilege user allowed after RBAC binding"

# Memory of the control plane (RSS and PSS of the units' main processes).
mem() {
  th_sh "$name" "p=\$(systemctl show -P MainPID $1)
    awk '/^Rss:/ { r = \$2 } /^Pss:/ { p = \$2 } END { printf \"RSS %.0f MiB, PSS %.0f MiB\", r / 1024, p / 1024 }' /proc/\$p/smaps_rollup"
}
th_log "memory: etcd $(mem etcd.service); kube-apiserver $(mem kube-apiserver.service)"

# The API server goes away for a while and comes back; etcd keeps the data.
th_k8s_stop_apiserver "$name"
if th__k8s_readyz "$name"; then th_die "kube-apiserver still answers after stop"; fi
[[ $(th_exec "$name" systemctl is-active etcd.service) == active ]]
th_k8s_start_apiserver "$name"
[[ $(kc get -n smoke widget w1 -o 'jsonpath={.spec.size}') == 3 ]] || th_die "custom object lost over the restart"
th_log "apiserver restart: object still there"

th_log "k8s smoke passed in $(th__since "$t0")"
