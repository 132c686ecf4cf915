# shellcheck shell=bash
# kvirt test control plane: a real etcd + kube-apiserver running as systemd units
# inside a booted test host. Source it after lib.sh; see README.md ("Kubernetes
# control plane").
#
# Public functions: th_k8s_bins th_kube_apiserver th_kubectl th_virtctl th_etcd
# th_k8s_binds th_k8s_up th_k8s_kubeconfig th_k8s_stop_apiserver
# th_k8s_start_apiserver th_k8s_kubectl
#
# Logs go to stderr; functions that "echo a path" print only that on stdout.

# Kubernetes version built from the k8s.io/kubernetes Go module (the Rust side uses
# k8s-openapi's v1_33 feature). The staging modules (k8s.io/api, ...) are pinned to
# v0.<minor>.<patch> of the same release.
TH_K8S_VERSION=${TH_K8S_VERSION:-1.33.13}
# KubeVirt's virtctl, built from the kubevirt.io/kubevirt Go module: the upstream
# client that cluster tests drive kvirt's KubeVirt API with.
TH_VIRTCTL_VERSION=${TH_VIRTCTL_VERSION:-1.9.0}
TH_GO=${TH_GO:-/usr/local/go/bin/go}
# Go's caches (GOPATH, GOMODCACHE, GOCACHE): shared by all k8s builds (virtctl's
# too, but for GOCACHE). The build cache (GOCACHE, 2.4 GB) is removed once the
# binaries are cached: only a rebuild for another version would read it.
TH_GO_CACHE=$TH_CACHE/go

# ---------------------------------------------------------------- binaries

