"""Process control: spawn isolated, find whole trees, stop them and prove it.

Knows nothing of devices or tickets (``hold`` builds those on top of it).
"""
