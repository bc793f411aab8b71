"""pd-router: a router for prefill/decode-disaggregated LLM serving.

One import root in layers; a layer imports only the layers below it (``pyproject.toml`` holds the
import-linter contract that CI runs):

* ``core``: vocabulary (geometry, GPU specs, capacity math, block hashing, tokenizers, ids, errors);
  imports no torch, grpc or redis;
* ``state``: Redis-backed shared state (registry, prefix index, KV reservations);
* ``engine``: the torch engine; ``transfer``: KV blocks prefill → decode (TCP, torch.distributed);
* ``wire``: generated stubs, protobuf ⇄ dataclass conversion, gRPC plumbing, the worker lane;
* ``worker``: the worker process and its roles (prefill, decode, colocated);
* ``router``: front doors, placement, admission, the request flow;
* ``cli``: the ``pdrouter`` command and local clusters;
* ``testing``: fakes shared by tests, benchmarks and users (an echo model with fault directives).
"""
