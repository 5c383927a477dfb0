from textkit.seqs import chunk, dedupe, flatten, run_lengths

def test_dedupe():
    assert dedupe([3, 1, 3, 2, 1]) == [3, 1, 2]
    assert dedupe("abca") == ["a", "b", "c"]

