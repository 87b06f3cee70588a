"""Push-mode KV transfer between a prefill and a decode engine rank.

The package owns the request life cycle on both sides and the engine-thread API
(`request_receive`, `request_send`, `get_finished`, `abandon`):

- `lifecycle`: the phases of a request on each side and the tables that move them;
- `core`: what both halves share (configuration, outcome queues, notifications, peer health,
  the progress thread) and `new_connector`, which builds the half a role needs;
- `decode`: registrations out, completions in, giving requests up;
- `prefill`: registrations and cancels in, WRITEs and answers out.

Every request taken ends exactly once, done or failed with a reason; once the decode has let a
request go, nothing of it lands; every notification counts only from the exact peer process
(agent) it concerns. Called by the emulated engine (`emulated`), the vLLM connector and the
benchmarks; uses `registry`, a `KVTransport` and `WorkerMetrics`.
"""

from kvtopo_worker.push.core import (
    FailedRequest,
    Finished,
    PushConfig,
    PushConnector,
    new_connector,
)

__all__ = ["FailedRequest", "Finished", "PushConfig", "PushConnector", "new_connector"]
