"""What people look at: status, the audit, the report, metrics, the web page.

Each view asks the daemon (through :mod:`hold.client`) or reads what it wrote
(its history, read only) and renders it: a table fitted to the terminal,
JSON, Prometheus text or HTML. May import every package of ``hold`` but
:mod:`hold.cli`, and ``hold_supervisor``.
"""
