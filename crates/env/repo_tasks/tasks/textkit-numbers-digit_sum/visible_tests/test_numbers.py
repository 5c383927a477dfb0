from textkit import numbers

def test_digit_sum():
    assert numbers.digit_sum(12345) == 15
    assert numbers.digit_sum(-907) == 16

