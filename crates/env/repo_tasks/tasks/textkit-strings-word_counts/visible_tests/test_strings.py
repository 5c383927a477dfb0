from textkit.strings import caesar, is_palindrome, slugify, word_counts

def test_word_counts():
    assert word_counts("a b A  c b a") == {"a": 3, "b": 2, "c": 1}

