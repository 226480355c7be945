"""Every scheduler class the installed vllm-ascend's ``platform.py`` can select, with balance scheduling.

vllm-ascend main selects its own scheduler classes in ``platform.py`` (short-request-first, batch-job-aware,
profiling-chunk, DyntraLB, the recompute family). For each one this project has decided:

* **balanced**: its ``schedule()`` honours the pause-state seam, balance scheduling may be on with it, and
  ``balance_scheduler_class`` gates it (shown on a real instance: gate closed, nothing admitted);
* **refused**: the configuration that selects it cannot have balance scheduling on. vllm-ascend main states
  these exclusions in ``AscendConfig`` / ``platform._check_ascend_config`` (profiling chunk; DyntraLB; both
  DyntraLB and recompute only on PD-disaggregated D nodes, where balance is refused); on this project's plugin
  path the Ascend platform's check runs first, inside ``VllmConfig.__post_init__``, before the wiring decides.

A class that appears in ``platform.py`` without a verdict fails here, so a new vllm-ascend class gets a decision.
vllm-ascend code is imported with ``torch_npu`` stubbed (``offline_vllm.torch_npu_stubbed_for_import``): it
imports torch_npu at the top but uses none of it for what is tested here.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from offline_vllm import build_scheduler, emulate_gather, make_request, make_vllm_config, torch_npu_stubbed_for_import

from vllm_ascend.core.balance_scheduler import BalanceSchedulingMixin, balance_scheduler_class
from vllm_ascend.core.balance_seam import schedule_seam
from vllm_ascend_balance.patch_balance_schedule import decide

CAP = 4
_CORE = "vllm_ascend.core."

# How each class is selected (the additional_config / config that makes platform.py choose it) and the verdict.
BALANCED = {
    "vllm_ascend.core.short_request_first_scheduler.ShortRequestFirstAsyncScheduler": (
        {"scheduler_config": {"short_request_first_config": {"enabled": True}}},
        True,
    ),
    "vllm_ascend.core.batch_job_aware_scheduler.BatchJobAwareScheduler": (
        {"scheduler_config": {"batch_job_sched_config": {"enabled": True}}},
        False,
    ),
    "vllm_ascend.core.batch_job_aware_scheduler.BatchJobAwareAsyncScheduler": (
        {"scheduler_config": {"batch_job_sched_config": {"enabled": True}}},
        True,
    ),
}
# Refused: why, as vllm-ascend main states it.
REFUSED = {
    "vllm_ascend.core.scheduler_profiling_chunk.ProfilingChunkScheduler": "profiling_chunk_config + balance",
    "vllm_ascend.core.dyntra_lb_scheduler.DyntraLBScheduler": "DyntraLB + balance; D nodes only",
    "vllm_ascend.core.dyntra_lb_scheduler.AsyncDyntraLBScheduler": "DyntraLB + balance; D nodes only",
    "vllm_ascend.core.recompute_scheduler.RecomputeScheduler": "D nodes only (kv_consumer)",
    "vllm_ascend.core.recompute_scheduler.AsyncRecomputeScheduler": "D nodes only (kv_consumer)",
    "vllm_ascend.core.recompute_scheduler.DyntraLBRecomputeScheduler": "D nodes only (kv_consumer)",
    "vllm_ascend.core.recompute_scheduler.AsyncDyntraLBRecomputeScheduler": "D nodes only (kv_consumer)",
}
# Selected by older lines' platform.py; covered by test_balance_gate's refusal test.
OLDER_LINES = {"vllm_ascend.core.scheduler_dynamic_batch.SchedulerDynamicBatch"}


def _platform_source() -> Path | None:
    spec = importlib.util.find_spec("vllm_ascend")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "platform.py"
    return path if path.exists() else None


PLATFORM = _platform_source()
pytestmark = pytest.mark.skipif(PLATFORM is None, reason="vllm-ascend is not installed on this line")


def selectable_classes(source: str) -> set[str]:
    """Every ``vllm_ascend.core.<module>.<Class>`` string constant in platform.py's source."""
    pattern = re.compile(r"vllm_ascend\.core\.\w+\.\w+")
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and pattern.fullmatch(node.value)
    }


def _import(qualname: str) -> type:
    module, name = qualname.rsplit(".", 1)
    with torch_npu_stubbed_for_import():
        return getattr(importlib.import_module(module), name)


@pytest.fixture
def fresh_ascend_config() -> Iterator[None]:
    """vllm-ascend caches its AscendConfig per process; each test starts and ends without one. Its
    ``vllm_ascend.utils`` (imported lazily by the classes' constructors) is imported here, with the stub."""
    with torch_npu_stubbed_for_import():
        importlib.import_module("vllm_ascend.utils")
        ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    ascend_config.clear_ascend_config()
    yield
    ascend_config.clear_ascend_config()


def test_every_selectable_class_has_a_verdict() -> None:
    assert PLATFORM is not None
    found = selectable_classes(PLATFORM.read_text())
    assert found, f"{PLATFORM} names no vllm_ascend.core scheduler class any more"
    unknown = found - set(BALANCED) - set(REFUSED) - OLDER_LINES
    assert not unknown, f"decide balanced or refused for {sorted(unknown)} (new in {PLATFORM})"


def _on_this_line(qualname: str) -> None:
    assert PLATFORM is not None
    if qualname not in selectable_classes(PLATFORM.read_text()):
        pytest.skip(f"this line's vllm-ascend platform.py does not select {qualname}")


@pytest.mark.parametrize("qualname", sorted(BALANCED) + sorted(REFUSED))
def test_the_class_honours_the_seam(qualname: str) -> None:
    """So a refusal below is the configuration's, never the gate's."""
    _on_this_line(qualname)
    assert schedule_seam(_import(qualname), skip=(BalanceSchedulingMixin,)).problems == []


