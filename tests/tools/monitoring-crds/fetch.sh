#!/usr/bin/env bash
# Fetches the CustomResourceDefinitions of the objects the chart's optional monitoring
# templates make (PodMonitor, ServiceMonitor and PrometheusRule of the Prometheus Operator;
# KEDA's ScaledObject), so that a test can install them in the local control plane and have
# the API server validate what the chart renders. They are files of the two projects' Go
# modules, so they come from the Go module proxy like the rest of the test tools, checked
# against the sums pinned here (and sum.golang.org). Copied once per machine into a
# directory keyed by this script; prints that directory on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
key=$(sha256sum <"$here/fetch.sh" | cut -c1-16)
dir="$cache_root/monitoring-crds-$key"
if [ -f "$dir/complete" ]; then
  echo "$dir"
  exit 0
fi
# module version sum directory-in-module files...
crds=(
  "github.com/prometheus-operator/prometheus-operator v0.85.0 h1:M5xLCLEoaW2IJfnuCwFzzpL+jSVQu3KGT84Pye+fW8s= example/prometheus-operator-crd monitoring.coreos.com_podmonitors.yaml monitoring.coreos.com_servicemonitors.yaml monitoring.coreos.com_prometheusrules.yaml"
  "github.com/kedacore/keda/v2 v2.21.0 h1:R6z2HZvstK4RLUMxroNACzBj74xGxt3kG59b5Xc+Xps= config/crd/bases keda.sh_scaledobjects.yaml"
)
tmp="$dir.tmp.$$"
rm -rf "$tmp"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
# `go mod download` needs no module of its own for module@version.
cd "$tmp"
for line in "${crds[@]}"; do
  read -r module version sum subdir files <<<"$line"
  json=$(go mod download -json "$module@$version")
  got=$(sed -n 's/^[[:space:]]*"Sum": "\(.*\)",$/\1/p' <<<"$json")
  if [ "$got" != "$sum" ]; then
    echo "fetch.sh: $module@$version has sum $got, not the pinned $sum" >&2
    exit 1
  fi
  src=$(sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p' <<<"$json")
  for f in $files; do
    cp "$src/$subdir/$f" "$tmp/$f"
    chmod 644 "$tmp/$f"
  done
  echo "$module $version" >>"$tmp/versions"
done
touch "$tmp/complete"
rm -rf "$dir"
mv "$tmp" "$dir"
trap - EXIT
echo "$dir"
