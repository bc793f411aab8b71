"""The worker lane: the router's hot path to its workers, the same protobuf messages with less machinery.

Every worker serves its RPCs over gRPC (the contract, used by every other client) and, by default,
over this lane too: one persistent TCP connection per router and worker, carrying many concurrent
calls as length-prefixed frames. A call is the gRPC method's request message; the answer is the
method's response message(s) and a final status with a ``grpc.StatusCode``, so both ends keep the
gRPC semantics (status codes, deadlines, cancellation) and the servicers serve both unchanged.

Why: on a small CPU budget a ``grpc.aio`` streaming call costs the caller about 600 µs of CPU,
a lane call a few tens of µs (``benchmarks/router_overhead.py`` shows the end-to-end effect).

The contract:

* a frame is a 16-byte header (body length, stream id, kind, arg, reserved, timeout in ms) and a
  body of at most ``MAX_BODY`` bytes, after an 8-byte greeting that both ends must agree on (and,
  when the worker holds a token, the proof of it). A call
  is one stream id: a ``CALL`` (method id, deadline, serialized request), then ``MESSAGE`` frames
  (one per response of a streaming method) and one ``END`` (status code; the unary response, or the
  status details), optionally preceded by a ``META`` frame with the call's metadata (the W3C trace
  context). ``frames`` holds the format;
* errors are statuses: a handler's failure ends its call with the status a gRPC server would send
  (``LaneContext.abort``'s, a ``PdRouterError``'s gRPC code, else UNKNOWN; UNIMPLEMENTED for a
  method not served, INVALID_ARGUMENT for a request that does not parse, UNAVAILABLE from a worker
  that is stopping), and the caller gets it as a ``LaneError``, a ``grpc.RpcError`` with
  ``code()`` and ``details()``;
* a deadline travels with its call: the worker ends the handler with DEADLINE_EXCEEDED when it
  passes, and the caller gives up one second later if the worker has not answered; a call made with
  no time left fails with DEADLINE_EXCEEDED at once;
* cancelling a call (``cancel()``, or cancelling the task that awaits it) sends ``CANCEL`` and the
  worker cancels the handler; using a call cancelled here raises ``asyncio.CancelledError``, as
  with grpc.aio;
* a lost connection fails every open call with UNAVAILABLE on the client and cancels every handler
  on the server (what gRPC does when a peer goes away);
* a worker given a token serves a connection only once it has proved the token (a mutual
  challenge-response at connection start, the worker first, bound to the address it answers at, so
  a client sends nothing to a server that cannot prove it or answers as another address); one given
  an ``ssl`` context speaks TLS only (mutual TLS when the context requires client certificates). A
  refused connection fails its calls with the worker's reason: UNAUTHENTICATED for a missing or
  wrong token;
* every connection is held to the worker's ``LaneLimits``: a handshake deadline, a deadline for
  each begun frame that trickling cannot move, a cap on its buffered bytes (a few KiB before the
  proof), a cap on connections and a smaller budget for those not yet proved (``docs/limits.md``).

Modules: ``frames`` (the format and vocabulary, shared by both ends), ``limits`` (``LaneLimits``),
``server`` (the worker end: ``LaneServer``, ``serve_servicer``), ``client`` (the router's end:
``LaneChannel``, its calls, the typed stubs, ``request_stubs``). ``server`` and ``client`` import
``frames`` and not each other.
"""

from pdrouter.wire.lane.client import (
    ColocatedLane,
    DecodeLane,
    LaneChannel,
    LaneError,
    PrefillLane,
    StreamCall,
    UnaryCall,
    request_stubs,
)
from pdrouter.wire.lane.frames import (
    ALLOCATE,
    AUTH,
    CALL,
    CANCEL,
    COLOCATED,
    DECODE,
    END,
    HEADER,
    HELLO,
    MAGIC,
    MAX_BODY,
    MESSAGE,
    META,
    METHODS,
    PREFILL,
    RELEASE,
    SERVE,
    VERSION,
    LaneMethod,
    client_proof,
    server_proof,
)
from pdrouter.wire.lane.limits import LaneLimits
from pdrouter.wire.lane.server import Handler, LaneAbort, LaneContext, LaneServer, serve_servicer

__all__ = [
    "ALLOCATE",
    "AUTH",
    "CALL",
    "CANCEL",
    "COLOCATED",
    "DECODE",
    "END",
    "HEADER",
    "HELLO",
    "MAGIC",
    "MAX_BODY",
    "MESSAGE",
    "META",
    "METHODS",
    "PREFILL",
    "RELEASE",
    "SERVE",
    "VERSION",
    "ColocatedLane",
    "DecodeLane",
    "Handler",
    "LaneAbort",
    "LaneChannel",
    "LaneContext",
    "LaneError",
    "LaneLimits",
    "LaneMethod",
    "LaneServer",
    "PrefillLane",
    "StreamCall",
    "UnaryCall",
    "client_proof",
    "request_stubs",
    "serve_servicer",
    "server_proof",
]
