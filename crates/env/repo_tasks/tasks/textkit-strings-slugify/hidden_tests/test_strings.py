from textkit.strings import caesar, is_palindrome, slugify, word_counts

def test_slugify_basic():
    assert slugify("Hello, World!") == "hello-world"

def test_slugify_runs_and_edges():
    assert slugify("  --A  b__c--  ") == "a-b-c"
    assert slugify("") == ""

