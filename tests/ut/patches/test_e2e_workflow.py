"""The Ascend e2e workflow runs every series the way vllm-ascend's CI of its line would.

actionlint cannot be installed here (its PyPI wrapper downloads the binary from GitHub at build
time; no Go toolchain), so this checks what a wrong edit of ``.github/workflows/e2e-ascend.yaml``
would most likely break: every ``matrix.*`` it reads is defined and every value it compares a
matrix key with exists; one matrix line per manifest, its test directory where the series puts the
test; the label gate; the patched job going through upstream's suite scripts. The per-line pins are
also compared with the workflow files of vllm-ascend at each tag, which they cite (from the release
sdist, or the tag of ``$VLLM_ASCEND_GIT``: release_tree.py).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from export_patches import PATCHES_DIR, REPO_ROOT, load_manifest, resolve
from release_tree import release_source

WORKFLOW = REPO_ROOT / ".github/workflows/e2e-ascend.yaml"
E2E_SOURCE = "tests/e2e/test_balance_scheduling_dp.py"


@pytest.fixture(scope="module")
def job() -> dict[str, Any]:
    (only,) = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    return only


def _lines(job: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {entry["line"]: entry for entry in job["strategy"]["matrix"]["include"]}


def _steps_text(job: dict[str, Any]) -> str:
    return "\n".join(json.dumps(step) for step in job["steps"])


def test_every_matrix_value_read_is_defined_and_every_compared_value_exists(job: dict[str, Any]) -> None:
    matrix = job["strategy"]["matrix"]
    keys = {k for k in matrix if k != "include"} | {k for entry in matrix["include"] for k in entry}
    text = json.dumps(job)
    assert set(re.findall(r"matrix\.(\w+)", text)) <= keys
    for key, value in re.findall(r"matrix\.(\w+) == '([^']*)'", text):
        assert value in matrix[key], f"matrix.{key} == '{value}': not one of {matrix[key]}"
    # Every include entry extends an existing line (a typo there would add a bogus job instead).
    assert set(_lines(job)) == set(matrix["line"])


def test_one_matrix_line_per_series_with_the_test_where_the_series_puts_it(job: dict[str, Any]) -> None:
    lines = _lines(job)
    # The release lines; the main series (a commit's PR, `[base] archive`) has no Ascend job yet: docs/e2e.md.
    manifests = [m for m in map(load_manifest, sorted(PATCHES_DIR.glob("*.toml"))) if not m.archive]
    assert sorted(lines) == sorted(m.tag for m in manifests)
    for manifest in manifests:
        (target,) = [t for p in resolve(manifest) for t, s in p.sources.items() if s == E2E_SOURCE]
        assert f"{lines[manifest.tag]['e2e_dir']}/test_balance_scheduling_dp.py" == target


def test_a_pull_request_runs_it_only_with_upstreams_full_e2e_labels(job: dict[str, Any]) -> None:
    gate = job["if"]
    assert "github.event_name == 'workflow_dispatch'" in gate
    for label in ("ready", "ready-for-test"):
        assert f"contains(github.event.pull_request.labels.*.name, '{label}')" in gate


def test_the_patched_job_goes_through_upstreams_suite_scripts(job: dict[str, Any]) -> None:
    steps = _steps_text(job)
    for script in ("run_suite.sanity_check", "ci_utils import run_tests", "coverage.py", "select_tests.py"):
        assert script in steps
    assert "run_selected_tests.sh a3 2 with-device" in steps
    assert "BALANCE_E2E_REQUIRE_NPU" in steps  # on an NPU runner a skip would hide a broken runner


# ------------------------------------------------------------------------------- upstream's pins
def _upstream(tag: str, path: str) -> str:
    (manifest,) = [m for m in sorted(PATCHES_DIR.glob("*.toml")) if load_manifest(m).tag == tag]
    content = release_source(manifest).read(path)
    assert content is not None, f"{path} is not in vllm-ascend {tag}"
    return content.decode()


def test_v0_18_pins_are_upstreams(job: dict[str, Any]) -> None:
    upstream = yaml.safe_load(_upstream("v0.18.0", ".github/workflows/_e2e_test.yaml"))["jobs"]["e2e-2-cards-full"]
    image = upstream["container"]["image"]
    assert image.endswith("/" + _lines(job)["v0.18.0"]["cann_image"]), image
    assert upstream["container"]["env"]["HF_HUB_OFFLINE"] == job["container"]["env"]["HF_HUB_OFFLINE"] == 1
    theirs, ours = _steps_text({"steps": upstream["steps"]}), _steps_text(job)
    for pin in (
        r"torch_npu-2\.9\.0\.post1[^ \"]*\.whl",
        r"modelscope\.git@[0-9a-f]{40}",
        r"apt-get -y install gcc g\+\+ cmake libnuma-dev clang-15",
        r"update-alternatives --install /usr/bin/clang clang /usr/bin/clang-15 20",
    ):
        (found,) = set(re.findall(pin, theirs))
        assert found.replace("apt-get -y install gcc g++ cmake libnuma-dev ", "") in ours, found


def test_v0_23_pins_are_upstreams(job: dict[str, Any]) -> None:
    labels = json.loads(_upstream("v0.23.0", ".github/workflows/scripts/runner_label.json"))
    assert _lines(job)["v0.23.0"]["cann_image"] == f"cann:{labels['linux-aarch64-a3-2']['image_tag']}"
    theirs = _upstream("v0.23.0", ".github/workflows/_selected_tests.yaml")
    ours = _steps_text(job)
    for pin in (r"triton-ascend==[0-9.]+", r"uv pip install -e \. --no-build-isolation", r"submodules: recursive"):
        (found,) = set(re.findall(pin, theirs))
        assert found in ours or found.replace("submodules: recursive", '"submodules": "recursive"') in ours, found