@pytest.mark.parametrize("qualname", sorted(BALANCED))
def test_a_balanced_class_is_gated(
    balance_on: None, fresh_ascend_config: None, tiny_model: Path, qualname: str
) -> None:
    _on_this_line(qualname)
    additional_config, async_scheduling = BALANCED[qualname]
    base = _import(qualname)
    config = make_vllm_config(
        tiny_model,
        max_num_seqs=CAP,
        dp_size=2,
        async_scheduling=async_scheduling,
        additional_config=additional_config,
    )
    balanced = balance_scheduler_class(base)
    assert issubclass(balanced, base) and balanced.__mro__[1] is BalanceSchedulingMixin
    scheduler = build_scheduler(balanced, config)
    scheduler.add_request(make_request("new"))
    emulate_gather([scheduler], [CAP, 0])
    assert scheduler.schedule().scheduled_new_reqs == []
    emulate_gather([scheduler], [0, 0])
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["new"]
    assert scheduler.balance_gated_steps == 1


def test_short_request_first_keeps_its_waiting_queue_when_balanced(
    balance_on: None, fresh_ascend_config: None, tiny_model: Path
) -> None:
    qualname = "vllm_ascend.core.short_request_first_scheduler.ShortRequestFirstAsyncScheduler"
    _on_this_line(qualname)
    queue_cls = _import("vllm_ascend.core.short_request_first_scheduler.ShortRequestFirstRequestQueue")
    additional_config, async_scheduling = BALANCED[qualname]
    config = make_vllm_config(
        tiny_model, dp_size=2, async_scheduling=async_scheduling, additional_config=additional_config
    )
    scheduler = build_scheduler(balance_scheduler_class(_import(qualname)), config)
    assert isinstance(scheduler.waiting, queue_cls)


# ---- the exclusions vllm-ascend main states, on this project's plugin path ----------------------------------------

_SWITCH_FORMS = {
    "nested": ({"scheduler_config": {"enable_balance_scheduling": True}}, None),
    "top-level": ({"enable_balance_scheduling": True}, None),
    "env": ({}, "1"),
}


def _merge(switch: dict[str, Any], feature: dict[str, Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {**switch, **feature}
    merged["scheduler_config"] = {**switch.get("scheduler_config", {}), **feature.get("scheduler_config", {})}
    return merged


@pytest.fixture
def ascend_platform_checks(monkeypatch: pytest.MonkeyPatch, fresh_ascend_config: None) -> None:
    """The Ascend platform's config check as ``VllmConfig.__post_init__`` runs it on an NPU
    (``NPUPlatform.check_and_update_config``: ``init_ascend_config`` then ``_check_ascend_config``), in place
    of the CPU platform's. Only the platform is stood in for; the config, the plugin's wrappers and vllm-ascend's
    checks are real. The deployment stood in for has pipeline parallelism (profiling chunk requires PP > 1, and
    the CPU platform cannot build a PP config), so pipeline_parallel_size is 2 when vllm-ascend checks."""
    from vllm.platforms import current_platform

    with torch_npu_stubbed_for_import():
        platform = importlib.import_module("vllm_ascend.platform")
        ascend_config = importlib.import_module("vllm_ascend.ascend_config")
    if not hasattr(platform, "_check_ascend_config"):
        pytest.skip("this line's vllm-ascend has no _check_ascend_config (main's scheduler-extension exclusions)")
    cpu_check = current_platform.check_and_update_config

    def check_and_update_config(vllm_config: Any) -> None:
        cpu_check(vllm_config)
        vllm_config.parallel_config.pipeline_parallel_size = 2
        ascend_config.clear_ascend_config()
        platform._check_ascend_config(vllm_config, ascend_config.init_ascend_config(vllm_config))

    monkeypatch.setattr(current_platform, "check_and_update_config", check_and_update_config)


@pytest.mark.parametrize("form", sorted(_SWITCH_FORMS))
@pytest.mark.parametrize(
    "feature, message",
    [
        ({"scheduler_config": {"profiling_chunk_config": {"enabled": True}}}, "profiling_chunk_config and balance"),
        ({"scheduler_config": {"dyntra_lb_config": {"enabled": True}}}, "DyntraLB cannot be used with enable_balance"),
    ],
    ids=["profiling-chunk", "dyntra-lb"],
)
def test_main_exclusions_refuse_the_combination_on_the_plugin_path(
    monkeypatch: pytest.MonkeyPatch,
    ascend_platform_checks: None,
    tiny_model: Path,
    form: str,
    feature: dict[str, Any],
    message: str,
) -> None:
    switch, env = _SWITCH_FORMS[form]
    if env is None:
        monkeypatch.delenv("VLLM_ASCEND_BALANCE_SCHEDULING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_BALANCE_SCHEDULING", env)
    with pytest.raises(ValueError, match=message):
        make_vllm_config(tiny_model, dp_size=2, additional_config=_merge(switch, feature))


@pytest.mark.parametrize("feature", ["profiling_chunk_config", "dyntra_lb_config"])
def test_without_balance_the_feature_passes_the_same_checks(
    monkeypatch: pytest.MonkeyPatch,
    balance_env_unset: None,
    ascend_platform_checks: None,
    tiny_model: Path,
    feature: str,
) -> None:
    """The refusal above is the balance exclusion, not the feature failing on its own for another reason first:
    without balance scheduling the same config fails, if at all, with the feature's own message."""
    try:
        config = make_vllm_config(
            tiny_model, dp_size=2, additional_config={"scheduler_config": {feature: {"enabled": True}}}
        )
    except ValueError as error:
        assert "balance" not in str(error).lower()
    else:
        assert decide(config) is False
