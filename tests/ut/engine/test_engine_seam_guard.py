#
# Copyright (c) 2026 Huawei Technologies Co., Ltd. All Rights Reserved.
# This file is a part of the vllm-ascend project.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
"""Guards the engine-core seams of the installed vLLM that the balance gather relies on.

If one of these fails after a vLLM upgrade, the hook may gather on some ranks and not on others
(deadlock) or not at all: re-read ``DPEngineCoreProc.run_busy_loop`` and
``EngineCoreProc.run_engine_core`` before changing anything. Each check is also run on an
altered copy of the source to prove it can fail.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import vllm.v1.engine.core as engine_core_module
import vllm.v1.engine.utils as engine_utils_module
from offline_vllm import build_scheduler, make_vllm_config
from pytest_mock import MockerFixture
from vllm.logger import logger
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core import DPEngineCoreProc, DPMoEEngineCoreActor, EngineCoreProc

from vllm_ascend.core.balance_engine_core import (
    BalanceDPEngineCoreProc,
    BalanceDPEngineMixin,
    BalanceDPMoEEngineCoreActor,
)
from vllm_ascend.core.balance_scheduler import BalanceScheduler
from vllm_ascend.core.balance_seam import engine_seam_problems, ray_seam_problems

CORE = inspect.getsource(engine_core_module)
LAUNCHER = inspect.getsource(engine_utils_module)
GATHER_CALL = "self.engines_running = self._has_global_unfinished_reqs("
IDLE_SKIP = "if not local_unfinished_reqs and not self.engines_running:"


def problems_with(core: str = CORE, launcher: str = LAUNCHER) -> list[str]:
    return engine_seam_problems(core_source=core, launcher_source=launcher)


def replaced(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"test fixture out of date: {old!r} not found once"
    return text.replace(old, new)


def test_installed_vllm_offers_every_engine_seam() -> None:
    assert engine_seam_problems() == []


def test_the_hook_extends_the_dp_set_up_and_the_gather_site_and_only_reports_at_shutdown() -> None:
    own = {name for name in vars(BalanceDPEngineMixin) if not name.startswith("__")}
    assert own == {"_init_data_parallel", "_has_global_unfinished_reqs", "shutdown"}
    assert list(inspect.signature(DPEngineCoreProc._init_data_parallel).parameters) == ["self", "vllm_config"]
    # One set of overrides over vLLM's own classes: the multiprocess engine core and Ray's MoE DP actor.
    assert BalanceDPEngineCoreProc.__bases__ == (BalanceDPEngineMixin, DPEngineCoreProc)
    assert BalanceDPMoEEngineCoreActor.__bases__ == (BalanceDPEngineMixin, DPMoEEngineCoreActor)
    for balanced in (BalanceDPEngineCoreProc, BalanceDPMoEEngineCoreActor):
        assert {name for name in vars(balanced) if not name.startswith("__")} == set()
    assert "_has_global_unfinished_reqs" in vars(DPEngineCoreProc)
    assert list(inspect.signature(DPEngineCoreProc._has_global_unfinished_reqs).parameters) == [
        "self",
        "local_unfinished",
    ]
    assert list(inspect.signature(DPEngineCoreProc.shutdown).parameters) == ["self"]


@pytest.mark.parametrize("balanced", [True, False])
def test_shutdown_reports_the_gate_then_shuts_vllm_down(
    mocker: MockerFixture, tiny_moe_model: Path, balanced: bool
) -> None:
    engine = object.__new__(BalanceDPEngineCoreProc)  # only what shutdown() reads: no engine start-up
    config = make_vllm_config(tiny_moe_model, dp_size=2)
    engine.scheduler = build_scheduler(BalanceScheduler if balanced else Scheduler, config)
    engine.dp_rank, engine.balance_gathers = 1, 7
    vllm_shutdown = mocker.patch.object(DPEngineCoreProc, "shutdown")
    info = mocker.spy(logger, "info")
    engine.shutdown()
    vllm_shutdown.assert_called_once_with()
    stats = [call.args for call in info.call_args_list if call.args[0].startswith("Balance scheduling stats")]
    assert stats == ([(stats[0][0], 1, 0, 7, 0)] if balanced else [])


def test_run_engine_core_is_what_the_launcher_pickles() -> None:
    assert isinstance(inspect.getattr_static(EngineCoreProc, "run_engine_core"), staticmethod)
    assert engine_core_module.DPEngineCoreProc is DPEngineCoreProc


# ---- each check can fail ----------------------------------------------------------------------


def test_detects_the_gather_site_moved_into_a_branch() -> None:
    core = replaced(CORE, f"            {GATHER_CALL}", f"            if executed:\n                {GATHER_CALL}")
    assert any("not a plain statement" in p for p in problems_with(core))


def test_detects_a_second_call_site() -> None:
    core = replaced(
        CORE,
        "            executed = self._process_engine_step()\n",
        "            executed = self._process_engine_step()\n            self._has_global_unfinished_reqs(False)\n",
    )
    assert any("exactly once" in p for p in problems_with(core))


def test_detects_a_skip_that_is_not_the_all_idle_test() -> None:
    core = replaced(CORE, IDLE_SKIP, "if not local_unfinished_reqs:")
    assert any("can skip" in p for p in problems_with(core))


def test_detects_the_gather_site_gone() -> None:
    core = replaced(CORE, GATHER_CALL, "self.engines_running = self._global_sync(")
    assert any("exactly once" in p for p in problems_with(core))


def test_detects_a_call_outside_the_loop() -> None:
    core = replaced(
        CORE,
        "    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:\n",
        "    def other(self):\n        return self._has_global_unfinished_reqs(True)\n\n"
        "    def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:\n",
    )
    assert any("also called outside" in p for p in problems_with(core))


def test_detects_dp_class_bound_locally_in_run_engine_core() -> None:
    core = replaced(
        CORE,
        "            if data_parallel and vllm_config.model_config.is_moe:\n",
        "            from vllm.v1.engine.dp import DPEngineCoreProc\n"
        "            if data_parallel and vllm_config.model_config.is_moe:\n",
    )
    assert any("binds DPEngineCoreProc locally" in p for p in problems_with(core))


def test_detects_dp_class_no_longer_chosen_by_is_moe() -> None:
    core = replaced(CORE, "if data_parallel and vllm_config.model_config.is_moe:", "if data_parallel:")
    assert any("under a test on is_moe" in p for p in problems_with(core))


def test_detects_run_engine_core_no_longer_a_staticmethod() -> None:
    core = replaced(CORE, "    @staticmethod\n    def run_engine_core(", "    @classmethod\n    def run_engine_core(")
    assert any("no longer a staticmethod" in p for p in problems_with(core))


def test_detects_the_launcher_target_changed() -> None:
    launcher = replaced(LAUNCHER, "target=EngineCoreProc.run_engine_core,", "target=run_engine_core_entry,")
    assert any("front-end route is gone" in p for p in problems_with(launcher=launcher))


def test_install_refuses_when_a_seam_moved(balance_on: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.core import balance_seam
    from vllm_ascend_balance import patch_balance_schedule

    monkeypatch.setattr(balance_seam, "engine_seam_problems", lambda: ["DPEngineCoreProc.run_busy_loop is gone"])
    with pytest.raises(RuntimeError, match="no longer offers the seam"):
        patch_balance_schedule.install_engine_route()
    assert EngineCoreProc.run_engine_core is not patch_balance_schedule.run_engine_core


# ---- the Ray DP seam -------------------------------------------------------------------------------------------------

ACTOR_CLASS_LINE = "class DPMoEEngineCoreActor(EngineCoreActorMixin, DPEngineCoreProc):"
LOCAL_ACTOR_IMPORT = "        from vllm.v1.engine.core import DPMoEEngineCoreActor, EngineCoreActor\n"
ACTOR_RUN_CALL = "            self.run_busy_loop()  # type: ignore[attr-defined]"


def ray_problems_with(core: str = CORE, launcher: str = LAUNCHER) -> list[str]:
    return ray_seam_problems(core_source=core, launcher_source=launcher)


def test_installed_vllm_offers_the_ray_dp_seam() -> None:
    assert ray_seam_problems() == []
    # The launcher's first function-local import is CoreEngineActorManager.__init__'s (the scale-up path repeats it;
    # elastic EP is refused with balance on).
    init = inspect.getsource(engine_utils_module.CoreEngineActorManager.__init__)
    assert LOCAL_ACTOR_IMPORT in init and LAUNCHER.count(LOCAL_ACTOR_IMPORT) >= 1


def test_ray_seam_detects_the_actor_import_moved_to_module_level() -> None:
    assert LOCAL_ACTOR_IMPORT in LAUNCHER
    launcher = LOCAL_ACTOR_IMPORT.strip() + "\n" + LAUNCHER.replace(LOCAL_ACTOR_IMPORT, "        pass\n", 1)
    assert any("no longer imports DPMoEEngineCoreActor itself" in p for p in ray_problems_with(launcher=launcher))


def test_ray_seam_detects_the_launcher_gone() -> None:
    launcher = replaced(LAUNCHER, "class CoreEngineActorManager:", "class RayEngineLauncher:")
    assert any("CoreEngineActorManager.__init__ no longer imports" in p for p in ray_problems_with(launcher=launcher))


def test_ray_seam_detects_an_actor_without_the_dp_engine_core_base() -> None:
    core = replaced(CORE, ACTOR_CLASS_LINE, "class DPMoEEngineCoreActor(EngineCoreActorMixin, EngineCoreProc):")
    assert any("no longer runs DPEngineCoreProc.run_busy_loop" in p for p in ray_problems_with(core))


def test_ray_seam_detects_an_actor_with_a_busy_loop_of_its_own() -> None:
    # The actor gains a method of the busy loop's name (an override, written out here as altered source).
    loop_name = "run_busy_loop"
    core = replaced(CORE, ACTOR_CLASS_LINE, f"{ACTOR_CLASS_LINE}\n    def {loop_name}(self):\n        pass\n")
    assert any("no longer runs DPEngineCoreProc.run_busy_loop" in p for p in ray_problems_with(core))


def test_ray_seam_detects_a_run_that_no_longer_calls_the_busy_loop() -> None:
    core = replaced(CORE, ACTOR_CLASS_LINE, ACTOR_CLASS_LINE.replace("Actor(", "Actor(Exception, ", 1))
    assert ray_problems_with(core) == []  # another base, same loop: still sound
    core = replaced(CORE, ACTOR_RUN_CALL, "            self.run_until_idle()")
    assert any("no longer runs DPEngineCoreProc.run_busy_loop" in p for p in ray_problems_with(core))
