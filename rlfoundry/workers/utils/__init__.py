"""Plumbing shared by the worker roles: ``device`` (a driver batch on a worker's device without
touching the driver's object) and ``plan`` (verl's update keys as an engine ``UpdatePlan``).

Import from the submodules; this package keeps its import cheap.
"""
