from textkit import numbers

def test_gcd():
    assert numbers.gcd(12, 18) == 6
    assert numbers.gcd(-4, 6) == 2

def test_gcd_zero():
    assert numbers.gcd(0, 0) == 0
    assert numbers.gcd(0, 7) == 7

