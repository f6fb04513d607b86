"""The commands: ``hold``, ``npu-hold`` and ``gpu-hold``: argv in, exit status and text out.

One module per command (``run``, ``up``, ``down``, ``call``, ``logs``,
``audit``, ``daemon``, ``validate``, ...), the click group that registers the
rest (:mod:`hold.cli.group`), and the guarded run of a command or an adopted
job (:mod:`hold.cli.run`, :mod:`hold.cli.adopt`). The hot path
(:mod:`hold.cli.entry`, :mod:`hold.cli.runargs`, :mod:`hold.cli.run`) imports
neither click nor anything heavy.

May import every other package of ``hold`` and ``hold_supervisor``; nothing
imports it but the console scripts and ``python -m hold``
(``tests/test_layout.py`` holds every package to its contract).
"""
