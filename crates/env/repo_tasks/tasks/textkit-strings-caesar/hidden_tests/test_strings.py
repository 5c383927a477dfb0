from textkit.strings import caesar, is_palindrome, slugify, word_counts

def test_caesar_shift():
    assert caesar("abc xyz", 3) == "def abc"

def test_caesar_case_and_roundtrip():
    assert caesar("Hello, World", 13) == "Uryyb, Jbeyq"
    assert caesar(caesar("Zebra-42", 5), -5) == "Zebra-42"

