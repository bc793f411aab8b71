"""Runtime shared by the prefill, decode and colocated workers.

Config, presence in Redis, protobuf conversion and the engine driver.
"""
