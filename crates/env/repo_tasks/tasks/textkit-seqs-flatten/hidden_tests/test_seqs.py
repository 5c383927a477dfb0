from textkit.seqs import chunk, dedupe, flatten, run_lengths

def test_flatten():
    assert flatten([1, [2, (3, [4])], [], 5]) == [1, 2, 3, 4, 5]

