from textkit.intervals import Interval, merge_all

def test_merge_all():
    ivs = [Interval(5, 7), Interval(1, 2), Interval(2, 4), Interval(9, 9)]
    assert merge_all(ivs) == [Interval(1, 4), Interval(5, 7), Interval(9, 9)]
    assert merge_all([]) == []

