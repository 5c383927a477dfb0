from textkit import numbers

def test_mean():
    assert numbers.mean([1, 2, 3, 4]) == 2.5

