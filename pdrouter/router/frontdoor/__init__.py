"""The router's front doors: the OpenAI HTTP API and the ``pdrouter.v1.Router`` gRPC service."""
