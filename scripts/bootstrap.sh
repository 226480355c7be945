#!/usr/bin/env bash
# Creates (or reuses, when current) the CPU test environment for one release line and installs
# this project into it the way a user would. Idempotent: a stamp records what was installed, so a
# second run with unchanged inputs only re-installs this project (cheap) and never the 3 GB base.
#
#   scripts/bootstrap.sh [LINE]      LINE = v0.18.0 (default, venv .venv) or v0.23.0 (.venv-v0.23.0)
#
# Why each choice:
#  - torch==2.13.0 is the CPU build lying on this machine's disk; a bare "torch" would pull CUDA.
#  - vllm / vllm-ascend wheels are installed with --no-deps: their metadata pins CUDA torch,
#    torch_npu, triton-ascend..., none of which can (or should) exist on a CPU machine.
#  - vLLM's pure-Python requirements come from requirements/<LINE>.txt, fully pinned, installed
#    with --no-deps so nothing is resolved (and no CUDA wheel sneaks in) at install time.
set -euo pipefail

line="${1:-v0.18.0}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

case "$line" in
  v0.18.0) venv=".venv"; vllm_version="0.18.0"; ascend_version="0.18.0" ;;
  v0.23.0) venv=".venv-v0.23.0"; vllm_version="0.23.0"; ascend_version="0.23.0" ;;
  *) echo "bootstrap: unknown release line '$line' (supported: v0.18.0, v0.23.0)" >&2; exit 2 ;;
esac

python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
"$python_bin" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' || {
  echo "bootstrap: Python 3.11 is required (found $("$python_bin" --version 2>&1))" >&2; exit 2; }

stamp_inputs="$line vllm==$vllm_version vllm-ascend==$ascend_version torch==2.13.0 \
$(sha256sum requirements/"$line".txt requirements/test.txt requirements/tools.txt | cut -c1-16 | tr '\n' ' ')"
stamp="$venv/.balance-bootstrap-stamp"

# Several shells (or helper sessions) may run this at once: one installer at a time per venv.
mkdir -p "$venv"
exec 9>"$venv.lock"
flock 9

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$stamp_inputs" ] && [ -x "$venv/bin/python" ]; then
  echo "bootstrap: $venv is current for $line" >&2
else
  echo "bootstrap: building $venv for $line (vllm $vllm_version, vllm-ascend $ascend_version)" >&2
  [ -x "$venv/bin/python" ] || "$python_bin" -m venv --clear "$venv"
  pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install torch==2.13.0
  "${pip[@]}" install --no-deps -r requirements/"$line".txt -r requirements/test.txt \
    -r requirements/tools.txt
  "${pip[@]}" install --no-deps "vllm==$vllm_version" "vllm-ascend==$ascend_version"
  # A CUDA torch or torch_npu in this env would be a bootstrap bug: refuse loudly.
  "$venv/bin/python" - <<'EOF'
import importlib.util, sys
import torch
if torch.version.cuda is not None or importlib.util.find_spec("torch_npu") is not None:
    sys.exit(f"bootstrap: wrong torch in env: {torch.__version__} cuda={torch.version.cuda}")
EOF
  # vllm-ascend's platform plugin imports torch_npu, which cannot exist on a CPU machine, and
  # vLLM would load it on first use. In this CPU stand-in environment only, default VLLM_PLUGINS
  # to this project's plugin (an explicit VLLM_PLUGINS still wins).
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo 'import os; os.environ.setdefault("VLLM_PLUGINS", "ascend_balance_scheduling")' \
    > "$site/vllm_ascend_balance_cpu_env.pth"
  echo "$stamp_inputs" > "$stamp"
fi

# Always (re)install this project from the working tree, non-editable, exactly as a user would.
"$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --no-build-isolation \
  --force-reinstall "$root"
"$venv/bin/python" -c "import vllm_ascend.core.balance_scheduler" >/dev/null 2>&1 || {
  "$venv/bin/python" -c "import vllm_ascend.core.balance_scheduler" >&2 || true
  echo "bootstrap: project install into $venv failed" >&2; exit 1; }
echo "$venv"
