"""Number helpers."""


def gcd(a, b):
    """The greatest common divisor of integers `a` and `b` (non-negative; gcd(0, 0) == 0)."""
    a, b = abs(a), abs(b)
    while b:
        a, b = b, a % b
    return a


def primes_up_to(n):
    """The list of primes <= `n`, in increasing order."""
    if n < 2:
        return []
    sieve = [True] * (n + 1)
    sieve[0] = sieve[1] = False
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            for j in range(i * i, n + 1, i):
                sieve[j] = False
    return [i for i, p in enumerate(sieve) if p]


def digit_sum(n):
    """The sum of the decimal digits of the integer `n` (its sign ignored)."""
    return sum(int(d) for d in str(abs(n)))


def mean(values):
    """The arithmetic mean of a non-empty list of numbers; ValueError when empty."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)
