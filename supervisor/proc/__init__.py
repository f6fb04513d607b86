"""Processes as they are: identity, one reader of ``/proc``, trees, stopping them, survivors.

A process is ``(pid, starttime)``, never a bare pid. Owns the scan of
``/proc``, cgroup v2 leaves (membership that ``setsid`` cannot escape), the
:class:`~hold_supervisor.proc.tree.Tree` of everything one spawned thing
started, ``stop_tree`` and the survivor check. Imports only the
top-level modules of ``hold_supervisor`` (errors, parse, safefile) and psutil.
"""
