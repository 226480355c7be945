"""Packaging for the balance-scheduling patch set, installed beside vllm-ascend.

The repository mirrors vllm-ascend's paths (fork-style) so the same files become the upstream patch
series. Installed with pip it must not overwrite any file of the vllm-ascend distribution, so
``vllm_ascend/core/balance_*.py`` are added to vllm-ascend's ``vllm_ascend.core`` package (new files; no
``__init__.py`` of vllm-ascend's is shipped or replaced), and ``vllm_ascend/patch/platform/``, whose
``patch_balance_schedule.py`` would replace vllm-ascend's own module there, is installed as the package
``vllm_ascend_balance``. The ``vllm.general_plugins`` entry point is its ``patch_balance_coexist.register``,
which vLLM calls in every process before it resolves the scheduler class; the ``vllm.stat_logger_plugins`` entry
point (same name) is the gate's metrics logger, ``vllm_ascend.core.balance_metrics``. Uninstalling removes all of it.
"""

from setuptools import setup

setup(
    name="vllm-ascend-balance-scheduling",
    version="0.1.0",
    description="Zero-copy balance scheduling for vllm-ascend data-parallel serving (a vLLM plugin)",
    python_requires=">=3.10",
    # vllm and vllm-ascend are deliberately not declared: their metadata pins CUDA / NPU builds of
    # torch, and users install this beside an existing vllm-ascend environment.
    install_requires=[],
    packages=["vllm_ascend.core", "vllm_ascend_balance"],
    package_dir={"vllm_ascend_balance": "vllm_ascend/patch/platform"},
    entry_points={
        "vllm.general_plugins": [
            "ascend_balance_scheduling = vllm_ascend_balance.patch_balance_coexist:register",
        ],
        # The gate on /metrics; the same name, so a VLLM_PLUGINS that admits the plugin admits its metrics too.
        "vllm.stat_logger_plugins": [
            "ascend_balance_scheduling = vllm_ascend.core.balance_metrics:BalanceStatLogger",
        ],
    },
)
