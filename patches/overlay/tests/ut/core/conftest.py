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