# th__build_k8s OUT VERSION GO: build kube-apiserver, kube-controller-manager and
# kubectl from the k8s.io/kubernetes module at VERSION with the machine's Go, into OUT.
th__build_k8s() {
  local out=$1 ver=$2 go=$3
  local w=$TH_WORK minor patch
  minor=$(cut -d. -f2 <<<"$ver"); patch=$(cut -d. -f3 <<<"$ver")
  export GOPATH=$TH_GO_CACHE/path GOMODCACHE=$TH_GO_CACHE/mod GOCACHE=$TH_GO_CACHE/build
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod GOPROXY=${GOPROXY:-https://proxy.golang.org}
  mkdir -p "$GOPATH" "$GOMODCACHE" "$GOCACHE"
  set -x
  "$go" version
  mkdir -p "$w/src/cmd/kube-apiserver" "$w/src/cmd/kube-controller-manager" "$w/src/cmd/kubectl"
  cd "$w/src" || return
  echo "[th $(date +%T)] k8s: fetching k8s.io/kubernetes v$ver"
  # The kubernetes go.mod requires its staging repositories as v0.0.0 and replaces
  # them with ./staging/src/...: list those and pin each to v0.<minor>.<patch>.
  local gomod
  gomod=$(cd /tmp && GOFLAGS="" "$go" mod download -json "k8s.io/kubernetes@v$ver" | sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p')
  [[ -r $gomod ]]
  local staging
  staging=$(sed -n 's#^[[:space:]]*\(k8s.io/[^ ]*\) => \./staging/src/.*#\1#p' "$gomod")
  [[ -n $staging ]]
  local goline
  goline=$(sed -n 's/^go \(.*\)/\1/p' "$gomod")
  {
    echo "module kvirt.test/k8s"
    echo
    echo "go $goline"
    echo
    echo "require k8s.io/kubernetes v$ver"
    echo
    echo "replace ("
    local m
    for m in $staging; do echo "	$m => $m v0.$minor.$patch"; done
    echo ")"
  } >go.mod
  cat go.mod
  # Mirror cmd/kube-apiserver/apiserver.go and cmd/kube-controller-manager/
  # controller-manager.go of the kubernetes tree: one shape, its own app.
  local component command
  for component in kube-apiserver:NewAPIServerCommand kube-controller-manager:NewControllerManagerCommand; do
    command=${component#*:} component=${component%%:*}
    cat >"cmd/$component/main.go" <<GO
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	"k8s.io/kubernetes/cmd/$component/app"
)

func main() {
	command := app.$command()
	code := cli.Run(command)
	os.Exit(code)
}
GO
  done
  # Mirrors cmd/kubectl/kubectl.go of the kubernetes tree.
  cat >cmd/kubectl/main.go <<'GO'
package main

import (
	"k8s.io/component-base/cli"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"

	// Import to initialize client auth plugins.
	_ "k8s.io/client-go/plugin/pkg/client/auth"
)

func main() {
	command := cmd.NewDefaultKubectlCommand()
	if err := cli.RunNoErrOutput(command); err != nil {
		util.CheckErr(err)
	}
}
GO
  echo "[th $(date +%T)] k8s: resolving modules (go mod tidy)"
  "$go" mod tidy
  cp go.mod go.sum "$out/"
  # Version stamps, as hack/lib/version.sh sets them.
  local ld="-s -w" p
  for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ld+=" -X $p.gitVersion=v$ver -X $p.gitMajor=1 -X $p.gitMinor=$minor"
    ld+=" -X $p.gitTreeState=clean -X $p.buildDate=1970-01-01T00:00:00Z"
  done
  local bin t
  for bin in kube-apiserver kube-controller-manager kubectl; do
    echo "[th $(date +%T)] k8s: building $bin"
    t=$SECONDS
    "$go" build -trimpath -ldflags="$ld" -o "$out/$bin" "./cmd/$bin"
    echo "[th $(date +%T)] k8s: built $bin in $((SECONDS - t))s, $(du -h "$out/$bin" | cut -f1)"
  done
  "$out/kube-apiserver" --version | tee "$out/version"
  grep -qx "Kubernetes v$ver" "$out/version"
  "$out/kube-controller-manager" --version | grep -qx "Kubernetes v$ver"
  "$out/kubectl" version --client
  echo "$ver" >"$out/k8s-version"
  set +x
}

th__k8s_key() {
  { declare -f th__build_k8s; echo "$TH_K8S_VERSION"; "$TH_GO" version; } | th__hash
}

# th_k8s_bins: echo the cached directory with kube-apiserver and kubectl (static,
# CGO_ENABLED=0) built from k8s.io/kubernetes v$TH_K8S_VERSION with $TH_GO.
th_k8s_bins() {
  [[ -x $TH_GO ]] || th_die "no Go toolchain at $TH_GO (set TH_GO)" || return
  # th__cached runs the builder in a fresh bash that sources only lib.sh: hand it
  # our builder as an exported function (in this command substitution's subshell).
  (
    export -f th__build_k8s
    export TH_GO_CACHE
    th__cached k8s "$TH_K8S_VERSION-$(th__k8s_key)" th__build_k8s "$TH_K8S_VERSION" "$TH_GO"
    rm -rf "$TH_GO_CACHE/build"
  )
}

# th_kube_apiserver / th_kubectl: echo the path of the cached binary.
th_kube_apiserver() { local d; d=$(th_k8s_bins) || return; echo "$d/kube-apiserver"; }
th_kubectl() { local d; d=$(th_k8s_bins) || return; echo "$d/kubectl"; }

# th__build_virtctl OUT VERSION GO: build virtctl from the kubevirt.io/kubevirt module
# at VERSION with the machine's Go, into OUT.
th__build_virtctl() {
  local out=$1 ver=$2 go=$3
  local w=$TH_WORK
  # Go's build cache in the scratch dir (removed with it): th_k8s_bins removes
  # $TH_GO_CACHE/build when it returns, which would pull the shared one from
  # under a virtctl build running at the same time.
  export GOPATH=$TH_GO_CACHE/path GOMODCACHE=$TH_GO_CACHE/mod GOCACHE=$w/go-build
  export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=mod GOPROXY=${GOPROXY:-https://proxy.golang.org}
  mkdir -p "$GOPATH" "$GOMODCACHE" "$GOCACHE"
  set -x
  "$go" version
  mkdir -p "$w/src/cmd/virtctl"
  cd "$w/src" || return
  echo "[th $(date +%T)] virtctl: fetching kubevirt.io/kubevirt v$ver"
  # The proxy refuses the version lists of kubevirt.io/* (@v/list: 403) but serves
  # the releases: ask for the exact version.
  local json gomod info dir
  json=$(cd /tmp && GOFLAGS="" "$go" mod download -json "kubevirt.io/kubevirt@v$ver")
  gomod=$(sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",$/\1/p' <<<"$json")
  info=$(sed -n 's/^[[:space:]]*"Info": "\(.*\)",$/\1/p' <<<"$json")
  dir=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
  [[ -r $gomod && -r $info && -d $dir ]]
  # A replace counts only in the main module, and "go install mod@version" refuses
  # a module that has any: the wrapper module copies the kubevirt go.mod's
  # replaces (k8s.io/* pinned to one release, openshift/* and others required as
  # v0.0.0) and maps its staging modules (kubevirt.io/api, kubevirt.io/client-go
  # => ./staging/src/..., left out of the module zip as nested modules) to their
  # published modules of the same version.
  local replaces remote staging
  replaces=$(awk '/^replace[[:space:]]*\(/ { b = 1; next }
    b && /^\)/ { b = 0; next }
    b || sub(/^replace[[:space:]]+/, "") { sub(/\/\/.*/, ""); $1 = $1; if (/=>/) print }' "$gomod")
  remote=$(awk '$NF !~ /^\.\.?\//' <<<"$replaces")
  staging=$(awk '$NF ~ /^\.\.?\// { print $1 }' <<<"$replaces")
  [[ -n $staging ]]
  local m
  for m in $staging; do
    # Only ./staging/src/<module> is known to be published under its own path.
    grep -qx "$m => \./staging/src/$m" <<<"$replaces"
  done
  # The proxy refuses kubevirt.io/virt-template-{api,client-go,engine} (403, "not
  # available", any version): virtctl is built without its "template" commands
  # (VirtualMachineTemplates, which kvirt does not serve; below), and the two
  # packages that virtctl's other commands reach (through vmexport and
  # pkg/controller, whose VirtualMachineTemplate informer only virt-controller
  # starts) come from local stand-ins with just what those use: the API group and
  # resource names (as in the CRD virtualmachinetemplates.template.kubevirt.io),
  # an object type and a client constructor that fails.
  local k8s
  k8s=$(awk '$1 == "k8s.io/client-go" { print $NF }' <<<"$remote")
  [[ -n $k8s ]]
  mkdir -p virt-template-api/core/v1beta1 virt-template-client-go/virttemplate
  printf 'module kubevirt.io/virt-template-api\n\ngo 1.24.0\n\nrequire k8s.io/apimachinery %s\n' \
    "$k8s" >virt-template-api/go.mod
  printf 'module kubevirt.io/virt-template-client-go\n\ngo 1.24.0\n\nrequire k8s.io/client-go %s\n' \
    "$k8s" >virt-template-client-go/go.mod
  cat >virt-template-api/core/core.go <<'GO'
// Package core stands in for kubevirt.io/virt-template-api/core, which the Go
// module proxy does not serve.
package core

const (
	GroupName            = "template.kubevirt.io"
	SingularResourceName = "virtualmachinetemplate"
	PluralResourceName   = "virtualmachinetemplates"
)
GO
  cat >virt-template-api/core/v1beta1/types.go <<'GO'
// Package v1beta1 stands in for kubevirt.io/virt-template-api/core/v1beta1: only
// the object type that pkg/controller's informer names.
package v1beta1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

type VirtualMachineTemplate struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`
}

func (in *VirtualMachineTemplate) DeepCopyObject() runtime.Object {
	out := *in
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	return &out
}
GO
  cat >virt-template-client-go/virttemplate/clientset.go <<'GO'
// Package virttemplate stands in for kubevirt.io/virt-template-client-go/virttemplate:
// a client that cannot be created.
package virttemplate

import (
	"errors"

	"k8s.io/client-go/rest"
)

type Clientset struct{}

type TemplateV1beta1Client struct{}

func NewForConfig(*rest.Config) (*Clientset, error) {
	return nil, errors.New("virt-template client: not in this virtctl build")
}

func (*Clientset) TemplateV1beta1() *TemplateV1beta1Client { return nil }

func (*TemplateV1beta1Client) RESTClient() rest.Interface { return nil }
GO
  local goline
  goline=$(sed -n 's/^go \(.*\)/\1/p' "$gomod")
  {
    echo "module kvirt.test/virtctl"
    echo
    echo "go $goline"
    echo
    echo "require kubevirt.io/kubevirt v$ver"
    echo
    echo "replace ("
    sed 's/^/\t/' <<<"$remote"
    for m in $staging; do echo "	$m => $m v$ver"; done
    echo "	kubevirt.io/virt-template-api => ./virt-template-api"
    echo "	kubevirt.io/virt-template-client-go => ./virt-template-client-go"
    echo ")"
  } >go.mod
  cat go.mod
  # The kubevirt tree's own cmd/virtctl/virtctl.go and pkg/virtctl/root.go (the
  # root command, the only file of its package), with the "template" command
  # group taken out of root.go: each edit is checked, so that a new version of
  # another shape fails here instead of building something else.
  mkdir -p virtctl
  sed -e '\#^[[:space:]]*"kubevirt.io/kubevirt/pkg/virtctl/template"$#d' \
    -e '/^[[:space:]]*template\.NewCommand(),$/d' "$dir/pkg/virtctl/root.go" >virtctl/root.go
  [[ $(wc -l <virtctl/root.go) == $(($(wc -l <"$dir/pkg/virtctl/root.go") - 2)) ]]
  if grep -E 'virtctl/template"|\<template\.' virtctl/root.go; then return 1; fi
  [[ $(ls "$dir"/pkg/virtctl/*.go | grep -vc '_test\.go$') == 1 ]]
  sed 's#"kubevirt.io/kubevirt/pkg/virtctl"#"kvirt.test/virtctl/virtctl"#' \
    "$dir/cmd/virtctl/virtctl.go" >cmd/virtctl/main.go
  grep -q '"kvirt.test/virtctl/virtctl"' cmd/virtctl/main.go
  [[ $(ls "$dir"/cmd/virtctl/*.go | grep -vc '_test\.go$') == 1 ]]
  cat cmd/virtctl/main.go
  echo "[th $(date +%T)] virtctl: resolving modules (go mod tidy)"
  # -e: tests of kubevirt packages (tidy reads them) import the template commands
  # and the refused modules; the build below needs none of them.
  "$go" mod tidy -e
  cp go.mod go.sum "$out/"
  # Version stamps, as hack/version.sh sets them: the tag, its commit, a clean
  # tree, and the commit's time as the build date (reproducible). The proxy's
  # .info has the commit (Origin.Hash) and its time.
  local p=kubevirt.io/client-go/version commit date
  commit=$(sed -n 's/.*"Hash":"\([0-9a-f]*\)".*/\1/p' "$info")
  date=$(sed -n 's/.*"Time":"\([^"]*\)".*/\1/p' "$info")
  [[ -n $date ]]
  local ld="-s -w -X $p.gitVersion=v$ver -X $p.buildDate=$date"
  [[ -z $commit ]] || ld+=" -X $p.gitCommit=$commit -X $p.gitTreeState=clean"
  echo "[th $(date +%T)] virtctl: building virtctl"
  local t=$SECONDS
  # -tags selinux: KubeVirt builds every binary with it (hack/common.sh).
  "$go" build -trimpath -tags selinux -ldflags="$ld" -o "$out/virtctl" ./cmd/virtctl
  echo "[th $(date +%T)] virtctl: built virtctl in $((SECONDS - t))s, $(du -h "$out/virtctl" | cut -f1)"
  "$out/virtctl" version --client | tee "$out/version"
  grep -qF "GitVersion:\"v$ver\"" "$out/version"
  echo "$ver" >"$out/kubevirt-version"
  set +x
}

th__virtctl_key() {
  { declare -f th__build_virtctl; echo "$TH_VIRTCTL_VERSION"; "$TH_GO" version; } | th__hash
}

# th_virtctl: echo the path of the cached virtctl (static, CGO_ENABLED=0) built from
# kubevirt.io/kubevirt v$TH_VIRTCTL_VERSION with $TH_GO.
th_virtctl() {
  [[ -x $TH_GO ]] || th_die "no Go toolchain at $TH_GO (set TH_GO)" || return
  local d
  # As th_k8s_bins: the builder goes to th__cached's fresh bash exported.
  d=$(
    export -f th__build_virtctl
    export TH_GO_CACHE
    th__cached virtctl "$TH_VIRTCTL_VERSION-$(th__virtctl_key)" th__build_virtctl "$TH_VIRTCTL_VERSION" "$TH_GO"
  ) || return
  echo "$d/virtctl"
}

# ---------------------------------------------------------------- etcd

# th__build_etcd OUT ROOTFS: etcd and etcdctl from the suite's etcd-server and
# etcd-client packages. The booted test host has no network (--private-network), so
# "apt-get install" inside it is impossible: download the .debs with the rootfs's
# own apt (host network, throwaway overlay) and extract them here.
th__build_etcd() {
  local out=$1 rootfs=$2 w=$TH_WORK
  set -x
  mkdir -p "$w/debs" "$w/x"
  th__nspawn_run "$rootfs" --volatile=overlay --bind="$w/debs:/debs" -- bash -euxc '
    apt-get update -qq
    apt-cache policy etcd-server etcd-client
    cd /tmp && apt-get download etcd-server etcd-client && cp ./*.deb /debs/'
  local d
  for d in "$w"/debs/*.deb; do dpkg-deb -x "$d" "$w/x"; done
  cp "$w/x/usr/bin/etcd" "$w/x/usr/bin/etcdctl" "$out/"
  dpkg-deb -f "$(ls "$w"/debs/etcd-server_*.deb)" Version >"$out/etcd-version"
  set +x
  # Dynamically linked against the suite's libc: check it runs in the rootfs.
  th__nspawn_run "$rootfs" --volatile=overlay --bind-ro="$out:/e" -- /e/etcd --version | tee "$out/version"
}

# th_etcd: echo the cached directory with etcd and etcdctl (Debian $TH_SUITE packages,
# taken at the time the rootfs was built; etcd-version holds the package version).
th_etcd() {
  local rootfs key
  rootfs=$(th_rootfs) || return
  key=$({ declare -f th__build_etcd; echo "$TH_SUITE"; basename "$rootfs"; } | th__hash)
  ( export -f th__build_etcd; th__cached etcd "$key" th__build_etcd "$rootfs" )
}

# th_k8s_binds: echo "src:dst ..." read-only binds for TH_BIND_RO that put
# kube-apiserver, kube-controller-manager, kubectl, virtctl, etcd and etcdctl at
# /usr/local/bin in a test host booted with them (th_k8s_up copies missing ones into
# the overlay instead: slower, and ~350 MB of the host's RAM, since the overlay's
# upper layer is a tmpfs).
th_k8s_binds() {
  local k v e
  k=$(th_k8s_bins) || return
  v=$(th_virtctl) || return
  e=$(th_etcd) || return
  echo "$k/kube-apiserver:/usr/local/bin/kube-apiserver $k/kubectl:/usr/local/bin/kubectl" \
    "$k/kube-controller-manager:/usr/local/bin/kube-controller-manager" \
    "$v:/usr/local/bin/virtctl" \
    "$e/etcd:/usr/local/bin/etcd $e/etcdctl:/usr/local/bin/etcdctl"
}

# ---------------------------------------------------------------- control plane

# Inside a test host:
#   /etc/kvirt/pki/            ca.{crt,key} apiserver.{crt,key} sa.{key,pub} admin.{crt,key}
#                              users/<user>.{crt,key}
#   /etc/kvirt/admin.kubeconfig   (also /root/.kube/config, and share/admin.kubeconfig)
#   /etc/kvirt/kubeconfigs/<user>.kubeconfig   (th_k8s_kubeconfig)
#   etcd.service, kube-apiserver.service, kube-controller-manager.service
#   (/etc/systemd/system, Restart=on-failure)
#   /var/lib/etcd (data, in the overlay: gone with the host)
TH_K8S_SERVER=https://127.0.0.1:6443
TH_K8S_SERVICE_CIDR=${TH_K8S_SERVICE_CIDR:-10.96.0.0/12}
TH_K8S_READY_TIMEOUT=${TH_K8S_READY_TIMEOUT:-90}
# An address of the host's own network (a link to other hosts) that the API
# server also serves on, and its certificate names; empty: loopback only.
TH_K8S_ADDRESS=${TH_K8S_ADDRESS:-}

# Run inside the host (bash -euc, args: SERVER SERVICE_IP [ADDRESS]). Certificates: ECDSA P-256
# for TLS (X.509 v3, SANs, EKUs: rustls/webpki is strict), RSA 2048 for service
# account tokens. Idempotent: keeps an existing PKI.
th__k8s_pki_script() {
  cat <<'SH'
server=$1 svc_ip=$2 address=${3:-}
pki=/etc/kvirt/pki
install -d -m 0755 /etc/kvirt /etc/kvirt/kubeconfigs
install -d -m 0700 "$pki" "$pki/users"
cd "$pki"
if [[ ! -s ca.crt ]]; then
  ec() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
  ec ca.key
  openssl req -x509 -new -key ca.key -days 3650 -subj "/CN=kvirt-test-ca" -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.crt
  # sign NAME SUBJECT EXTFILE-CONTENT
  sign() {
    ec "$1.key"
    openssl req -new -key "$1.key" -subj "$2" -out "$1.csr"
    printf '%b' "$3" >"$1.ext"
    openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days 365 \
      -sha256 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
    rm -f "$1.csr" "$1.ext"
  }
  sign apiserver "/CN=kube-apiserver" \
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,IP:::1,IP:$svc_ip${address:+,IP:$address},DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
  sign admin "/O=system:masters/CN=kubernetes-admin" \
    "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n"
  openssl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out sa.key 2>/dev/null
  openssl pkey -in sa.key -pubout -out sa.pub
  chmod 0600 ./*.key
fi
# The front proxy (the aggregator's client certificate to aggregated API
# servers such as kvirtd's): its own CA, as kubeadm makes it.
if [[ ! -s front-proxy-ca.crt ]]; then
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out front-proxy-ca.key 2>/dev/null
  openssl req -x509 -new -key front-proxy-ca.key -days 3650 -subj "/CN=front-proxy-ca" -sha256 \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out front-proxy-ca.crt
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out front-proxy-client.key 2>/dev/null
  openssl req -new -key front-proxy-client.key -subj "/CN=front-proxy-client" -out front-proxy-client.csr
  printf 'basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n' >front-proxy-client.ext
  openssl x509 -req -in front-proxy-client.csr -CA front-proxy-ca.crt -CAkey front-proxy-ca.key \
    -CAcreateserial -days 365 -sha256 -extfile front-proxy-client.ext -out front-proxy-client.crt 2>/dev/null
  rm -f front-proxy-client.csr front-proxy-client.ext
  chmod 0600 ./*.key
fi
# kubeconfig USER CERT KEY: print a self-contained kubeconfig (data inlined).
b64() { base64 -w0 <"$1"; }
cat >/etc/kvirt/admin.kubeconfig <<KC
apiVersion: v1
kind: Config
clusters:
- name: kvirt-test
  cluster:
    server: $server
    certificate-authority-data: $(b64 ca.crt)
users:
- name: kubernetes-admin
  user:
    client-certificate-data: $(b64 admin.crt)
    client-key-data: $(b64 admin.key)
contexts:
- name: kubernetes-admin@kvirt-test
  context:
    cluster: kvirt-test
    user: kubernetes-admin
current-context: kubernetes-admin@kvirt-test
KC
chmod 0600 /etc/kvirt/admin.kubeconfig
install -d -m 0700 /root/.kube
ln -sfn /etc/kvirt/admin.kubeconfig /root/.kube/config
cp /etc/kvirt/admin.kubeconfig /share/admin.kubeconfig
SH
}

th__k8s_units() {
  # Loopback, or every address when it also serves on a link (one flag).
  local bind=127.0.0.1
  [[ -z $TH_K8S_ADDRESS ]] || bind=0.0.0.0
  cat <<EOT
### etcd.service
[Unit]
Description=etcd (kvirt test control plane)

[Service]
Type=notify
# One member, no peers: a short election timeout brings a (re)start from ~1.5 s to ~0.7 s.
ExecStart=/usr/local/bin/etcd --name=kvirt-test --data-dir=/var/lib/etcd \\
  --listen-client-urls=http://127.0.0.1:2379 --advertise-client-urls=http://127.0.0.1:2379 \\
  --listen-peer-urls=http://127.0.0.1:2380 --initial-advertise-peer-urls=http://127.0.0.1:2380 \\
  --initial-cluster=kvirt-test=http://127.0.0.1:2380 --log-level=warn \\
  --heartbeat-interval=20 --election-timeout=200
Restart=on-failure
RestartSec=1
LimitNOFILE=65536
### kube-apiserver.service
[Unit]
Description=Kubernetes API server (kvirt test control plane)
Wants=etcd.service
After=etcd.service

[Service]
ExecStart=/usr/local/bin/kube-apiserver \\
  --etcd-servers=http://127.0.0.1:2379 \\
  --bind-address=$bind --advertise-address=127.0.0.1 --secure-port=6443 \\
  --tls-cert-file=/etc/kvirt/pki/apiserver.crt --tls-private-key-file=/etc/kvirt/pki/apiserver.key \\
  --client-ca-file=/etc/kvirt/pki/ca.crt \\
  --authorization-mode=Node,RBAC \\
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \\
  --service-account-key-file=/etc/kvirt/pki/sa.pub \\
  --service-account-signing-key-file=/etc/kvirt/pki/sa.key \\
  --service-cluster-ip-range=$TH_K8S_SERVICE_CIDR \\
  --endpoint-reconciler-type=none \\
  --allow-privileged=true --profiling=false \\
  --enable-admission-plugins=NodeRestriction \\
  --enable-bootstrap-token-auth \\
  --requestheader-client-ca-file=/etc/kvirt/pki/front-proxy-ca.crt \\
  --requestheader-allowed-names=front-proxy-client \\
  --requestheader-username-headers=X-Remote-User \\
  --requestheader-group-headers=X-Remote-Group \\
  --requestheader-extra-headers-prefix=X-Remote-Extra- \\
  --proxy-client-cert-file=/etc/kvirt/pki/front-proxy-client.crt \\
  --proxy-client-key-file=/etc/kvirt/pki/front-proxy-client.key \\
  --enable-aggregator-routing=true \$KUBE_APISERVER_ARGS
# Extra flags for one run (the fleet benchmark's audit log).
EnvironmentFile=-/etc/kvirt/kube-apiserver.env
Restart=on-failure
RestartSec=1
LimitNOFILE=65536
### kube-controller-manager.service
[Unit]
Description=Kubernetes controller manager (kvirt test control plane)
Wants=kube-apiserver.service
After=kube-apiserver.service

[Service]
# The controllers a cluster without pods needs: of persistent storage
# (claims bound to volumes by the PV binder, and both kept while in use),
# the signer of approved client certificates (kvirt hosts' identities, by
# the test CA), the cleaners of old requests and expired bootstrap tokens. No leader
# election (one instance); nothing served but on loopback.
ExecStart=/usr/local/bin/kube-controller-manager \
  --kubeconfig=/etc/kvirt/admin.kubeconfig \
  --controllers=persistentvolume-binder-controller,persistentvolumeclaim-protection-controller,persistentvolume-protection-controller,certificatesigningrequest-signing-controller,certificatesigningrequest-cleaner-controller,token-cleaner-controller \
  --cluster-signing-kube-apiserver-client-cert-file=/etc/kvirt/pki/ca.crt \
  --cluster-signing-kube-apiserver-client-key-file=/etc/kvirt/pki/ca.key \
  --leader-elect=false --bind-address=127.0.0.1 \
  --pvclaimbinder-sync-period=2s
Restart=on-failure
RestartSec=1
EOT
}

# The first address of the service range (the "kubernetes" Service's cluster IP).
th__k8s_service_ip() {
  local net=${TH_K8S_SERVICE_CIDR%/*} a b c d
  IFS=. read -r a b c d <<<"$net"
  echo "$a.$b.$c.$((d + 1))"
}

# th__k8s_readyz NAME: one probe of /readyz with the admin kubeconfig, from the outer
# machine's cached kubectl in the test host's network namespace (cheap to repeat).
th__k8s_readyz() {
  local pid kubectl
  pid=$(th_pid1 "$1") || return
  kubectl=$(th_kubectl) || return
  nsenter -t "$pid" -n "$kubectl" --kubeconfig="$(th_share "$1")/admin.kubeconfig" \
    --request-timeout=2s get --raw=/readyz >/dev/null 2>&1
}

# th_k8s_wait_ready NAME [DEADLINE_S]: poll /readyz until it answers ok; on timeout,
# print the units' state and journal.
th_k8s_wait_ready() {
  local name=$1 deadline=${2:-$TH_K8S_READY_TIMEOUT}
  th__k8s_probe() { th__k8s_readyz "$name"; }
  if ! th_wait "$deadline" th__k8s_probe; then
    th_exec "$name" systemctl status --no-pager -n 40 etcd.service kube-apiserver.service >&2 || true
    th_die "test host $name: kube-apiserver not ready after ${deadline}s"; return
  fi
}

# th_k8s_up NAME: in the booted test host NAME, create the PKI and the admin
# kubeconfig, install kube-apiserver, kube-controller-manager, kubectl, virtctl,
# etcd, etcdctl at /usr/local/bin (binds from th_k8s_binds, or copies), start
# etcd.service and kube-apiserver.service and wait until /readyz is ok.
# Idempotent: a second call only (re)starts what is stopped.
th_k8s_up() {
  local name=$1 pid t t0 bins etcd share
  pid=$(th_pid1 "$name") || return
  share=$(th_share "$name")
  t0=$(th__now)
  bins=$(th_k8s_bins) || return
  etcd=$(th_etcd) || return
  local f src
  for f in kube-apiserver kube-controller-manager kubectl virtctl etcd etcdctl; do
    [[ -x /proc/$pid/root/usr/local/bin/$f ]] && continue
    case $f in
      etcd*) src=$etcd/$f ;;
      virtctl) src=$(th_virtctl) || return ;;
      *) src=$bins/$f ;;
    esac
    th_log "test host $name: copying $f in (boot with TH_BIND_RO=\"\$(th_k8s_binds)\" to bind it)"
    th_copy_in "$name" "$src" "/usr/local/bin/$f" || return
  done
  t=$(th__now)
  th_exec "$name" /bin/bash -euc "$(th__k8s_pki_script)" pki "$TH_K8S_SERVER" "$(th__k8s_service_ip)" "$TH_K8S_ADDRESS" ||
    { th_die "test host $name: creating the PKI failed"; return; }
  th_log "test host $name: PKI and admin kubeconfig in $(th__since "$t")"
  local units; units=$(mktemp -d)
  th__k8s_units | awk -v d="$units" '/^### / { f = d "/" $2; next } { print > f }'
  th_copy_in "$name" "$units" /etc/systemd/system || { rm -rf "$units"; return 1; }
  rm -rf "$units"
  t=$(th__now)
  # etcd is Type=notify: "systemctl start" returns when it serves.
  th_exec "$name" /bin/bash -euc 'systemctl daemon-reload; systemctl start etcd.service' ||
    { th_exec "$name" journalctl -u etcd.service --no-pager -n 30 >&2; th_die "test host $name: etcd failed to start"; return; }
  th_log "test host $name: etcd up in $(th__since "$t")"
  t=$(th__now)
  th_exec "$name" systemctl start kube-apiserver.service || return
  th_k8s_wait_ready "$name" || return
  th_exec "$name" systemctl start kube-controller-manager.service || return
  th_log "test host $name: kube-apiserver ready in $(th__since "$t") (control plane up in $(th__since "$t0"));" \
    "admin kubeconfig: /etc/kvirt/admin.kubeconfig, outside: $share/admin.kubeconfig"
}

# th_k8s_stop_apiserver NAME: stop kube-apiserver.service (etcd keeps running).
th_k8s_stop_apiserver() {
  local t; t=$(th__now)
  th_exec "$1" systemctl stop kube-apiserver.service || return
  th_log "test host $1: kube-apiserver stopped in $(th__since "$t")"
}

# th_k8s_start_apiserver NAME: start kube-apiserver.service and wait for /readyz.
th_k8s_start_apiserver() {
  local t; t=$(th__now)
  th_exec "$1" systemctl start kube-apiserver.service || return
  th_k8s_wait_ready "$1" || return
  th_log "test host $1: kube-apiserver ready in $(th__since "$t")"
}

# th_k8s_kubeconfig NAME USER [GROUP...]: mint a client certificate (CN=USER,
# O=GROUP...) signed by the test CA and write a self-contained kubeconfig for it;
# echo its path inside the host (/etc/kvirt/kubeconfigs/<USER with ':' -> '_'>.kubeconfig;
# a copy goes to share/kubeconfigs/). It grants nothing: bind RBAC to USER or a GROUP.
th_k8s_kubeconfig() {
  local name=$1 user=$2; shift 2
  [[ -n $user ]] || th_die "th_k8s_kubeconfig: no user name" || return
  th_exec "$name" /bin/bash -euc '
    server=$1 user=$2; shift 2
    esc() { printf "%s" "$1" | sed "s#[/\\\\]#\\\\&#g"; }
    subj=
    for g in "$@"; do subj+="/O=$(esc "$g")"; done
    subj+="/CN=$(esc "$user")"
    f=$(printf "%s" "$user" | tr -c "A-Za-z0-9._-" _)
    pki=/etc/kvirt/pki
    [[ -s $pki/ca.key ]] || { echo "no CA: run th_k8s_up first" >&2; exit 1; }
    k=$pki/users/$f
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$k.key" 2>/dev/null
    chmod 0600 "$k.key"
    openssl req -new -key "$k.key" -subj "$subj" -out "$k.csr"
    printf "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n" >"$k.ext"
    openssl x509 -req -in "$k.csr" -CA $pki/ca.crt -CAkey $pki/ca.key -CAcreateserial \
      -days 365 -sha256 -extfile "$k.ext" -out "$k.crt" 2>/dev/null
    rm -f "$k.csr" "$k.ext"
    out=/etc/kvirt/kubeconfigs/$f.kubeconfig
    install -d -m 0755 /etc/kvirt/kubeconfigs /share/kubeconfigs
    cat >"$out" <<KC
apiVersion: v1
kind: Config
clusters:
- name: kvirt-test
  cluster:
    server: $server
    certificate-authority-data: $(base64 -w0 <$pki/ca.crt)
users:
- name: $f
  user:
    client-certificate-data: $(base64 -w0 <"$k.crt")
    client-key-data: $(base64 -w0 <"$k.key")
contexts:
- name: $f@kvirt-test
  context:
    cluster: kvirt-test
    user: $f
current-context: $f@kvirt-test
KC
    chmod 0600 "$out"
    cp "$out" /share/kubeconfigs/
    echo "$out"' kubeconfig "$TH_K8S_SERVER" "$user" "$@"
}

# th_k8s_kubectl NAME ARGS...: run kubectl inside test host NAME as the admin (as a
# transient service, like th_exec: stdin/stdout/exit code propagate).
th_k8s_kubectl() {
  local name=$1; shift
  th_exec "$name" /usr/local/bin/kubectl --kubeconfig=/etc/kvirt/admin.kubeconfig "$@"
}
