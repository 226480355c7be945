#!/usr/bin/env bash
# The README's main command: sets up (or reuses) the environment, reinstalls this project from the
# working tree, then runs the main job: the DP serving simulator on real vLLM schedulers,
# reproducing the balance-scheduling result table (balance off vs on) with a plot.
#
#   scripts/run.sh [LINE] [simulate_dp.py args...]     LINE = v0.18.0 (default), v0.23.0, main, v0.33.0 or v0.32.0-cpu
#
# With no arguments: --preset rfc-dsv31 --compare, results in out/ (JSON and PNG).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
line="v0.18.0"
if [ $# -gt 0 ] && [[ "$1" == v* || "$1" == main ]]; then line="$1"; shift; fi
venv="$("$root/scripts/bootstrap.sh" "$line")"
cd "$root"
if [ $# -eq 0 ]; then
  mkdir -p out
  set -- --preset rfc-dsv31 --compare --json "out/rfc-dsv31-$line.json" --plot "out/rfc-dsv31-$line.png"
fi
exec "$venv/bin/python" scripts/simulate_dp.py "$@"
