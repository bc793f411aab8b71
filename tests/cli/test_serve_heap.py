"""Long-lived processes freeze their start-up heap (``pdrouter.cli.serve.freeze_startup_heap``) and
space their young collections (``space_young_collections``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

from pdrouter.cli.serve import YOUNG_COLLECTION_THRESHOLD

CHILD = textwrap.dedent("""
    import gc
    from pdrouter.cli.serve import serve_until_signal

    class Service:
        async def start(self):
            self.model = [[i] for i in range(50_000)]  # what start-up builds and keeps
        async def stop(self):
            print("stopped", gc.get_freeze_count() >= 50_000, gc.get_threshold()[0], flush=True)

    serve_until_signal(Service(), lambda: f"ready {gc.get_freeze_count()}")
""")


def test_what_start_up_built_is_frozen_before_the_ready_line() -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    ready = child.stdout.readline().split()
    assert ready[0] == "ready" and int(ready[1]) >= 50_000  # the service's objects and every module's
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=30)
    assert out.strip() == f"stopped True {YOUNG_COLLECTION_THRESHOLD}" and child.returncode == 0
