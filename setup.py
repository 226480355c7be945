"""Packaging for the balance-scheduling patch set, installed beside vllm-ascend.

The repository mirrors vllm-ascend's paths (fork-style) so the same files become the upstream
patch series. Installed with pip it must not overwrite any file owned by the vllm-ascend
distribution, so:

* ``vllm_ascend/core/balance_scheduler.py`` is added to the ``vllm_ascend.core`` package (a new
  file there; this repository ships no ``__init__.py`` of vllm-ascend's, so none is replaced);
* the wiring module, which at vllm-ascend's path would replace vllm-ascend's own
  ``patch_balance_schedule.py``, is installed as ``vllm_ascend_balance.patch_balance_schedule``
  and registered as a ``vllm.general_plugins`` entry point, which vLLM loads in every process
  before it resolves the scheduler class. Uninstalling removes both, restoring stock behaviour.
"""

from setuptools import setup

setup(
    name="vllm-ascend-balance-scheduling",
    version="0.1.0",
    description="Zero-copy balance scheduling for vllm-ascend data-parallel serving",
    python_requires=">=3.10",
    # vllm and vllm-ascend are deliberately not declared: their metadata pins CUDA / NPU builds
    # of torch, and users install this beside an existing vllm-ascend environment.
    install_requires=[],
    packages=["vllm_ascend.core", "vllm_ascend_balance"],
    package_dir={"vllm_ascend_balance": "vllm_ascend/patch/platform"},
    entry_points={
        "vllm.general_plugins": [
            "ascend_balance_scheduling = vllm_ascend_balance.patch_balance_schedule:register",
        ],
    },
)
