"""The front-door router: placement, admission, PD orchestration, OpenAI HTTP and gRPC front doors."""
