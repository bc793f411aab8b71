"""The simulated GPU: the shared batching engine with the model step replaced by a roofline timing model.

* ``timing``: the step's FLOPs and bytes → modeled seconds (a pure function of the batch);
* ``calibration``: MFU, MBU and overheads, with cited defaults and a validated file format;
* ``link``: KV-transfer links (NVLink, RDMA, TCP presets) and a shared link's queue;
* ``config``: one simulated worker's frozen configuration (model, GPU, TP, pool, time scale);
* ``model_step`` / ``engine``: the model step that sleeps the modeled time and emits pseudo-random
  tokens, and ``SimEngine`` built on ``pdrouter.engine.batch_engine``.

Nothing here imports torch: dozens of simulated workers fit on one machine.
"""
