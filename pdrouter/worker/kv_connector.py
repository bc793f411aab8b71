"""A prefill or decode worker that runs vLLM: the KV connector's side channel, served before the engine starts.

vLLM moves a request's KV between a prefill and a decode engine inside itself, through pd-router's
KV connector (``pdrouter.transfer.vllm``), whose worker side runs in vLLM's worker processes and
dials this worker process while vLLM starts. So the process serves the connector's side channel
first (a ``ConnectorHost`` with this incarnation's transfer identity: the shared KV token, the
epoch, the backend, TLS, the KV port), then starts vLLM with the ``kv_transfer_config`` naming it,
then waits for the connector's ranks. The roles then move KV through the host
(``pdrouter.worker.roles.prefill_connector``, ``decode_connector``), not through a transport of
their own.
"""

from __future__ import annotations

import dataclasses
import logging

from pdrouter.core.errors import ConfigError
from pdrouter.core.ids import Epoch
from pdrouter.core.workers import WorkerRole
from pdrouter.engine.vllm.config import VllmEngineConfig
from pdrouter.transfer.config import Backend, TransferConfig, describe_tcp_congestion
from pdrouter.transfer.vllm.host import ConnectorHost
from pdrouter.worker.config import WorkerConfig

log = logging.getLogger(__name__)

READY_S = 60.0
"""How long the connector's ranks may take to report once vLLM started (they dial while it starts)."""
KV_ROLES = {WorkerRole.PREFILL: "kv_producer", WorkerRole.DECODE: "kv_consumer"}


async def start_connector(config: WorkerConfig, epoch: Epoch) -> ConnectorHost | None:
    """The side channel of a vLLM prefill or decode worker's connector, serving; None for any other worker.

    ConfigError (one line, before vLLM starts) for what the connector cannot do: no KV token, or a
    tensor-parallel engine (a prefill call names one KV target: rank 0's).
    """
    engine = config.engine
    if not isinstance(engine, VllmEngineConfig) or config.role not in KV_ROLES:
        return None
    if engine.tensor_parallel_size != 1:
        raise ConfigError(f"a vLLM {config.role.value} worker moves its KV with --tp 1 (a prefill call carries one "
                          f"KV target); got --tp {engine.tensor_parallel_size}")
    transfer = TransferConfig(auth_token=config.kv_auth_token, epoch=epoch, backend=Backend(config.kv_backend),
                              tls=config.tls, tcp_congestion=config.kv_tcp_congestion)
    log.info("%s", describe_tcp_congestion(config.kv_tcp_congestion))
    host = ConnectorHost(transfer, KV_ROLES[config.role], kv_host=config.host, kv_advertise_host=config.public_host,
                         kv_port=config.kv_port)
    await host.start()
    return host


def engine_with_connector(engine: VllmEngineConfig, host: ConnectorHost) -> VllmEngineConfig:
    """``engine`` configured with pd-router's KV connector dialling ``host``."""
    if engine.kv_transfer_config is not None or "kv_transfer_config" in engine.passed:
        raise ConfigError("a vLLM prefill or decode worker configures vLLM's KV connector itself; drop "
                          "--vllm-arg kv_transfer_config")
    return dataclasses.replace(engine, kv_transfer_config=host.kv_transfer_config())
