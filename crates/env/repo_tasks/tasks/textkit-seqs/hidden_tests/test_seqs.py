from textkit.seqs import chunk, dedupe, flatten, run_lengths

def test_chunk():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]

def test_chunk_bad_size():
    try:
        chunk([1], 0)
    except ValueError:
        return
    assert False, "expected ValueError"

def test_flatten():
    assert flatten([1, [2, (3, [4])], [], 5]) == [1, 2, 3, 4, 5]

def test_dedupe():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]
    assert dedupe("abca") == ["a", "b", "c"]

def test_run_lengths():
    assert run_lengths("aaabcc") == [("a", 3), ("b", 1), ("c", 2)]
    assert run_lengths([]) == []

