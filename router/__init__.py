"""Picking a replica for one interactive request: the replica registry and its live load,
plugins (filters, scorers, picker) composed into profiles, the bounded-load prefix ring,
session and adapter affinity, canary weights."""
