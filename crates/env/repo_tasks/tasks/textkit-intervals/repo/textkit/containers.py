"""A stack with a capacity."""


class EmptyError(IndexError):
    """Raised when taking an item from an empty structure."""


class Stack:
    """A last-in, first-out stack holding at most `capacity` items (no bound when None)."""

    def __init__(self, capacity=None):
        self.items = []
        self.capacity = capacity

    def push(self, item):
        """Put `item` on top. Raises OverflowError when the stack is full."""
        if self.capacity is not None and len(self.items) >= self.capacity:
            raise OverflowError("the stack is full")
        self.items.append(item)

    def pop(self):
        """Remove and return the top item. Raises EmptyError when the stack is empty."""
        if not self.items:
            raise EmptyError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        """The top item, left in place. Raises EmptyError when the stack is empty."""
        if not self.items:
            raise EmptyError("peek at an empty stack")
        return self.items[-1]

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return reversed(self.items)
