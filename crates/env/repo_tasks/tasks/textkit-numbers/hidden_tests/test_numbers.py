from textkit import numbers

def test_gcd():
    assert numbers.gcd(12, 18) == 6
    assert numbers.gcd(-4, 6) == 2

def test_gcd_zero():
    assert numbers.gcd(0, 0) == 0
    assert numbers.gcd(0, 7) == 7

def test_primes():
    assert numbers.primes_up_to(20) == [2, 3, 5, 7, 11, 13, 17, 19]

def test_primes_small():
    assert numbers.primes_up_to(1) == []
    assert numbers.primes_up_to(2) == [2]

def test_digit_sum():
    assert numbers.digit_sum(12345) == 15
    assert numbers.digit_sum(-907) == 16

def test_mean():
    assert numbers.mean([1, 2, 3, 4]) == 2.5

def test_mean_empty():
    try:
        numbers.mean([])
    except ValueError:
        return
    assert False, "expected ValueError"

