from textkit.strings import caesar, is_palindrome, slugify, word_counts

def test_slugify_basic():
    assert slugify("Hello, World!") == "hello-world"

