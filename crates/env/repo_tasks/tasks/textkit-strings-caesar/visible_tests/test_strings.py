from textkit.strings import caesar, is_palindrome, slugify, word_counts

def test_caesar_shift():
    assert caesar("abc xyz", 3) == "def abc"

