"""``shardspeed-serve`` with faults injected, for the lifecycle tests (run as a script, not collected).

Requests carry the trigger in their ``seed`` (an ordinary field, so the fault hits one chosen request):
  * seed 4242: that request's decode step raises once it has 3 tokens (the batched step fails; each request
    is retried alone, and only this one fails again);
  * seed 4343: the generation loop itself raises (a bug outside any one request): the server must answer
    the pending request, report "failed" and exit 1;
  * seed 4444: every decode step with that request in the batch takes 0.2 s longer (a request that cannot
    finish within a short shutdown drain, whatever the machine's speed).
"""

from __future__ import annotations

import sys
import time

from shardspeed.inference.scheduler import ContinuousBatcher
from shardspeed.mii.server import main

DECODE_FAULT, LOOP_FAULT, SLOW = 4242, 4343, 4444

_forward_decode = ContinuousBatcher._forward_decode
_step = ContinuousBatcher.step


def faulty_forward_decode(self, batch):
    if any(r.seed == DECODE_FAULT and len(r.generated) >= 3 for r in batch):
        raise RuntimeError("injected decode fault")
    if any(r.seed == SLOW for r in batch):
        time.sleep(0.2)
    return _forward_decode(self, batch)


def faulty_step(self):
    if any(r.seed == LOOP_FAULT for r in list(self.waiting) + self.running):
        raise RuntimeError("injected generation-loop fault")
    return _step(self)


ContinuousBatcher._forward_decode = faulty_forward_decode
ContinuousBatcher.step = faulty_step

if __name__ == "__main__":
    sys.exit(main())
