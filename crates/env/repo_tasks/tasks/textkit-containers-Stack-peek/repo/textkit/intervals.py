"""Closed integer intervals and their unions."""


class Interval:
    """The closed integer interval [lo, hi]."""

    def __init__(self, lo, hi):
        if lo > hi:
            raise ValueError("empty interval")
        self.lo = lo
        self.hi = hi

    def __eq__(self, other):
        return isinstance(other, Interval) and (self.lo, self.hi) == (other.lo, other.hi)

    def __repr__(self):
        return "Interval(%d, %d)" % (self.lo, self.hi)

    def overlaps(self, other):
        """Whether the two intervals share a point."""
        return self.lo <= other.hi and other.lo <= self.hi

    def merge(self, other):
        """The smallest interval covering both. Raises ValueError when they do not overlap."""
        if not self.overlaps(other):
            raise ValueError("disjoint intervals")
        return Interval(min(self.lo, other.lo), max(self.hi, other.hi))


def merge_all(intervals):
    """The union of `intervals` as a list of disjoint intervals sorted by their start."""
    out = []
    for iv in sorted(intervals, key=lambda i: i.lo):
        if out and out[-1].overlaps(iv):
            out[-1] = out[-1].merge(iv)
        else:
            out.append(iv)
    return out
