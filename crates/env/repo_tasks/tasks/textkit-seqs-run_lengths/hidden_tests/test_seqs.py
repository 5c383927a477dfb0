from textkit.seqs import chunk, dedupe, flatten, run_lengths

def test_run_lengths():
    assert run_lengths("aaabcc") == [("a", 3), ("b", 1), ("c", 2)]
    assert run_lengths([]) == []

