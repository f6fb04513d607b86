"""A client of the ticket daemon: connect (starting the daemon if none answers), ask, hold a lease.

Owns the client's side of the wire: the connection and its deadlines
(:mod:`hold.client.waits`), autostart, the lease conversation and its live
waiting line, and ``hold check``'s question. May import the top-level modules
of ``hold`` (protocol, config, state directory, leases), :mod:`hold.devices`
and ``hold_supervisor``; never :mod:`hold.cli`, :mod:`hold.views`, or the
daemon's own modules: it talks to the daemon, it does not run it.
"""
