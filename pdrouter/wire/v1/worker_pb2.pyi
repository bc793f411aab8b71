from pdrouter.wire.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "model_compat_hash", "cache_salt", "prompt_token_bytes", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    target: _common_pb2.TransferTarget
    model_compat_hash: str
    cache_salt: bytes
    prompt_token_bytes: bytes
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., target: _Optional[_Union[_common_pb2.TransferTarget, _Mapping]] = ..., model_compat_hash: _Optional[str] = ..., cache_salt: _Optional[bytes] = ..., prompt_token_bytes: _Optional[bytes] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "compute_ms", "transfer_ms", "bytes_sent", "blocks_sent")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_SENT_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    compute_ms: float
    transfer_ms: float
    bytes_sent: int
    blocks_sent: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., compute_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., bytes_sent: _Optional[int] = ..., blocks_sent: _Optional[int] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("request_id", "first_token_id", "stats")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    stats: PrefillStats
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., stats: _Optional[_Union[PrefillStats, _Mapping]] = ...) -> None: ...

class ServeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "model_compat_hash", "backend", "local_prefill_tokens", "prefill", "whole", "cache_salt", "prompt_token_bytes", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    model_compat_hash: str
    backend: str
    local_prefill_tokens: int
    prefill: _containers.RepeatedCompositeFieldContainer[PrefillRoute]
    whole: bool
    cache_salt: bytes
    prompt_token_bytes: bytes
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., model_compat_hash: _Optional[str] = ..., backend: _Optional[str] = ..., local_prefill_tokens: _Optional[int] = ..., prefill: _Optional[_Iterable[_Union[PrefillRoute, _Mapping]]] = ..., whole: _Optional[bool] = ..., cache_salt: _Optional[bytes] = ..., prompt_token_bytes: _Optional[bytes] = ..., priority: _Optional[int] = ...) -> None: ...

class PrefillRoute(_message.Message):
    __slots__ = ("worker_id", "address", "lane_address", "cached_tokens")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LANE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    lane_address: str
    cached_tokens: int
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., lane_address: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "max_tokens", "model_compat_hash", "lease_ms", "backend", "sampling", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMPAT_HASH_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    model_compat_hash: str
    lease_ms: int
    backend: str
    sampling: _common_pb2.SamplingParams
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., model_compat_hash: _Optional[str] = ..., lease_ms: _Optional[int] = ..., backend: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("target", "cached_blocks", "num_blocks")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    target: _common_pb2.TransferTarget
    cached_blocks: int
    num_blocks: int
    def __init__(self, target: _Optional[_Union[_common_pb2.TransferTarget, _Mapping]] = ..., cached_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "sampling", "first_token_id", "local_prefill", "prompt_token_ids", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sampling: _common_pb2.SamplingParams
    first_token_id: int
    local_prefill: bool
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: bytes
    def __init__(self, request_id: _Optional[str] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., first_token_id: _Optional[int] = ..., local_prefill: _Optional[bool] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[bytes] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "reason")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released", "freed_blocks")
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    FREED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    released: bool
    freed_blocks: int
    def __init__(self, released: _Optional[bool] = ..., freed_blocks: _Optional[int] = ...) -> None: ...

class WorkerGenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "whole", "cache_salt", "prompt_token_bytes", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    whole: bool
    cache_salt: bytes
    prompt_token_bytes: bytes
    priority: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., whole: _Optional[bool] = ..., cache_salt: _Optional[bytes] = ..., prompt_token_bytes: _Optional[bytes] = ..., priority: _Optional[int] = ...) -> None: ...
