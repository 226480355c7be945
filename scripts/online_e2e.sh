#!/usr/bin/env bash
# The CPU online-serving end-to-end test: a real `vllm serve <tiny MoE> --data-parallel-size 2
# --enable-expert-parallel`, driven by vLLM's own benchmark client in bursts with idle gaps and JSON-mode
# requests, balance off and on (config switch). On the vLLM CUDA wheel's lines only the model forward is faked
# (tests/e2e_cpu/fake_forward, a test-only platform plugin put on PYTHONPATH, never installed); on the
# v0.32.0-cpu line (vLLM's CPU build) the model runs for real (tests/e2e_cpu/test_real_forward.py, with the
# test-only fixes of tests/e2e_cpu/real_forward). Sets up (or reuses) the line's environment first, like
# scripts/test.sh.
#
# With `ray` after the line: the same serving test on vLLM's Ray DP backend, over a two-node Ray cluster the test
# starts on this machine (tests/e2e_cpu/test_ray_dp.py).
#
#   scripts/online_e2e.sh [LINE] [ray] [pytest args...]
#   LINE = v0.18.0 (default), v0.23.0, main, v0.33.0 or v0.32.0-cpu
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
line="v0.18.0"
if [ $# -gt 0 ] && [[ "$1" == v* || "$1" == main ]]; then line="$1"; shift; fi
backend=mp
if [ $# -gt 0 ] && [ "$1" = ray ]; then backend=ray; shift; fi
venv="$("$root/scripts/bootstrap.sh" "$line")"
cd "$root"
start=$SECONDS
status=0
# -s: each test prints its measured line (start-up, requests, gated steps per rank, run time).
case "$backend:$line" in
  ray:*) tests=tests/e2e_cpu/test_ray_dp.py ;;
  *-cpu) tests=tests/e2e_cpu/test_real_forward.py ;;
  *) tests=tests/e2e_cpu/test_online_serving.py ;;
esac
"$venv/bin/pytest" -p no:cacheprovider -s -rxXs "$tests" "$@" || status=$?
echo "online e2e ($line, $backend): wall $((SECONDS - start)) s, pytest exit $status"
exit "$status"
