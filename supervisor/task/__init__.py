"""On-demand task units: one isolated, bounded run per call.

Owns a call's arguments, its process from start to result, its pipes and the
parked stub of cgroup mode. May import :mod:`hold_supervisor.proc`,
:mod:`hold_supervisor.spawn`, :mod:`hold_supervisor.stackfile` (the spec) and
the top-level modules.
"""
