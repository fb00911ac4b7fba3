"""How far live ingest is thinned under load: one object the server's load governor writes
and every live session's stages read (all on the event loop)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Degradation:
    """Live sessions sample `fps × fps_scale` frames a second and stretch the costly
    detectors' intervals by `1 / fps_scale`; `reason` says why (empty when not degraded)."""

    fps_scale: float = 1.0
    reason: str = ""

    @property
    def degraded(self) -> bool:
        return self.fps_scale < 1.0
