from textkit.intervals import Interval, merge_all

def test_interval_overlap_and_merge():
    a, b = Interval(1, 3), Interval(3, 6)
    assert a.overlaps(b) and b.overlaps(a)
    assert not a.overlaps(Interval(4, 5))
    assert a.merge(b) == Interval(1, 6)
    assert repr(a.merge(b)) == "Interval(1, 6)"
    try:
        a.merge(Interval(5, 9))
    except ValueError:
        pass
    else:
        assert False, "expected ValueError"

