from textkit.seqs import chunk, dedupe, flatten, run_lengths

def test_chunk():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]

