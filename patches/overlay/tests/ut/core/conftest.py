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
"""Fixtures of the balance-scheduling unit tests, for vllm-ascend's tests/ut/core.

Exported by the patch series only; the fixtures themselves are balance_fixtures.py (shared with
this repository's own tests/ut/conftest.py, which adds project-only checks).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.pop("VLLM_ASCEND_BALANCE_SCHEDULING", None)
# offline_vllm.py and balance_fixtures.py sit beside this file; not every import mode puts this
# directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from balance_fixtures import (  # noqa: E402,F401
    balance_env_unset,
    balance_off,
    balance_on,
    tiny_model,
    tiny_moe_model,
    vllm_restored,
)
