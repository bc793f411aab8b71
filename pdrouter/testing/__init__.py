"""Fakes shared by tests, benchmarks and users, behind the same contracts as the real parts.

:mod:`pdrouter.testing.echo` is an in-process model for the router's front doors (the
``Orchestrator`` protocol): it echoes the prompt back and obeys fault directives, so a door can be
exercised without workers, the way httpx's ``MockTransport`` stands in for a network.
"""
