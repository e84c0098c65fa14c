#!/usr/bin/env bash
# Run a command inside a loopback-only network namespace (Ray and servers bind only to lo),
# with RAY_TMPDIR in this run's own temp folder and Ray's auth disabled.
# Where unprivileged namespaces are refused, the command runs in the normal namespace.
set -euo pipefail
if [ -z "${SPECSERVE_IN_NETNS:-}" ]; then
  export SPECSERVE_IN_NETNS=1
  if unshare -rn true 2>/dev/null; then
    exec unshare -rn "$0" "$@"
  fi
  echo "in-netns: network namespaces refused here; running in the normal namespace" >&2
fi
ip link set lo up 2>/dev/null || true
run_tmp="$(mktemp -d /tmp/specserve-run.XXXXXX)"
trap 'rm -rf "$run_tmp"' EXIT
export RAY_TMPDIR="${RAY_TMPDIR:-$run_tmp}"
export RAY_AUTH_MODE=disabled
export RAY_USAGE_STATS_ENABLED=0
"$@"
