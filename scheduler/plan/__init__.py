"""Capacity planning: ``tidal plan`` and ``tidal plan compare``.

* :mod:`~scheduler.plan.catalog` -- models, GPUs and prices as data (``catalog.yaml``,
  ``prices.yaml``), turned into the simulator's presets;
* :mod:`~scheduler.plan.workload` -- the workload: a trace, the built-in synthetic one, or a
  profile file; rate scaling, context caps, the long-context split, the weekly load;
* :mod:`~scheduler.plan.capacity` -- KV and batch arithmetic, and requests/s per replica within
  the SLO measured on the simulated replica (:func:`measured_capacity`);
* :mod:`~scheduler.plan.model` -- the fleet model that predicts TTFT/TPOT percentiles;
* :mod:`~scheduler.plan.replay` -- virtual-time replays that check it;
* :mod:`~scheduler.plan.planner` -- the plan; :mod:`~scheduler.plan.report` -- text and HTML;
* :mod:`~scheduler.plan.compare` -- quantisation decided by an eval run.

It lives in ``scheduler`` because the autoscaler consumes its capacity, and the layering lets
the scheduler use ``replicas.sim`` (the simulator) and ``batch_jobs`` (the eval job kind).
"""

from tidal.scheduler.plan.capacity import measured_capacity
from tidal.scheduler.plan.catalog import Catalog, load_catalog, load_prices
from tidal.scheduler.plan.planner import Plan, PlanRequest, make_plan
from tidal.scheduler.plan.workload import Workload, load_workload

__all__ = [
    "Catalog",
    "Plan",
    "PlanRequest",
    "Workload",
    "load_catalog",
    "load_prices",
    "load_workload",
    "make_plan",
    "measured_capacity",
]
