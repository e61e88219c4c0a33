#!/usr/bin/env bash
# Register every deployment of prefect.yaml. Workers find the code at CLGRPO_PROJECT_DIR (default: here).
set -euo pipefail
cd "$(dirname "$0")/.."
export CLGRPO_PROJECT_DIR="${CLGRPO_PROJECT_DIR:-$PWD}"
prefect --no-prompt deploy --all "$@"
