from textkit.containers import EmptyError, Stack

def test_stack_push_pop_peek():
    s = Stack()
    s.push(1)
    s.push("two")
    assert len(s) == 2
    assert s.peek() == "two"
    assert s.pop() == "two"
    assert list(s) == [1]

def test_stack_limits():
    s = Stack(capacity=1)
    s.push(1)
    try:
        s.push(2)
    except OverflowError:
        pass
    else:
        assert False, "expected OverflowError"
    assert s.pop() == 1
    for take in (s.pop, s.peek):
        try:
            take()
        except EmptyError as e:
            assert isinstance(e, IndexError)
        else:
            assert False, "expected EmptyError"

