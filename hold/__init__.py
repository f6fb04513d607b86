"""hold: exclusive device tickets, and processes that never outlive their ticket."""
