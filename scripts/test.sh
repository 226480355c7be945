#!/usr/bin/env bash
# The README's test command: sets up (or reuses) the environment for one release line, reinstalls
# this project from the working tree, then runs the unit tests.
#
#   scripts/test.sh [LINE] [pytest args...]     LINE = v0.18.0 (default), v0.23.0, main, v0.33.0 or v0.32.0-cpu
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
line="v0.18.0"
if [ $# -gt 0 ] && [[ "$1" == v* || "$1" == main ]]; then line="$1"; shift; fi
venv="$("$root/scripts/bootstrap.sh" "$line")"
cd "$root"
# The venv's pytest (not `python -m pytest`, which would put the repo root on sys.path): the
# installed project is what runs, and conftest.py fails the session if it is not the working tree.
exec "$venv/bin/pytest" "$@"  # with no path given, pytest.ini testpaths: tests/ut
