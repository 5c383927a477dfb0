from textkit import numbers

def test_primes():
    assert numbers.primes_up_to(20) == [2, 3, 5, 7, 11, 13, 17, 19]

