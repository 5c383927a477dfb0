"""Sequence helpers."""


def chunk(items, size):
    """Split the list `items` into lists of `size` items (the last may be shorter);
    ValueError when size < 1."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [items[i:i + size] for i in range(0, len(items), size)]


def flatten(nested):
    """Flatten arbitrarily nested lists and tuples into one list, in order."""
    out = []
    for item in nested:
        if isinstance(item, (list, tuple)):
            out.extend(flatten(item))
        else:
            out.append(item)
    return out


def dedupe(items):
    """The items of `items` without repeats, keeping the first occurrence's order."""
    seen = set()
    out = []
    for item in items:
        if item not in seen:
            seen.add(item)
            out.append(item)
    return out


def run_lengths(items):
    """Run-length encoding: a list of (item, count) tuples for consecutive equal items."""
    out = []
    for item in items:
        if out and out[-1][0] == item:
            out[-1] = (item, out[-1][1] + 1)
        else:
            out.append((item, 1))
    return out
