"""hold: exclusive device tickets, and processes that never outlive their ticket.

The packages, each one concept (their ``__init__`` says what each may import):

- :mod:`hold.cli`: the commands (``hold``, ``npu-hold``, ``gpu-hold``);
- :mod:`hold.client`: a client of the ticket daemon, and the lease it holds;
- :mod:`hold.daemon`: the ticket daemon, the machine's one arbiter;
- :mod:`hold.devices`: device classes, GPU identities, who holds a node;
- :mod:`hold.views`: status, audit, report, metrics and the web page.

The top-level modules are what several packages share: the wire
(:mod:`hold.protocol`), a lease's record and who is inside it
(:mod:`hold.leases`), the configuration, the state directory, errors.
Process control is the separate package ``hold_supervisor`` (the folder
``supervisor/``), which never imports ``hold``.
"""
