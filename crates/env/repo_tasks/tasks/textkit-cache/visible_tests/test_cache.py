from textkit.cache import LRUCache

def test_lru_cache_evicts_least_recent():
    c = LRUCache(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1
    c.put("c", 3)
    assert c.get("b") is None
    assert c.get("b", 0) == 0
    assert c.keys() == ["a", "c"]
    c.put("a", 10)
    assert c.keys() == ["c", "a"] and c.get("a") == 10

