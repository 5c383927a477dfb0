from textkit.containers import EmptyError, Stack

def test_stack_push_pop_peek():
    s = Stack()
    s.push(1)
    s.push("two")
    assert len(s) == 2
    assert s.peek() == "two"
    assert s.pop() == "two"
    assert list(s) == [1]

