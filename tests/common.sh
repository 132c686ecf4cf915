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
  # Incremental data would double the target directory, for a build that
  # runs once (cargo's own default is kept when the caller sets it).
  export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
  local free
  free=$(df --output=avail -BG "$top" | tail -n1 | tr -dc 0-9)
  if ((free < 8)); then
    th_log "warning: only ${free} GiB free under $top: the build takes about 3 GiB and a cold test-host cache up to 5 GiB more"
  fi
  local v; v=$(rustc --version | awk '{print $2}')
  if [[ $(printf '%s\n1.85.0\n' "$v" | sort -V | head -n1) != 1.85.0 ]]; then
    th_die "Rust $v is too old: kvirt needs 1.85 or newer (rustup's stable)"
  fi
}

# cargo-deb and cargo-generate-rpm, built once per version into the cache.
kvirt_packaging_tools() {
  local tool name version dir
  for tool in cargo-deb@3.8.0 cargo-generate-rpm@0.21.1; do
    name=${tool%@*} version=${tool#*@} dir=$TH_CACHE/tools/$name-$version
    if [[ ! -x $dir/bin/$name ]]; then
      th_log "building $name $version (once)"
      rm -rf "$dir.tmp"
      cargo install --locked --quiet --root "$dir.tmp" --version "$version" "$name" >&2 || return
      mv "$dir.tmp" "$dir"
    fi
    PATH=$dir/bin:$PATH
  done
  export PATH
}

# Builds kvirt (debug, for the tests) and its packages: exports KVIRT_DEB,
# KVIRT_RPM and KVIRT_DEB_NEXT (the same build as a newer revision, for
# upgrade tests).
# Cargo's target directory, when the checkout has none yet (CI's clean
# checkout), is one kept under the test cache: the dependencies' builds
# are most of a cold build's time and change only with Cargo.lock. One
# per Cargo.lock (others removed: each is gigabytes), and wiped when it
# has grown past 20 GiB (kvirt's own crates build anew per checkout path).
kvirt_target_cache() {
  [[ -e $top/target || -L $top/target ]] && return 0
  local dir
  dir=$TH_CACHE/cargo-target-$(sha256sum "$top/Cargo.lock" | cut -c1-16)
  mkdir -p "$TH_CACHE"
  find "$TH_CACHE" -mindepth 1 -maxdepth 1 -name 'cargo-target-*' ! -path "$dir" -exec rm -rf {} +
  if [[ -d $dir ]] && (($(du -sm "$dir" | cut -f1) > 20480)); then rm -rf "$dir"; fi
  mkdir -p "$dir"
  ln -s "$dir" "$top/target"
  th_log "cargo's target directory: $dir (kept between runs)"
}

kvirt_build() {
  th_host_deps
  kvirt_rust
  kvirt_packaging_tools
  kvirt_target_cache
  local t; t=$(th__now)
  (cd "$top" && cargo build --locked --bins >&2)
  local out
  out=$(bash "$top/packaging/build" 1)
  KVIRT_DEB=$(grep '\.deb$' <<<"$out")
  KVIRT_RPM=$(grep '\.rpm$' <<<"$out")
  KVIRT_DEB_NEXT=$(bash "$top/packaging/build" 2 | grep '\.deb$')
  export KVIRT_DEB KVIRT_RPM KVIRT_DEB_NEXT
  th_log "kvirt built and packaged in $(th__since "$t"): $(basename "$KVIRT_DEB") $(basename "$KVIRT_RPM")"
}

# Boots test host NAME with kvirt installed; echoes its PID 1. With
# --dual-stack its kvirtd has network.subnet6 (IPv6 on the pod network).
kvirt_testhost() {
  local name=$1 dual=${2:-} rootfs guest vq pid
  rootfs=$(th_rootfs) || return
  guest=$(th_guest) || return
  vq=$(th_virtqemud) || return
  # A loop device for the block claims' test, where the kernel has them.
  local loop="" binds=""
  if loop=$(th_loop "$name"); then binds="$loop:$loop"; fi
  # Called as $(...), where set -e does not reach: every step says so.
  pid=$(TH_BIND="$binds ${KVIRT_TH_BIND:-}" TH_BIND_RO="$guest:/srv/guest $vq:/usr/sbin/virtqemud" th_boot "$name") || return
  [[ -z $loop ]] || echo "$loop" >"$TH_STATE/$name/share/claim-loop"
  if [[ $dual == --dual-stack ]]; then
    th_sh "$name" 'mkdir -p /etc/kvirt/kvirtd.toml.d && printf "[network]\nsubnet6 = \"fd00:6b76::/64\"\n" >/etc/kvirt/kvirtd.toml.d/40-dual-stack.toml' || return
  fi
  bash "$top/tests/testhost/install-kvirt.sh" "$name" "$KVIRT_DEB" >&2 || return
  echo "$pid"
}

# The bridges on this machine that join the migration pair's hosts and
# the cluster's.
KVIRT_PAIR_BRIDGE=kvth-mig
KVIRT_K8S_BRIDGE=${KVIRT_K8S_BRIDGE:-kvth-k8s}
# The cluster's second link, unaddressed: secondary networks' bridges on it.
KVIRT_RED_BRIDGE=${KVIRT_RED_BRIDGE:-kvth-red}

# kvirt_link BRIDGE LINK NET PID...: joins test hosts (by PID 1) as
# machines on one switch: BRIDGE on this machine, a link named LINK in each
# host's network namespace, addressed NET.1, NET.2, ... (/24) in order, or
# not at all if NET is "-".
kvirt_link() {
  local bridge=$1 link=$2 net=$3 i=0 pid; shift 3
  ip link del "$bridge" 2>/dev/null || true
  ip link add "$bridge" type bridge && ip link set "$bridge" up || return
  for pid in "$@"; do
    i=$((i + 1))
    ip link add "$bridge-$i" type veth peer name "$bridge-$i-in" &&
      ip link set "$bridge-$i" master "$bridge" up &&
      ip link set "$bridge-$i-in" netns "$pid" &&
      nsenter -t "$pid" -n ip link set "$bridge-$i-in" name "$link" &&
      { [[ $net == - ]] || nsenter -t "$pid" -n ip addr add "$net.$i/24" dev "$link"; } &&
      nsenter -t "$pid" -n ip link set "$link" up || return
  done
}

# Two standalone test hosts for migration, as two machines would be: each
# in its own network namespace, joined by a bridge on this machine (the
# migration link: A is 10.251.0.1, B 10.251.0.2), one directory bound at
# /srv/shared in both (storage both reach at the same path, configured as
# a hostDisk root and shared root), one kvirt CA with a certificate of
# each host's own, and the migration port on that link. Echoes "PID_A PID_B".
kvirt_testhost_pair() {
  local a=$1 b=$2 shared pa pb i host
  shared=$TH_STATE/shared-$a-$b
  rm -rf "$shared" && mkdir -p "$shared" || return
  pa=$(KVIRT_TH_BIND="$shared:/srv/shared" kvirt_testhost "$a") || return
  pb=$(KVIRT_TH_BIND="$shared:/srv/shared" kvirt_testhost "$b") || return
  kvirt_link "$KVIRT_PAIR_BRIDGE" mig0 10.251.0 "$pa" "$pb" || return
  th_sh "$a" 'kvirtd --make-api-pki /etc/kvirt/pki >/dev/null && cp /etc/kvirt/pki/api-ca.crt /etc/kvirt/pki/api-ca.key /share/' || return
  for f in api-ca.crt api-ca.key; do
    th_copy_in "$b" "$(th_share "$a")/$f" "/etc/kvirt/pki/$f" || return
  done
  rm -f "$(th_share "$a")/api-ca.key"
  th_sh "$b" 'chmod 0600 /etc/kvirt/pki/api-ca.key && kvirtd --make-api-pki /etc/kvirt/pki >/dev/null' || return
  i=0
  for host in "$a" "$b"; do
    i=$((i + 1))
    th_sh "$host" "cat > /etc/kvirt/kvirtd.toml.d/55-pair.toml <<EOF
node_name = \"$host\"
[storage]
host_disk_roots = [\"/var/lib/kvirt/images\", \"/srv/shared\"]
shared_roots = [\"/srv/shared\"]
[migration]
listen = \"10.251.0.$i:8444\"
EOF
systemctl restart kvirtd" || return
    th_wait 60 th_sh "$host" "systemctl is-active -q kvirtd" || {
      th_sh "$host" "journalctl -u kvirtd --no-pager -n 30" >&2 || true
      th_die "kvirtd on $host did not restart"; return
    }
  done
  th_log "migration pair $a (10.251.0.1) and $b (10.251.0.2) up"
  echo "$pa $pb"
}

# A cluster of two test hosts, as two machines would be: each in its own
# network namespace, joined by a bridge on this machine (A is 10.250.0.1,
# B 10.250.0.2: each host's address, where its kvirtd serves the API server
# and its peers), and by a second one with no address (red0, for secondary
# networks' bridges). A runs etcd and kube-apiserver (on loopback and that
# link) plus kvirtd as node-a; B runs kvirtd as node-b and reaches the API
# server over the link. Both claim unassigned VMIs of zone z1, each with its
# own least-privilege identity. Echoes "PID_A PID_B".
kvirt_k8s_cluster() {
  local a=$1 b=$2 guest vq k8s pa pb
  # shellcheck source=testhost/k8s.sh
  source "$top/tests/testhost/k8s.sh"
  guest=$(th_guest) || return
  vq=$(th_virtqemud) || return
  k8s=$(th_k8s_binds) || return
  # A loop device on A for the block claims' test, where the kernel has them.
  local loop="" binds=""
  if loop=$(th_loop "$a"); then binds="$loop:$loop"; fi
  # Storage both hosts reach at one path (a shared root: VMs on it migrate).
  local shared=$TH_STATE/shared-$a-$b
  rm -rf "$shared" && mkdir -p "$shared" || return
  pa=$(TH_BIND="$binds $shared:/srv/shared" TH_BIND_RO="$guest:/srv/guest $vq:/usr/sbin/virtqemud $k8s" th_boot "$a") || return
  [[ -z $loop ]] || echo "$loop" >"$TH_STATE/$a/share/claim-loop"
  pb=$(TH_BIND="$shared:/srv/shared" TH_BIND_RO="$guest:/srv/guest $vq:/usr/sbin/virtqemud $k8s" th_boot "$b") || return
  kvirt_link "$KVIRT_K8S_BRIDGE" node0 10.250.0 "$pa" "$pb" || return
  kvirt_link "$KVIRT_RED_BRIDGE" red0 - "$pa" "$pb" || return
  TH_K8S_ADDRESS=10.250.0.1 th_k8s_up "$a" >&2 || return
  local server=https://10.250.0.1:6443
  th_copy_in "$a" "$top/packaging/kubernetes/crd.yaml" /etc/kvirt/manifests/crd.yaml || return
  th_copy_in "$a" "$top/packaging/kubernetes/network-attachment-definition-crd.yaml" \
    /etc/kvirt/manifests/nad-crd.yaml || return
  th_copy_in "$a" "$top/packaging/kubernetes/rbac.yaml" /etc/kvirt/manifests/rbac.yaml || return
  # The tests' namespace is opted in (Secrets, ConfigMaps, tokens); others are not.
  "$top/target/debug/kvirtd" --print-rbac --namespace default >"$TH_STATE/kvirt-rbac-default.yaml" || return
  th_copy_in "$a" "$TH_STATE/kvirt-rbac-default.yaml" /etc/kvirt/manifests/rbac-default.yaml || return
  th_k8s_kubectl "$a" apply -f /etc/kvirt/manifests/crd.yaml -f /etc/kvirt/manifests/nad-crd.yaml \
    -f /etc/kvirt/manifests/rbac.yaml \
    -f /etc/kvirt/manifests/rbac-default.yaml >&2 || return
  th_k8s_kubectl "$a" wait --for=condition=Established --timeout=60s crd/virtualmachineinstances.kubevirt.io \
    crd/virtualmachines.kubevirt.io crd/virtualmachineclusterinstancetypes.instancetype.kubevirt.io \
    crd/virtualmachinepreferences.instancetype.kubevirt.io crd/virtualmachinepools.pool.kubevirt.io \
    crd/virtualmachineinstancereplicasets.kubevirt.io \
    crd/network-attachment-definitions.k8s.cni.cncf.io >&2 || return
  # A user with no rights of its own (tests bind roles to it).
  th_k8s_kubeconfig "$a" kvirt-viewer >/dev/null || return
  sed "s#server: https://127.0.0.1:6443#server: $server#" "$(th_share "$a")/admin.kubeconfig" \
    >"$TH_STATE/admin-link.kubeconfig" || return
  local host node subnet api_listen address life
  for host in "$a" "$b"; do
    node=node-${host##*-}
    # Each host's VMs have a subnet of their own, so that a guest's pod
    # address says which host it is on.
    subnet=10.213.0.0/24 address=10.250.0.1 life=86400
    # node-b's certificate is short-lived: renewed (at 70–90 % of its life)
    # while the cluster tests run, and proven so in tests/join.rs.
    [[ $node == node-b ]] && subnet=10.214.0.0/24 address=10.250.0.2 life=600
    api_listen=$address:8443
    # Both hosts need the admin kubeconfig for the tests' kubectl.
    th_copy_in "$host" "$TH_STATE/admin-link.kubeconfig" /root/.kube/config || return
    bash "$top/tests/testhost/install-kvirt.sh" "$host" "$KVIRT_DEB" >&2 || return
    # subresources.kubevirt.io: one CA and serving certificate made on A (as
    # the README says for a small cluster), copied to B; registered once.
    if [[ $node == node-a ]]; then
      th_sh "$host" 'kvirtd --make-api-pki /etc/kvirt/pki >/dev/null &&
        cp /etc/kvirt/pki/api-ca.crt /etc/kvirt/pki/api.crt /etc/kvirt/pki/api.key /share/ &&
        kvirtd --print-api-service | kubectl --kubeconfig=/etc/kvirt/admin.kubeconfig apply -f -' >&2 || return
    else
      for f in api-ca.crt api.crt api.key; do
        th_copy_in "$host" "$(th_share "$a")/$f" "/etc/kvirt/pki/$f" || return
      done
      th_sh "$host" 'chmod 0600 /etc/kvirt/pki/api.key' || return
    fi
    th_sh "$host" "cat > /etc/kvirt/kvirtd.toml.d/50-test.toml <<EOF
node_name = \"$node\"
[source]
kind = \"kubernetes\"
[vm]
daemon = \"virtqemud\"
emulation = \"always\"
[kubernetes]
kubeconfig = \"/etc/kvirt/kubeconfig\"
claim = true
node_labels = { zone = \"z1\", \"kvirt.io/host\" = \"$node\" }
lease_seconds = 8
efi_vars_check_seconds = 2
certificate_seconds = $life
# Past the watchdog's 30 s and a restart: a frozen kvirtd fences once
# restarted, before its peer acts (tests/dead_host.rs).
node_dead_after_seconds = 40
self_fence_margin_seconds = 5
[network]
subnet = \"$subnet\"
[api]
listen = \"$api_listen\"
[migration]
listen = \"$address:8444\"
[storage]
local_registries = [\"127.0.0.1:5001\"]
shared_roots = [\"/srv/shared\"]
[storage.host_disk_roots_by_namespace]
default = [\"/var/lib/kvirt/images\", \"/srv/shared\"]
EOF" >&2 || return
    kvirt_k8s_join "$a" "$host" "$node" "$server" || {
      th_sh "$host" "journalctl -u kvirtd --no-pager -n 30" >&2 || true
      th_die "kvirtd did not join in $host"
      return 1
    }
  done
  echo "$pa $pb"
}

# kvirt_k8s_join ADMIN_HOST HOST NODE SERVER: HOST joins as NODE the way the
# README says: a bootstrap token made by the administrator (on ADMIN_HOST),
# then `kvirtd join` on HOST, which restarts its kvirtd as a cluster member.
# The first host's request is approved by the administrator (no joined
# kvirtd is there to); later ones by the joined kvirtds.
kvirt_k8s_join() {
  local admin=$1 host=$2 node=$3 server=$4 token
  th_sh "$admin" 'cp /etc/kvirt/pki/ca.crt /share/cluster-ca.crt' || return
  th_copy_in "$host" "$(th_share "$admin")/cluster-ca.crt" /etc/kvirt/cluster-ca.crt || return
  token=$(th_sh "$admin" "export KUBECONFIG=/etc/kvirt/admin.kubeconfig
    kvirtd --print-bootstrap-token --node $node 2>/tmp/join-$node |
      kubectl apply -f - >&2 && sed -n 's/.* --token \([^ ]*\) .*/\1/p' /tmp/join-$node") || return
  [[ -n $token ]] || th_die "no bootstrap token for $node" || return
  local join="kvirtd join --server $server --ca-file /etc/kvirt/cluster-ca.crt --token $token --node $node"
  if kvirt_k8s_has_joined "$admin"; then
    th_sh "$host" "$join" >&2 || return
  else
    th_sh "$host" "export KUBECONFIG=/etc/kvirt/admin.kubeconfig
      $join & j=\$!
      timeout 60 bash -c 'until kubectl get csr -o name | grep -q kvirt-node-$node-; do sleep 0.2; done'
      kubectl certificate approve \$(kubectl get csr -o name | grep kvirt-node-$node-)
      wait \$j" >&2 || return
  fi
  th_sh "$host" 'systemctl is-active -q kvirtd'
}

# kvirt_k8s_has_joined ADMIN_HOST: whether a kvirt host holds an identity
# (an approved request of kvirt's) to approve the next one.
kvirt_k8s_has_joined() {
  th_sh "$1" "KUBECONFIG=/etc/kvirt/admin.kubeconfig kubectl get csr --no-headers -o custom-columns=N:.metadata.name,C:.status.certificate |
    awk '\$1 ~ /^kvirt-node-/ && \$2 != \"<none>\"' | grep -q ."
}
