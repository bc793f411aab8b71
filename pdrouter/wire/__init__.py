"""The wire layer: generated stubs (``v1``), protobuf ⇄ dataclass conversion, gRPC plumbing, the worker lane.

Protobuf types stop here and at the servicers of the worker roles and the router's front doors.
"""
