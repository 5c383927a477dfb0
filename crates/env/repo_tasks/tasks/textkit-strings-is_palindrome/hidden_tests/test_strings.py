from textkit.strings import caesar, is_palindrome, slugify, word_counts

def test_palindromes():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("palindrome")

