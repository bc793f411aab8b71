"""pd-router command line and generated gRPC contracts (``pdrouter.v1``)."""
