from textkit import numbers

def test_mean():
    assert numbers.mean([1, 2, 3, 4]) == 2.5

def test_mean_empty():
    try:
        numbers.mean([])
    except ValueError:
        return
    assert False, "expected ValueError"

