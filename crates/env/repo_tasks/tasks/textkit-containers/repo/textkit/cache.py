"""A least-recently-used cache."""


class LRUCache:
    """A mapping of at most `capacity` entries that evicts the least recently used one."""

    def __init__(self, capacity):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self.entries = {}

    def get(self, key, default=None):
        """The value of `key` (which becomes the most recently used), or `default`."""
        if key not in self.entries:
            return default
        value = self.entries.pop(key)
        self.entries[key] = value
        return value

    def put(self, key, value):
        """Set `key` to `value` (now the most recently used), evicting the least recently used
        entry when the cache goes over capacity."""
        self.entries.pop(key, None)
        self.entries[key] = value
        if len(self.entries) > self.capacity:
            del self.entries[next(iter(self.entries))]

    def keys(self):
        """The keys from the least to the most recently used."""
        return list(self.entries)
