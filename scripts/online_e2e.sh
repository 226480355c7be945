#!/usr/bin/env bash
# The CPU online-serving end-to-end test: a real `vllm serve <tiny MoE> --data-parallel-size 2
# --enable-expert-parallel` with only the model forward faked (tests/e2e_cpu/fake_forward, a
# test-only platform plugin put on PYTHONPATH, never installed), driven by vLLM's own benchmark
# client in bursts with idle gaps and JSON-mode requests, balance off and on (config switch).
# Sets up (or reuses) the release line's environment first, like scripts/test.sh.
#
#   scripts/online_e2e.sh [LINE] [pytest args...]     LINE = v0.18.0 (default), v0.23.0 or main
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
line="v0.18.0"
if [ $# -gt 0 ] && [[ "$1" == v* || "$1" == main ]]; then line="$1"; shift; fi
venv="$("$root/scripts/bootstrap.sh" "$line")"
cd "$root"
start=$SECONDS
status=0
# -s: each test prints its measured line (start-up, requests, gated steps per rank, run time).
"$venv/bin/pytest" -p no:cacheprovider -s -rxXs tests/e2e_cpu "$@" || status=$?
echo "online e2e ($line): wall $((SECONDS - start)) s, pytest exit $status"
exit "$status"
