"""The commands: ``hold``, ``npu-hold`` and ``gpu-hold``: argv in, exit status and text out.

One module per command (``run``, ``up``, ``down``, ``call``, ``logs``,
``audit``, ``daemon``, ``validate``, ...), the click group that registers the
rest (:mod:`hold.cli.group`), and the guarded run of a command or an adopted
job (:mod:`hold.cli.run`, :mod:`hold.cli.adopt`). The hot path
(:mod:`hold.cli.entry`, :mod:`hold.cli.options`, :mod:`hold.cli.runargs`,
:mod:`hold.cli.run`) imports neither click nor anything heavy.

Options are read one of two ways, each declared once: click for the group and
most commands (usage, help, errors and completion for twenty commands are what
it is for), and :mod:`hold.cli.options` (one table per command, one small
parser) only where start-up is a benchmark: ``hold run``/``npu-hold``, and a
plainly valid ``hold audit``, ``hold up`` or ``hold down`` line, whose click
options are made from the same table.

May import every other package of ``hold`` and ``hold_supervisor``; nothing
imports it but the console scripts and ``python -m hold``
(``tests/test_layout.py`` holds every package to its contract).
"""
