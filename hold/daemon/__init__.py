"""The ticket daemon: one arbiter per machine that grants exclusive device leases.

Owns the listener, the wire operations, the waiting lines and grants, the
ledger of sessions and their trees, occupancy (the kernel's count of each
node's opens), what it writes down (log, token files, history), what it counts
for reports, and its systemd unit. May import the top-level modules of
``hold``, :mod:`hold.devices` and ``hold_supervisor``; never :mod:`hold.cli`,
:mod:`hold.client` or :mod:`hold.views`.
"""
