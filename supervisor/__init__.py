"""Process control: spawn isolated, find whole trees, stop them and prove it.

This folder installs as the import package ``hold_supervisor`` (pyproject's
``package-dir``): PyPI's supervisord installs a top-level ``supervisor``, and
two packages of one name in one environment overwrite each other.

Knows nothing of devices or tickets (``hold`` builds those on top of it, and
nothing here imports ``hold``). The packages, each one concept:

- :mod:`hold_supervisor.proc`: process identity, ``/proc``, trees, stop and survivors;
- :mod:`hold_supervisor.spawn`: starting a program isolated, and where its tree lives;
- :mod:`hold_supervisor.stackfile`: the stack file read strictly into a frozen spec;
- :mod:`hold_supervisor.stack`: a running stack;
- :mod:`hold_supervisor.task`: on-demand task units.

The top-level modules are what all of them share: errors, exit codes, strict
parsers, safe files, JSON lines, YAML, terminal width, signal wakeups, and
:mod:`hold_supervisor.spawn.foreground` (one command run to its end, ``hold run``'s core).
"""
