"""Decode worker: owns a KV block pool, receives KV, decodes with continuous batching."""
