"""vLLM as a worker's engine (``--backend vllm``): its async engine client behind the worker's engine contract.

* ``config``: ``VllmEngineConfig``, the worker's settings and the pass-through engine arguments
  (imports no vLLM: the worker's configuration is built, and refused, before vLLM is imported);
* ``imports``: importing vLLM, or one line saying what to install or remove;
* ``engine``: ``VllmEngine`` (start, generate, abort, load, health, close);
* ``stats``: vLLM's scheduler statistics as the worker's load;
* ``events`` / ``subscriber``: vLLM's KV events (ZMQ, either encoding) → the project's block hashes
  → the prefix index.

Only this package (and ``pdrouter.transfer.vllm``, a KV connector) imports ``vllm``: an import-linter
contract in ``pyproject.toml`` holds the rest of the project to it, so the core install never needs
vLLM. See README.md here for the seams a KV connector builds on, and docs/vllm.md for running it.
"""
