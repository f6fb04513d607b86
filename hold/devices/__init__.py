"""Devices: which nodes make up a class, which GPU is which, and who holds a node now.

Owns device classes, GPU identities (NVML through ctypes) and the holder scan
that the daemon and ``hold audit`` share. May import the top-level modules of
``hold`` and ``hold_supervisor``; no other package of ``hold``.
"""
