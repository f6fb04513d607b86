"""A running stack: units started in dependency order, proven ready, supervised, stopped.

Owns the :class:`~hold_supervisor.stack.stack.Stack`, its units and their
states, readiness and liveness, sd_notify, unit logs, and the control socket
of a running stack. Reads its input from :mod:`hold_supervisor.stackfile`
(the frozen spec); may import :mod:`hold_supervisor.proc`,
:mod:`hold_supervisor.spawn`, :mod:`hold_supervisor.task` and the top-level
modules.
"""
