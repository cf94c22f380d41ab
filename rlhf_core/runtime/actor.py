"""What every Ray actor of this project has, whichever package owns it (training's TrainWorker,
rollout's rollout / reward / reference workers)."""
from __future__ import annotations

import resource


class PeakMemory:
    """Every actor reports its process's peak resident memory (the burst check and rl metrics)."""

    def peak_rss_mb(self) -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
