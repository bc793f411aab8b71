"""Which pool a KV transport moves, and whether its backend can move it.

Separate from ``pool_bytes`` (which ``pool_view`` builds on) so that neither of those imports the
other: ``open_pool`` and ``check_backend`` need both, and load ``pool_view`` (torch) only for a
tensor pool or a torch.distributed backend.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdrouter.core.errors import ConfigError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer.config import Backend
from pdrouter.transfer.pool_bytes import PoolBytes

if TYPE_CHECKING:
    import torch


def open_pool(pool: PoolBytes | torch.Tensor, layout: KvLayout) -> PoolBytes:
    """``pool`` itself (its layout must be ``layout``), or a ``PoolView`` of a tensor."""
    if isinstance(pool, PoolBytes):
        if pool.layout != layout:
            raise ConfigError(f"the pool's layout {pool.layout} is not {layout}")
        return pool
    from pdrouter.transfer.pool_view import PoolView  # torch: only for a tensor pool

    return PoolView(pool, layout)


def check_backend(backend: Backend, view: PoolBytes) -> None:
    """ConfigError when ``backend`` cannot move this pool's memory."""
    if backend is Backend.NCCL and not view.is_cuda:
        raise ConfigError("the NCCL backend needs the KV pool on a CUDA device")
    if backend in (Backend.TCP, Backend.GLOO) and view.is_cuda:
        raise ConfigError(f"the {backend.value} backend needs a CPU KV pool; use nccl for a CUDA pool")
    if backend.is_distributed:
        from pdrouter.transfer.pool_view import PoolView

        if not isinstance(view, PoolView):
            raise ConfigError(f"the {backend.value} backend moves tensors; this pool is a byte buffer (use tcp)")
    if backend is Backend.NCCL:
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise ConfigError("this torch build has no NCCL")
