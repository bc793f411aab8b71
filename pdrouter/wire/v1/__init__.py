"""Generated gRPC stubs for the ``pdrouter.v1`` protobuf package (``tools/gen_proto.py``; do not edit)."""
