"""Starting a program isolated from its first instruction, and where its tree lives.

Owns ``spawn`` (own session, CPU mask, three descriptors, minimal
environment), containment (a cgroup leaf, born in it with
``clone3(CLONE_INTO_CGROUP)``, or the walk), a run's scratch directory, and
:mod:`~hold_supervisor.spawn.foreground` (one command run to its end, then
everything it started stopped: ``hold run``'s core). May import
:mod:`hold_supervisor.proc` and the top-level modules.
"""
