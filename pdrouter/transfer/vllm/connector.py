"""``PdRouterConnector``: vLLM's KV connector over pd-router's transfer layer, as vLLM loads it.

vLLM builds one instance per role from ``kv_transfer_config`` (``kv_connector`` =
``PdRouterConnector``, ``kv_connector_module_path`` = this module): one in its scheduler (engine-core
process), one in each worker process. The class only forwards vLLM's calls to the object of its
role, ``SchedulerSide`` or ``WorkerSide``, which know nothing of each other and speak through the
step's ``StepPlan`` (scheduler → workers) and the transfer results (workers → scheduler).
``kv_connector_extra_config["channel"]`` names the side channel the worker process serves
(``pdrouter.transfer.vllm.host.ConnectorHost.kv_transfer_config`` writes the whole configuration).

Supported: decoder models with one full-attention KV cache group, any tensor-parallel size (rank
r of the prefill engine sends to rank r of the decode engine), no pipeline parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from pdrouter.core.errors import ConfigError
from pdrouter.transfer.vllm.paged_pool import PagedKvLayout
from pdrouter.transfer.vllm.scheduler_side import SchedulerSide
from pdrouter.transfer.vllm.step_plan import StepPlan
from pdrouter.transfer.vllm.worker_side import WorkerSide, WorkerSideConfig

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

CONNECTOR_NAME = "PdRouterConnector"
MODULE_PATH = __name__


class PdRouterConnector(KVConnectorBase_V1):
    """Moves a request's paged KV from a vLLM prefill engine into the blocks a vLLM decode engine reserved."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ConfigError("the pd-router KV connector does not support pipeline parallelism")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ConfigError(f"the pd-router KV connector moves one full-attention KV cache group; this model has "
                              f"{len(kv_cache_config.kv_cache_groups)}")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config.cache_config.block_size)
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        extra = self._kv_transfer_config.kv_connector_extra_config
        channel = extra.get("channel")
        if not channel:
            raise ConfigError("kv_connector_extra_config['channel'] is missing: the pd-router worker process "
                              "writes it (ConnectorHost.kv_transfer_config)")
        self._worker = WorkerSide(WorkerSideConfig(
            channel=str(channel), kv_role=str(self._kv_transfer_config.kv_role),
            rank=get_tensor_model_parallel_rank(), world_size=parallel.tensor_parallel_size,
            connect_timeout_s=float(extra.get("connect_timeout_s", 60.0)),
            decision_s=float(extra.get("decision_s", 10.0))))

    # -- scheduler side -------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        manager = self._kv_cache_manager
        assert manager is not None
        plan = self._scheduler.build(scheduler_output.num_scheduled_tokens,
                                     lambda req_id: manager.get_block_ids(req_id)[0])
        return cast("KVConnectorMetadata", plan)  # vLLM hands it to the workers untouched

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.transfers_reported(connector_output.finished_recving or ())

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.finished(request), None

    # -- worker side ----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        from vllm.model_executor.models.utils import extract_layer_index
        from vllm.platforms import current_platform

        names: list[str] = []
        seen: set[tuple[int, int]] = set()
        for name in sorted(kv_caches, key=extract_layer_index):
            view = kv_caches[name]
            where = (view.untyped_storage().data_ptr(), int(view.storage_offset()))
            if where not in seen:  # a layer reusing another layer's cache moves with that layer
                seen.add(where)
                names.append(name)
        views = [kv_caches[name] for name in names]
        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        if not isinstance(spec, AttentionSpec):
            raise ConfigError(f"the pd-router KV connector moves attention KV caches, not {type(spec).__name__}")
        cache_layout = getattr(self._vllm_config.cache_config, "get_resolved_kv_cache_layout", None)
        arrangement = (f"{current_platform.device_type}|{cache_layout().name if cache_layout else 'default'}|"
                       f"page={tuple(views[0].shape[1:])}|strides={tuple(views[0].stride()[1:])}")
        layout = PagedKvLayout(num_layers=len(views), num_kv_heads=int(spec.num_kv_heads),
                               head_dim=int(spec.head_size), block_size=int(spec.block_size),
                               num_blocks=int(self._kv_cache_config.num_blocks), dtype=str(spec.dtype),
                               arrangement=arrangement)
        self._worker.register(names, views, layout)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, StepPlan):
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing: received KV lands while the request waits, before it is scheduled."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a request runs only once all of its KV landed."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.step_done()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self._worker is not None
        report = self._worker.results(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=report.finished_sending,
                                          finished_recving=report.finished_recving,
                                          failed_recving=report.failed_recving)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # save_kv_layer runs between the layers
