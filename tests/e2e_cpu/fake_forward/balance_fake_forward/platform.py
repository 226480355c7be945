"""vLLM's CPU platform with the model forward replaced by :class:`FakeForwardWorker`.

vLLM's CUDA wheel (the one this project installs) detects no platform on a CPU-only machine, so
an out-of-tree platform plugin selects one. Everything but the worker is vLLM's ``CpuPlatform``
(gloo as distributed backend, CPU device); three choices differ, each so that the engine cores
run the way they run on an accelerator:

* the worker is the fake one (no model is built, nothing is loaded from disk but the tokenizer);
* the worker runs inside the engine-core process (``uni`` executor: the engine has one worker,
  TP = PP = 1), so a DP=2 server is the API server, the DP coordinator and two engine cores;
* asynchronous scheduling keeps vLLM's own decision (``CpuPlatform`` turns it off because CPU
  kernels gain nothing from it; vLLM's default elsewhere, and on Ascend, is on).

For Ray DP (``--data-parallel-backend ray``) the Ray resource a rank's devices are counted in is
``CPU`` (vLLM's ``CpuPlatform`` names none, so its launcher would find no device in the cluster).
"""

from __future__ import annotations

from typing import Any

from vllm.platforms.cpu import CpuPlatform

WORKER_QUALNAME = "balance_fake_forward.worker.FakeForwardWorker"


class FakeForwardPlatform(CpuPlatform):
    ray_device_key = "CPU"

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        async_scheduling = vllm_config.scheduler_config.async_scheduling
        super().check_and_update_config(vllm_config)
        vllm_config.scheduler_config.async_scheduling = async_scheduling
        parallel_config = vllm_config.parallel_config
        parallel_config.worker_cls = WORKER_QUALNAME
        if parallel_config.world_size == 1:
            parallel_config.distributed_executor_backend = "uni"
