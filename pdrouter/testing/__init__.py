"""Fakes and harness pieces shared by tests, benchmarks and users, behind the same contracts as the real parts.

* :mod:`pdrouter.testing.echo`: an in-process model for the router's front doors (the
  ``Dispatcher`` protocol) that echoes the prompt back and obeys fault directives, so a door can
  be exercised without workers, the way httpx's ``MockTransport`` stands in for a network;
* :mod:`pdrouter.testing.http`: the router's own HTTP server for such a door, on a free port;
* :mod:`pdrouter.testing.pki`: a throwaway certificate authority (``trustme``) and certificates
  as PEM files, for TLS and mutual TLS;
* :mod:`pdrouter.testing.redis_cluster`: a Redis Cluster of child processes on loopback that can
  lose a master or fail one over, for the tests and benchmarks of the cluster layout;
* :mod:`pdrouter.testing.leak_audit`: what dead worker incarnations left in Redis (bookings,
  prefix-index entries) and on the live workers, counted through the state's own readers;
* :mod:`pdrouter.testing.load`: ``pdrouter.bench.runner``'s closed loop on a router, every answer
  classified (a completion, a clean error, hung or broken).
"""
