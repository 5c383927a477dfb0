from textkit.strings import caesar, is_palindrome, slugify, word_counts

def test_slugify_basic():
    assert slugify("Hello, World!") == "hello-world"

def test_slugify_runs_and_edges():
    assert slugify("  --A  b__c--  ") == "a-b-c"
    assert slugify("") == ""

def test_caesar_shift():
    assert caesar("abc xyz", 3) == "def abc"

def test_caesar_case_and_roundtrip():
    assert caesar("Hello, World", 13) == "Uryyb, Jbeyq"
    assert caesar(caesar("Zebra-42", 5), -5) == "Zebra-42"

def test_word_counts():
    assert word_counts("a b A  c b a") == {"a": 3, "b": 2, "c": 1}

def test_word_counts_empty():
    assert word_counts("   ") == {}

def test_palindromes():
    assert is_palindrome("A man, a plan, a canal: Panama")
    assert not is_palindrome("palindrome")

