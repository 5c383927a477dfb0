from textkit import numbers

def test_primes():
    assert numbers.primes_up_to(20) == [2, 3, 5, 7, 11, 13, 17, 19]

def test_primes_small():
    assert numbers.primes_up_to(1) == []
    assert numbers.primes_up_to(2) == [2]

