"""The simulated vLLM replica: vLLM v1's scheduler and paged KV on a roofline cost model.

* ``engine.SimEngine`` -- one replica's engine on any clock (``presets`` name the hardware);
* ``virtual.VirtualCluster`` -- N replicas in one process on a discrete-event clock;
* ``server`` -- the HTTP server behind ``tidal sim`` (vLLM's OpenAI API and ``/metrics``);
* ``calibrate`` -- the published points the cost model is checked against.
"""

from tidal.replicas.sim.engine import EngineConfig, SimEngine
from tidal.replicas.sim.presets import PRESETS, Preset, get_preset
from tidal.replicas.sim.virtual import SimRequest, SimResult, VirtualCluster

__all__ = [
    "PRESETS",
    "EngineConfig",
    "Preset",
    "SimEngine",
    "SimRequest",
    "SimResult",
    "VirtualCluster",
    "get_preset",
]
