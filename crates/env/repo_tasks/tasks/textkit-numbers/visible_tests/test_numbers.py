from textkit import numbers

def test_gcd():
    assert numbers.gcd(12, 18) == 6
    assert numbers.gcd(-4, 6) == 2

