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
"""Short request first with balance scheduling, sync and async (what the copied BalanceScheduler's
``__init__`` used to provide): platform.py chooses ``ShortRequestFirstScheduler`` or
``ShortRequestFirstAsyncScheduler``, the SRF waiting queue is installed, and the balance gate gates it.

Exported by the vllm-ascend main patch series only (the sync class is added by that series).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from offline_vllm import build_scheduler, emulate_gather, make_request, make_vllm_config, torch_npu_stubbed_for_import

from vllm_ascend.core.balance_scheduler import balance_scheduler_class

CAP = 4
SRF_ON = {"scheduler_config": {"short_request_first_config": {"enabled": True}}}


def _ascend(module: str) -> Any:
    with torch_npu_stubbed_for_import():  # imported by vllm_ascend.utils, unused by what is tested here
        importlib.import_module("vllm_ascend.utils")
        return importlib.import_module(module)


@pytest.fixture
def ascend_config() -> Iterator[Any]:
    module = _ascend("vllm_ascend.ascend_config")
    module.clear_ascend_config()
    yield module
    module.clear_ascend_config()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_platform_chooses_a_short_request_first_class(
    ascend_config: Any, tiny_model: Path, async_scheduling: bool
) -> None:
    platform = _ascend("vllm_ascend.platform")
    config = make_vllm_config(tiny_model, async_scheduling=async_scheduling, additional_config=SRF_ON)
    platform._check_ascend_config(config, ascend_config.init_ascend_config(config))
    name = "ShortRequestFirstAsyncScheduler" if async_scheduling else "ShortRequestFirstScheduler"
    assert config.scheduler_config.scheduler_cls == f"vllm_ascend.core.short_request_first_scheduler.{name}"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_balanced_short_request_first_keeps_its_queue_and_is_gated(
    balance_on: None, ascend_config: Any, tiny_model: Path, async_scheduling: bool
) -> None:
    srf = _ascend("vllm_ascend.core.short_request_first_scheduler")
    base = srf.ShortRequestFirstAsyncScheduler if async_scheduling else srf.ShortRequestFirstScheduler
    config = make_vllm_config(
        tiny_model, max_num_seqs=CAP, dp_size=2, async_scheduling=async_scheduling, additional_config=SRF_ON
    )
    scheduler = build_scheduler(balance_scheduler_class(base), config)
    assert isinstance(scheduler.waiting, srf.ShortRequestFirstRequestQueue)
    scheduler.add_request(make_request("new"))
    emulate_gather([scheduler], [CAP, 0])
    assert scheduler.schedule().scheduled_new_reqs == []
    emulate_gather([scheduler], [0, 0])
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["new"]
