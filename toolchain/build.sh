#!/usr/bin/env bash
# Builds the local control-plane binaries from the pinned wrapper modules in this folder,
# into a cache folder keyed by product and version, building only what is missing.
#
#   toolchain/build.sh            build what is missing, print the bin folder of each product
#   KVTOPO_CACHE=/path ...        cache root (default ~/.cache/kvtopo)
#
# Layout: $KVTOPO_CACHE/bin/<product>-<version>/<binary> plus a .stamp file written last,
# so an interrupted build is redone, never half-trusted.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${KVTOPO_CACHE:-$HOME/.cache/kvtopo}
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly

K8S_VERSION=v1.36.3
ETCD_VERSION=v3.6.16
KWOK_VERSION=v0.8.0
HELM_VERSION=v3.22.0

log() { printf '[toolchain %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

build_product() {  # product version module-dir ldflags binary=package...
  local product=$1 version=$2 dir=$3 ldflags=$4; shift 4
  local out="$cache/bin/$product-$version"
  if [[ -f "$out/.stamp" ]]; then
    log "$product $version: cached in $out"; return 0
  fi
  mkdir -p "$out"
  local spec bin pkg t0
  for spec in "$@"; do
    bin=${spec%%=*}; pkg=${spec#*=}
    t0=$(date +%s)
    log "$product $version: building $bin (this takes minutes on a small machine) ..."
    (cd "$here/$dir" && go build -trimpath -tags selinux,notest,grpcnotrace \
        -ldflags "-s -w $ldflags" -o "$out/$bin.tmp" "$pkg")
    mv "$out/$bin.tmp" "$out/$bin"
    log "$product $version: $bin built in $(( $(date +%s) - t0 )) s"
  done
  date -u +%Y-%m-%dT%H:%M:%SZ > "$out/.stamp"
}

build_date=2026-07-22T18:07:38Z   # the v1.36.3 tag time, so rebuilds are byte-stable
kv=k8s.io/component-base/version
cv=k8s.io/client-go/pkg/version
k8s_ldflags=""
for p in $kv $cv; do
  k8s_ldflags+=" -X $p.gitVersion=$K8S_VERSION -X $p.gitMajor=1 -X $p.gitMinor=36"
  k8s_ldflags+=" -X $p.gitTreeState=clean -X $p.buildDate=$build_date"
done

PAUSE_VERSION=1.0   # toolchain/pause: bump when main.go changes
products=${*:-"etcd k8s kubelet pause kwok helm"}
for product in $products; do
  case $product in
    etcd) build_product etcd $ETCD_VERSION etcd "" etcd=go.etcd.io/etcd/server/v3 ;;
    k8s)  build_product k8s $K8S_VERSION k8s "$k8s_ldflags" \
            kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
            kubectl=k8s.io/kubernetes/cmd/kubectl \
            kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
            kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler ;;
    # The real node's kubelet (tier c), from the same module graph as the control plane.
    kubelet) build_product kubelet $K8S_VERSION k8s "$k8s_ldflags" \
            kubelet=k8s.io/kubernetes/cmd/kubelet ;;
    # The pod sandbox image's only file (tier c): built static, so the image is FROM scratch.
    pause) build_product pause $PAUSE_VERSION pause "" pause=. ;;
    kwok) build_product kwok $KWOK_VERSION kwok "-X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" \
            kwok=sigs.k8s.io/kwok/cmd/kwok ;;
    helm) build_product helm $HELM_VERSION helm "-X helm.sh/helm/v3/internal/version.version=$HELM_VERSION -X helm.sh/helm/v3/internal/version.gitTreeState=clean" \
            helm=helm.sh/helm/v3/cmd/helm ;;
    *) echo "unknown product '$product' (known: etcd k8s kubelet pause kwok helm)" >&2; exit 2 ;;
  esac
done
du -sh "$cache/bin" >&2
