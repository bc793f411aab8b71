"""Shared vocabulary of pd-router: model geometry, GPU specs, capacity math, block hashing,
tokenizers, token streams, ids, errors, asyncio helpers.

This package imports no torch, grpc or redis (a test enforces it), so the router, the workers, the
CLI and the benchmarks can all depend on it cheaply.
"""
