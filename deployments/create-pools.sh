#!/usr/bin/env bash
# Create the work pools clgrpo's deployments use: `cpu` (orchestration, evaluation) and `cuda` (rollouts).
# CUDA_POOL_TYPE=process (default: one worker per GPU on this host) or kubernetes (needs prefect-kubernetes).
set -euo pipefail
cd "$(dirname "$0")"
ensure_pool() {  # name, type, [template]
  if prefect work-pool inspect "$1" >/dev/null 2>&1; then
    echo "work pool $1 exists"
  elif [ -n "${3:-}" ]; then
    prefect work-pool create "$1" --type "$2" --base-job-template "$3"
  else
    prefect work-pool create "$1" --type "$2"
  fi
}
ensure_pool cpu process
case "${CUDA_POOL_TYPE:-process}" in
  process) ensure_pool cuda process cuda-process-template.json ;;
  kubernetes) ensure_pool cuda kubernetes cuda-kubernetes-template.json ;;
  *) echo "CUDA_POOL_TYPE must be process or kubernetes" >&2; exit 2 ;;
esac
