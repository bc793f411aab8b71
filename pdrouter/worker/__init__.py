"""The worker process shared by the prefill, decode and colocated workers, and its ``roles``.

``process`` (engine, driver, gRPC server and lane, presence in Redis, shutdown) takes a role
(``role``: what a role is given and gives back; ``roles``: the three of them).
"""
