from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class ModelGeometry(_message.Message):
    __slots__ = ("name", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size", "max_context", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    INTERMEDIATE_SIZE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    dtype: str
    def __init__(self, name: _Optional[str] = ..., num_layers: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_heads: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., intermediate_size: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...

class KvLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_blocks", "dtype", "compat_hash")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str
    compat_hash: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., num_blocks: _Optional[int] = ..., dtype: _Optional[str] = ..., compat_hash: _Optional[str] = ...) -> None: ...

class TransferTarget(_message.Message):
    __slots__ = ("transfer_id", "worker_id", "address", "epoch", "dst_block_ids", "skip_blocks", "compat_hash", "backend", "layer_start", "layer_end", "sender_epoch", "deadline_unix_ms")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    SENDER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    worker_id: str
    address: str
    epoch: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_blocks: int
    compat_hash: str
    backend: str
    layer_start: int
    layer_end: int
    sender_epoch: int
    deadline_unix_ms: int
    def __init__(self, transfer_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., skip_blocks: _Optional[int] = ..., compat_hash: _Optional[str] = ..., backend: _Optional[str] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., sender_epoch: _Optional[int] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "epoch", "model", "kv_layout", "model_compat_hash", "capacity_blocks", "capacity_tokens", "kv_address", "kv_backends", "lane_address", "device", "engine", "engine_version")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    LANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    epoch: int
    model: ModelGeometry
    kv_layout: KvLayout
    model_compat_hash: str
    capacity_blocks: int
    capacity_tokens: int
    kv_address: str
    kv_backends: _containers.RepeatedScalarFieldContainer[str]
    lane_address: str
    device: str
    engine: str
    engine_version: str
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., epoch: _Optional[int] = ..., model: _Optional[_Union[ModelGeometry, _Mapping]] = ..., kv_layout: _Optional[_Union[KvLayout, _Mapping]] = ..., model_compat_hash: _Optional[str] = ..., capacity_blocks: _Optional[int] = ..., capacity_tokens: _Optional[int] = ..., kv_address: _Optional[str] = ..., kv_backends: _Optional[_Iterable[str]] = ..., lane_address: _Optional[str] = ..., device: _Optional[str] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ...) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "queued_prefill_tokens", "free_blocks", "total_blocks", "allocated_blocks", "engine_failed", "prefix_cache_queries", "prefix_cache_hits", "queued_prefill_tokens_by_priority")
    class QueuedPrefillTokensByPriorityEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ALLOCATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FAILED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_BY_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    allocated_blocks: int
    engine_failed: bool
    prefix_cache_queries: int
    prefix_cache_hits: int
    queued_prefill_tokens_by_priority: _containers.ScalarMap[int, int]
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., queued_prefill_tokens: _Optional[int] = ..., free_blocks: _Optional[int] = ..., total_blocks: _Optional[int] = ..., allocated_blocks: _Optional[int] = ..., engine_failed: _Optional[bool] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., queued_prefill_tokens_by_priority: _Optional[_Mapping[int, int]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("request_id", "token_ids", "finish_reason", "usage", "prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    usage: Usage
    prefill: PrefillReport
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., prefill: _Optional[_Union[PrefillReport, _Mapping]] = ...) -> None: ...

class PrefillReport(_message.Message):
    __slots__ = ("worker_id", "local", "prompt_tokens", "cached_tokens", "decode_cached_tokens", "compute_ms", "transfer_ms", "bytes_sent", "failures")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    local: bool
    prompt_tokens: int
    cached_tokens: int
    decode_cached_tokens: int
    compute_ms: float
    transfer_ms: float
    bytes_sent: int
    failures: _containers.RepeatedCompositeFieldContainer[PrefillFailure]
    def __init__(self, worker_id: _Optional[str] = ..., local: _Optional[bool] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., decode_cached_tokens: _Optional[int] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., failures: _Optional[_Iterable[_Union[PrefillFailure, _Mapping]]] = ...) -> None: ...

class PrefillFailure(_message.Message):
    __slots__ = ("worker_id", "code", "message")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    code: str
    message: str
    def __init__(self, worker_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...
