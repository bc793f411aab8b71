"""pd-router's KV connector for vLLM: a prefill engine's paged blocks into the blocks a decode engine reserved.

vLLM loads ``pdrouter.transfer.vllm.connector.PdRouterConnector`` by module path; the worker process
that drives the engine serves its side channel (``pdrouter.transfer.vllm.host.ConnectorHost``)::

    host = ConnectorHost(transfer_config, "kv_consumer", kv_host="0.0.0.0", kv_port=port)
    await host.start()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(..., kv_transfer_config=KVTransferConfig(
        **host.kv_transfer_config())))
    pool = await host.wait_ready(timeout=120)

The hand-off is decode-driven, as with pd-router's own engine: the decode engine reserves the
prompt's blocks (vLLM allocates them for the tokens the connector declares external) and invites
the KV into them; the decode worker hands the targets to a prefill worker, whose engine computes
the prompt and pushes each layer's blocks as its forward pass writes them; the decode engine
resumes from them. ``README.md`` next to this file has the flow, the guarantees and the modules.

Only this package and ``pdrouter.engine.vllm`` import vLLM; this module imports nothing heavy.
"""

from pdrouter.transfer.vllm.orders import PARAMS_KEY, ReceiveOrder, SendOrder, order_from_params

__all__ = ["PARAMS_KEY", "ReceiveOrder", "SendOrder", "order_from_params"]
