//! The built-in task set: function-writing tasks written for composer-rl, each with tests and
//! a reference solution (the test suite proves every reference passes and a stub fails).

use crate::CodeTask;

struct Builtin {
    name: &'static str,
    entry_point: &'static str,
    prompt: &'static str,
    tests: &'static [&'static str],
    reference: &'static str,
}

const SUFFIX: &str = "Answer with the complete function in a ```python code block.";

const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "sum_of_evens",
        entry_point: "sum_of_evens",
        prompt: "Write a Python function `sum_of_evens(numbers)` that returns the sum of the even integers in the list `numbers` (0 for an empty list).",
        tests: &[
            "assert sum_of_evens([1, 2, 3, 4]) == 6",
            "assert sum_of_evens([]) == 0",
            "assert sum_of_evens([1, 3, 5]) == 0",
            "assert sum_of_evens([-2, -3, 10]) == 8",
        ],
        reference: "def sum_of_evens(numbers):\n    return sum(n for n in numbers if n % 2 == 0)\n",
    },
    Builtin {
        name: "reverse_words",
        entry_point: "reverse_words",
        prompt: "Write a Python function `reverse_words(sentence)` that returns the words of `sentence` (separated by runs of whitespace) in reverse order, joined by single spaces.",
        tests: &[
            "assert reverse_words('hello world') == 'world hello'",
            "assert reverse_words('  a   b c ') == 'c b a'",
            "assert reverse_words('') == ''",
            "assert reverse_words('one') == 'one'",
        ],
        reference: "def reverse_words(sentence):\n    return ' '.join(reversed(sentence.split()))\n",
    },
    Builtin {
        name: "is_palindrome",
        entry_point: "is_palindrome",
        prompt: "Write a Python function `is_palindrome(text)` that returns True when `text` reads the same forwards and backwards considering only letters and digits, ignoring case.",
        tests: &[
            "assert is_palindrome('A man, a plan, a canal: Panama') is True",
            "assert is_palindrome('race a car') is False",
            "assert is_palindrome('') is True",
            "assert is_palindrome('No lemon, no melon') is True",
            "assert is_palindrome('ab') is False",
        ],
        reference: "def is_palindrome(text):\n    s = [c.lower() for c in text if c.isalnum()]\n    return s == s[::-1]\n",
    },
    Builtin {
        name: "fizzbuzz",
        entry_point: "fizzbuzz",
        prompt: "Write a Python function `fizzbuzz(n)` that returns a list of strings for 1..n: 'Fizz' for multiples of 3, 'Buzz' for multiples of 5, 'FizzBuzz' for multiples of both, else the number as a string.",
        tests: &[
            "assert fizzbuzz(5) == ['1', '2', 'Fizz', '4', 'Buzz']",
            "assert fizzbuzz(15)[-1] == 'FizzBuzz'",
            "assert fizzbuzz(0) == []",
            "assert len(fizzbuzz(100)) == 100 and fizzbuzz(100)[98] == 'Fizz'",
        ],
        reference: "def fizzbuzz(n):\n    out = []\n    for i in range(1, n + 1):\n        s = ('Fizz' if i % 3 == 0 else '') + ('Buzz' if i % 5 == 0 else '')\n        out.append(s or str(i))\n    return out\n",
    },
    Builtin {
        name: "two_sum",
        entry_point: "two_sum",
        prompt: "Write a Python function `two_sum(nums, target)` that returns a tuple `(i, j)` with i < j such that nums[i] + nums[j] == target, choosing the pair with the smallest j (then smallest i), or None when no pair exists.",
        tests: &[
            "assert two_sum([2, 7, 11, 15], 9) == (0, 1)",
            "assert two_sum([3, 2, 4], 6) == (1, 2)",
            "assert two_sum([3, 3], 6) == (0, 1)",
            "assert two_sum([1, 2, 3], 100) is None",
            "assert two_sum([1, 5, 1, 5], 10) == (1, 3)",
        ],
        reference: "def two_sum(nums, target):\n    seen = {}\n    for j, x in enumerate(nums):\n        if target - x in seen:\n            return (seen[target - x], j)\n        seen.setdefault(x, j)\n    return None\n",
    },
    Builtin {
        name: "run_length_encode",
        entry_point: "run_length_encode",
        prompt: "Write a Python function `run_length_encode(text)` that encodes runs of repeated characters as count followed by the character, e.g. 'aaabcc' -> '3a1b2c'.",
        tests: &[
            "assert run_length_encode('aaabcc') == '3a1b2c'",
            "assert run_length_encode('') == ''",
            "assert run_length_encode('a') == '1a'",
            "assert run_length_encode('aaaaaaaaaaaa') == '12a'",
            "assert run_length_encode('abab') == '1a1b1a1b'",
        ],
        reference: "def run_length_encode(text):\n    out = []\n    i = 0\n    while i < len(text):\n        j = i\n        while j < len(text) and text[j] == text[i]:\n            j += 1\n        out.append(f'{j - i}{text[i]}')\n        i = j\n    return ''.join(out)\n",
    },
    Builtin {
        name: "run_length_decode",
        entry_point: "run_length_decode",
        prompt: "Write a Python function `run_length_decode(encoded)` that inverts run-length encoding of the form count followed by character (counts may have several digits), e.g. '3a1b2c' -> 'aaabcc'.",
        tests: &[
            "assert run_length_decode('3a1b2c') == 'aaabcc'",
            "assert run_length_decode('') == ''",
            "assert run_length_decode('12x') == 'x' * 12",
            "assert run_length_decode('1a1b1a') == 'aba'",
        ],
        reference: "def run_length_decode(encoded):\n    out = []\n    count = ''\n    for c in encoded:\n        if c.isdigit():\n            count += c\n        else:\n            out.append(c * int(count))\n            count = ''\n    return ''.join(out)\n",
    },
    Builtin {
        name: "fibonacci",
        entry_point: "fibonacci",
        prompt: "Write a Python function `fibonacci(n)` returning the n-th Fibonacci number with fibonacci(0) == 0 and fibonacci(1) == 1. It must be fast for n up to 10000.",
        tests: &[
            "assert fibonacci(0) == 0",
            "assert fibonacci(1) == 1",
            "assert fibonacci(10) == 55",
            "assert fibonacci(90) == 2880067194370816120",
            "assert len(str(fibonacci(10000))) == 2090",
        ],
        reference: "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n",
    },
    Builtin {
        name: "is_prime",
        entry_point: "is_prime",
        prompt: "Write a Python function `is_prime(n)` that returns True when the integer `n` is prime (False for n < 2).",
        tests: &[
            "assert [n for n in range(20) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19]",
            "assert is_prime(-7) is False",
            "assert is_prime(7919) is True",
            "assert is_prime(1000000007) is True",
            "assert is_prime(1000000007 * 3) is False",
        ],
        reference: "def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n        if n % i == 0:\n            return False\n        i += 1\n    return True\n",
    },
    Builtin {
        name: "primes_up_to",
        entry_point: "primes_up_to",
        prompt: "Write a Python function `primes_up_to(n)` that returns the sorted list of all primes <= n.",
        tests: &[
            "assert primes_up_to(10) == [2, 3, 5, 7]",
            "assert primes_up_to(1) == []",
            "assert primes_up_to(2) == [2]",
            "assert len(primes_up_to(100000)) == 9592",
        ],
        reference: "def primes_up_to(n):\n    if n < 2:\n        return []\n    sieve = [True] * (n + 1)\n    sieve[0] = sieve[1] = False\n    for i in range(2, int(n ** 0.5) + 1):\n        if sieve[i]:\n            sieve[i * i::i] = [False] * len(range(i * i, n + 1, i))\n    return [i for i, p in enumerate(sieve) if p]\n",
    },
    Builtin {
        name: "gcd_lcm",
        entry_point: "gcd_lcm",
        prompt: "Write a Python function `gcd_lcm(a, b)` that returns the tuple (greatest common divisor, least common multiple) of two positive integers, without importing anything.",
        tests: &[
            "assert gcd_lcm(12, 18) == (6, 36)",
            "assert gcd_lcm(7, 13) == (1, 91)",
            "assert gcd_lcm(5, 5) == (5, 5)",
            "assert gcd_lcm(1, 1000000) == (1, 1000000)",
        ],
        reference: "def gcd_lcm(a, b):\n    x, y = a, b\n    while y:\n        x, y = y, x % y\n    return (x, a * b // x)\n",
    },
    Builtin {
        name: "balanced_brackets",
        entry_point: "balanced_brackets",
        prompt: "Write a Python function `balanced_brackets(text)` that returns True when the brackets ()[]{} in `text` are balanced and properly nested (other characters are ignored).",
        tests: &[
            "assert balanced_brackets('([]{})') is True",
            "assert balanced_brackets('([)]') is False",
            "assert balanced_brackets('') is True",
            "assert balanced_brackets('((') is False",
            "assert balanced_brackets('f(x[1]) + {a: 2}') is True",
            "assert balanced_brackets(')(') is False",
        ],
        reference: "def balanced_brackets(text):\n    pairs = {')': '(', ']': '[', '}': '{'}\n    stack = []\n    for c in text:\n        if c in '([{':\n            stack.append(c)\n        elif c in pairs:\n            if not stack or stack.pop() != pairs[c]:\n                return False\n    return not stack\n",
    },
    Builtin {
        name: "flatten",
        entry_point: "flatten",
        prompt: "Write a Python function `flatten(nested)` that flattens arbitrarily nested lists into a single list, keeping the order of the non-list items.",
        tests: &[
            "assert flatten([1, [2, [3, [4]]], 5]) == [1, 2, 3, 4, 5]",
            "assert flatten([]) == []",
            "assert flatten([[], [[]]]) == []",
            "assert flatten(['a', ['b', ('c',)]]) == ['a', 'b', ('c',)]",
        ],
        reference: "def flatten(nested):\n    out = []\n    for x in nested:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out\n",
    },
    Builtin {
        name: "word_frequencies",
        entry_point: "word_frequencies",
        prompt: "Write a Python function `word_frequencies(text)` that returns a dict mapping each lower-cased word to its count, where words are maximal runs of ASCII letters.",
        tests: &[
            "assert word_frequencies('The cat and the hat.') == {'the': 2, 'cat': 1, 'and': 1, 'hat': 1}",
            "assert word_frequencies('') == {}",
            "assert word_frequencies(\"it's 2 o'clock\") == {'it': 1, 's': 1, 'o': 1, 'clock': 1}",
            "assert word_frequencies('A a A') == {'a': 3}",
        ],
        reference: "def word_frequencies(text):\n    counts = {}\n    word = ''\n    for c in text + ' ':\n        if c.isascii() and c.isalpha():\n            word += c.lower()\n        elif word:\n            counts[word] = counts.get(word, 0) + 1\n            word = ''\n    return counts\n",
    },
    Builtin {
        name: "merge_intervals",
        entry_point: "merge_intervals",
        prompt: "Write a Python function `merge_intervals(intervals)` that merges overlapping or touching closed intervals given as [start, end] pairs and returns them sorted by start as a list of [start, end] lists.",
        tests: &[
            "assert merge_intervals([[1, 3], [2, 6], [8, 10], [15, 18]]) == [[1, 6], [8, 10], [15, 18]]",
            "assert merge_intervals([[1, 4], [4, 5]]) == [[1, 5]]",
            "assert merge_intervals([]) == []",
            "assert merge_intervals([[5, 7], [1, 2]]) == [[1, 2], [5, 7]]",
            "assert merge_intervals([[1, 10], [2, 3], [4, 5]]) == [[1, 10]]",
        ],
        reference: "def merge_intervals(intervals):\n    out = []\n    for s, e in sorted(intervals):\n        if out and s <= out[-1][1]:\n            out[-1][1] = max(out[-1][1], e)\n        else:\n            out.append([s, e])\n    return out\n",
    },
    Builtin {
        name: "binary_search",
        entry_point: "binary_search",
        prompt: "Write a Python function `binary_search(sorted_list, target)` that returns the index of the first occurrence of `target` in the ascending list, or -1, in O(log n) time.",
        tests: &[
            "assert binary_search([1, 3, 5, 7], 5) == 2",
            "assert binary_search([1, 3, 5, 7], 4) == -1",
            "assert binary_search([], 1) == -1",
            "assert binary_search([2, 2, 2, 3], 2) == 0",
            "assert binary_search(list(range(0, 2000000, 2)), 1999998) == 999999",
        ],
        reference: "def binary_search(sorted_list, target):\n    lo, hi = 0, len(sorted_list)\n    while lo < hi:\n        mid = (lo + hi) // 2\n        if sorted_list[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid\n    return lo if lo < len(sorted_list) and sorted_list[lo] == target else -1\n",
    },
    Builtin {
        name: "roman_to_int",
        entry_point: "roman_to_int",
        prompt: "Write a Python function `roman_to_int(numeral)` that converts a valid Roman numeral (I, V, X, L, C, D, M with subtractive notation) to an integer.",
        tests: &[
            "assert roman_to_int('III') == 3",
            "assert roman_to_int('IV') == 4",
            "assert roman_to_int('MCMXCIV') == 1994",
            "assert roman_to_int('MMMCMXCIX') == 3999",
        ],
        reference: "def roman_to_int(numeral):\n    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}\n    total = 0\n    for i, c in enumerate(numeral):\n        if i + 1 < len(numeral) and v[c] < v[numeral[i + 1]]:\n            total -= v[c]\n        else:\n            total += v[c]\n    return total\n",
    },
    Builtin {
        name: "int_to_roman",
        entry_point: "int_to_roman",
        prompt: "Write a Python function `int_to_roman(n)` that converts an integer 1 <= n <= 3999 to a Roman numeral using subtractive notation (e.g. 4 -> 'IV').",
        tests: &[
            "assert int_to_roman(3) == 'III'",
            "assert int_to_roman(4) == 'IV'",
            "assert int_to_roman(1994) == 'MCMXCIV'",
            "assert int_to_roman(3999) == 'MMMCMXCIX'",
            "assert int_to_roman(40) == 'XL'",
        ],
        reference: "def int_to_roman(n):\n    table = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),\n             (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]\n    out = ''\n    for value, sym in table:\n        while n >= value:\n            out += sym\n            n -= value\n    return out\n",
    },
    Builtin {
        name: "caesar_cipher",
        entry_point: "caesar_cipher",
        prompt: "Write a Python function `caesar_cipher(text, shift)` that shifts ASCII letters by `shift` positions (wrapping, preserving case; shift may be negative or large) and leaves other characters unchanged.",
        tests: &[
            "assert caesar_cipher('abc', 1) == 'bcd'",
            "assert caesar_cipher('xyz', 3) == 'abc'",
            "assert caesar_cipher('Hello, World!', 13) == 'Uryyb, Jbeyq!'",
            "assert caesar_cipher('abc', -1) == 'zab'",
            "assert caesar_cipher('Zz', 52) == 'Zz'",
        ],
        reference: "def caesar_cipher(text, shift):\n    out = []\n    for c in text:\n        if 'a' <= c <= 'z':\n            out.append(chr((ord(c) - 97 + shift) % 26 + 97))\n        elif 'A' <= c <= 'Z':\n            out.append(chr((ord(c) - 65 + shift) % 26 + 65))\n        else:\n            out.append(c)\n    return ''.join(out)\n",
    },
    Builtin {
        name: "anagram_groups",
        entry_point: "anagram_groups",
        prompt: "Write a Python function `anagram_groups(words)` that groups words that are anagrams of each other. Return a list of groups; each group keeps the words' input order, and groups are ordered by the position of their first word.",
        tests: &[
            "assert anagram_groups(['eat', 'tea', 'tan', 'ate', 'nat', 'bat']) == [['eat', 'tea', 'ate'], ['tan', 'nat'], ['bat']]",
            "assert anagram_groups([]) == []",
            "assert anagram_groups(['a']) == [['a']]",
            "assert anagram_groups(['ab', 'ba', 'ab']) == [['ab', 'ba', 'ab']]",
        ],
        reference: "def anagram_groups(words):\n    groups = {}\n    for w in words:\n        groups.setdefault(''.join(sorted(w)), []).append(w)\n    return list(groups.values())\n",
    },
    Builtin {
        name: "matrix_transpose",
        entry_point: "matrix_transpose",
        prompt: "Write a Python function `matrix_transpose(matrix)` that returns the transpose of a rectangular matrix given as a list of row lists (an empty matrix gives []).",
        tests: &[
            "assert matrix_transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]",
            "assert matrix_transpose([]) == []",
            "assert matrix_transpose([[1]]) == [[1]]",
            "assert matrix_transpose([[1, 2]]) == [[1], [2]]",
        ],
        reference: "def matrix_transpose(matrix):\n    return [list(col) for col in zip(*matrix)]\n",
    },
    Builtin {
        name: "max_subarray_sum",
        entry_point: "max_subarray_sum",
        prompt: "Write a Python function `max_subarray_sum(numbers)` that returns the largest sum of a non-empty contiguous subarray of the non-empty list `numbers`, in O(n) time.",
        tests: &[
            "assert max_subarray_sum([-2, 1, -3, 4, -1, 2, 1, -5, 4]) == 6",
            "assert max_subarray_sum([-3, -1, -2]) == -1",
            "assert max_subarray_sum([5]) == 5",
            "assert max_subarray_sum([1] * 1000000) == 1000000",
        ],
        reference: "def max_subarray_sum(numbers):\n    best = cur = numbers[0]\n    for x in numbers[1:]:\n        cur = max(x, cur + x)\n        best = max(best, cur)\n    return best\n",
    },
    Builtin {
        name: "longest_common_prefix",
        entry_point: "longest_common_prefix",
        prompt: "Write a Python function `longest_common_prefix(strings)` that returns the longest string that is a prefix of every string in the list ('' for an empty list).",
        tests: &[
            "assert longest_common_prefix(['flower', 'flow', 'flight']) == 'fl'",
            "assert longest_common_prefix(['dog', 'racecar']) == ''",
            "assert longest_common_prefix([]) == ''",
            "assert longest_common_prefix(['same', 'same']) == 'same'",
            "assert longest_common_prefix(['a']) == 'a'",
        ],
        reference: "def longest_common_prefix(strings):\n    if not strings:\n        return ''\n    prefix = strings[0]\n    for s in strings[1:]:\n        while not s.startswith(prefix):\n            prefix = prefix[:-1]\n    return prefix\n",
    },
    Builtin {
        name: "digit_sum",
        entry_point: "digit_sum",
        prompt: "Write a Python function `digit_sum(n)` that repeatedly sums the decimal digits of the non-negative integer `n` until a single digit remains, and returns it.",
        tests: &[
            "assert digit_sum(0) == 0",
            "assert digit_sum(38) == 2",
            "assert digit_sum(9999) == 9",
            "assert digit_sum(10 ** 100) == 1",
        ],
        reference: "def digit_sum(n):\n    while n >= 10:\n        n = sum(int(d) for d in str(n))\n    return n\n",
    },
    Builtin {
        name: "count_vowels",
        entry_point: "count_vowels",
        prompt: "Write a Python function `count_vowels(text)` that returns how many characters of `text` are vowels a, e, i, o, u (either case).",
        tests: &[
            "assert count_vowels('Hello World') == 3",
            "assert count_vowels('') == 0",
            "assert count_vowels('rhythm') == 0",
            "assert count_vowels('AEIOUaeiou') == 10",
        ],
        reference: "def count_vowels(text):\n    return sum(1 for c in text if c in 'aeiouAEIOU')\n",
    },
    Builtin {
        name: "chunk_list",
        entry_point: "chunk_list",
        prompt: "Write a Python function `chunk_list(items, size)` that splits `items` into consecutive lists of length `size` (the last may be shorter). Raise ValueError when size < 1.",
        tests: &[
            "assert chunk_list([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]",
            "assert chunk_list([], 3) == []",
            "assert chunk_list([1, 2], 5) == [[1, 2]]",
            "try:\n    chunk_list([1], 0)\n    raise AssertionError('expected ValueError')\nexcept ValueError:\n    pass",
        ],
        reference: "def chunk_list(items, size):\n    if size < 1:\n        raise ValueError('size must be >= 1')\n    return [list(items[i:i + size]) for i in range(0, len(items), size)]\n",
    },
    Builtin {
        name: "second_largest",
        entry_point: "second_largest",
        prompt: "Write a Python function `second_largest(numbers)` that returns the second largest distinct value in the list, or None when there are fewer than two distinct values.",
        tests: &[
            "assert second_largest([3, 1, 4, 1, 5]) == 4",
            "assert second_largest([5, 5, 5]) is None",
            "assert second_largest([]) is None",
            "assert second_largest([-1, -2]) == -2",
            "assert second_largest([7, 7, 3]) == 3",
        ],
        reference: "def second_largest(numbers):\n    distinct = sorted(set(numbers))\n    return distinct[-2] if len(distinct) >= 2 else None\n",
    },
    Builtin {
        name: "rotate_list",
        entry_point: "rotate_list",
        prompt: "Write a Python function `rotate_list(items, k)` that returns a new list rotated right by k positions (k may be negative or larger than the length).",
        tests: &[
            "assert rotate_list([1, 2, 3, 4, 5], 2) == [4, 5, 1, 2, 3]",
            "assert rotate_list([1, 2, 3], -1) == [2, 3, 1]",
            "assert rotate_list([1, 2, 3], 7) == [3, 1, 2]",
            "assert rotate_list([], 3) == []",
        ],
        reference: "def rotate_list(items, k):\n    if not items:\n        return []\n    k %= len(items)\n    return items[-k:] + items[:-k] if k else list(items)\n",
    },
    Builtin {
        name: "valid_ipv4",
        entry_point: "valid_ipv4",
        prompt: "Write a Python function `valid_ipv4(address)` that returns True when `address` is four decimal numbers 0-255 separated by dots, with no leading zeros (except '0' itself) and no other characters.",
        tests: &[
            "assert valid_ipv4('192.168.1.1') is True",
            "assert valid_ipv4('255.255.255.255') is True",
            "assert valid_ipv4('256.1.1.1') is False",
            "assert valid_ipv4('01.2.3.4') is False",
            "assert valid_ipv4('1.2.3') is False",
            "assert valid_ipv4('1.2.3.4 ') is False",
            "assert valid_ipv4('0.0.0.0') is True",
        ],
        reference: "def valid_ipv4(address):\n    parts = address.split('.')\n    if len(parts) != 4:\n        return False\n    for p in parts:\n        if not p or not all('0' <= c <= '9' for c in p):\n            return False\n        if len(p) > 1 and p[0] == '0':\n            return False\n        if int(p) > 255:\n            return False\n    return True\n",
    },
    Builtin {
        name: "title_case",
        entry_point: "title_case",
        prompt: "Write a Python function `title_case(text)` that capitalizes the first letter of every space-separated word and lower-cases the rest, keeping the spaces exactly as they are.",
        tests: &[
            "assert title_case('hello world') == 'Hello World'",
            "assert title_case('hELLO  wORLD') == 'Hello  World'",
            "assert title_case('') == ''",
            "assert title_case(' a') == ' A'",
        ],
        reference: "def title_case(text):\n    return ' '.join(w[:1].upper() + w[1:].lower() for w in text.split(' '))\n",
    },
    Builtin {
        name: "dedupe_preserve_order",
        entry_point: "dedupe_preserve_order",
        prompt: "Write a Python function `dedupe_preserve_order(items)` that returns the items with duplicates removed, keeping the first occurrence of each, in order.",
        tests: &[
            "assert dedupe_preserve_order([3, 1, 3, 2, 1]) == [3, 1, 2]",
            "assert dedupe_preserve_order([]) == []",
            "assert dedupe_preserve_order(['a', 'A', 'a']) == ['a', 'A']",
            "assert dedupe_preserve_order(list(range(100000)) * 2) == list(range(100000))",
        ],
        reference: "def dedupe_preserve_order(items):\n    seen = set()\n    out = []\n    for x in items:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out\n",
    },
    Builtin {
        name: "count_islands",
        entry_point: "count_islands",
        prompt: "Write a Python function `count_islands(grid)` that counts the groups of '1' cells connected horizontally or vertically in a grid given as a list of strings of '0' and '1'.",
        tests: &[
            "assert count_islands(['11000', '11000', '00100', '00011']) == 3",
            "assert count_islands([]) == 0",
            "assert count_islands(['0']) == 0",
            "assert count_islands(['101', '010', '101']) == 5",
            "assert count_islands(['1' * 300] * 300) == 1",
        ],
        reference: "def count_islands(grid):\n    seen = set()\n    count = 0\n    for r in range(len(grid)):\n        for c in range(len(grid[r])):\n            if grid[r][c] == '1' and (r, c) not in seen:\n                count += 1\n                stack = [(r, c)]\n                seen.add((r, c))\n                while stack:\n                    y, x = stack.pop()\n                    for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):\n                        if 0 <= ny < len(grid) and 0 <= nx < len(grid[ny]) and grid[ny][nx] == '1' and (ny, nx) not in seen:\n                            seen.add((ny, nx))\n                            stack.append((ny, nx))\n    return count\n",
    },
    Builtin {
        name: "parse_key_values",
        entry_point: "parse_key_values",
        prompt: "Write a Python function `parse_key_values(text)` that parses 'key=value' pairs separated by ';' into a dict. Strip whitespace around keys and values, skip empty segments, and let later keys overwrite earlier ones.",
        tests: &[
            "assert parse_key_values('a=1; b = 2') == {'a': '1', 'b': '2'}",
            "assert parse_key_values('') == {}",
            "assert parse_key_values('x=1;;x=2;') == {'x': '2'}",
            "assert parse_key_values('url=http://h/?q=1') == {'url': 'http://h/?q=1'}",
        ],
        reference: "def parse_key_values(text):\n    out = {}\n    for seg in text.split(';'):\n        if not seg.strip():\n            continue\n        key, _, value = seg.partition('=')\n        out[key.strip()] = value.strip()\n    return out\n",
    },
    Builtin {
        name: "binary_to_decimal",
        entry_point: "binary_to_decimal",
        prompt: "Write a Python function `binary_to_decimal(bits)` that converts a string of '0'/'1' characters to its integer value without calling int(bits, 2). Raise ValueError on any other character or an empty string.",
        tests: &[
            "assert binary_to_decimal('101') == 5",
            "assert binary_to_decimal('0') == 0",
            "assert binary_to_decimal('1' * 64) == 2 ** 64 - 1",
            "try:\n    binary_to_decimal('102')\n    raise AssertionError('expected ValueError')\nexcept ValueError:\n    pass",
            "try:\n    binary_to_decimal('')\n    raise AssertionError('expected ValueError')\nexcept ValueError:\n    pass",
        ],
        reference: "def binary_to_decimal(bits):\n    if not bits:\n        raise ValueError('empty')\n    value = 0\n    for c in bits:\n        if c not in '01':\n            raise ValueError(c)\n        value = value * 2 + (c == '1')\n    return value\n",
    },
];

/// The built-in task set (ids `builtin/<name>`), written for this project. Each prompt names
/// the function and asks for a fenced code block.
pub fn builtin_tasks() -> Vec<CodeTask> {
    BUILTINS
        .iter()
        .map(|b| CodeTask {
            id: format!("builtin/{}", b.name),
            prompt: format!("{}\n{SUFFIX}", b.prompt),
            entry_point: b.entry_point.to_string(),
            tests: b.tests.iter().map(|t| t.to_string()).collect(),
        })
        .collect()
}

/// `(task id, reference solution)` for every built-in task: proof that each is solvable, and
/// handy for smoke-testing a recipe's reward path.
pub fn builtin_reference_solutions() -> Vec<(String, String)> {
    BUILTINS
        .iter()
        .map(|b| (format!("builtin/{}", b.name), b.reference.to_string()))
        .collect()
}
