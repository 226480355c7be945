#!/usr/bin/env bash
# The README's main command: sets up (or reuses) the environment, reinstalls this project from the
# working tree, then runs the main job on real vLLM schedulers.
#
#   scripts/run.sh [LINE] [args...]     LINE = v0.18.0 (default)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
line="v0.18.0"
if [ $# -gt 0 ] && [[ "$1" == v* ]]; then line="$1"; shift; fi
venv="$("$root/scripts/bootstrap.sh" "$line")"
cd "$root"
exec "$venv/bin/python" scripts/demo_balance.py "$@"
