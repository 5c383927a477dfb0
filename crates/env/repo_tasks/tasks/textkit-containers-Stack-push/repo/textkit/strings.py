"""String helpers."""


def slugify(text):
    """Lower-case `text`, turn every run of non-alphanumeric characters into one "-",
    and strip leading and trailing "-"."""
    out = []
    dash = False
    for ch in text.lower():
        if ch.isalnum():
            out.append(ch)
            dash = False
        elif not dash:
            out.append("-")
            dash = True
    return "".join(out).strip("-")


def caesar(text, shift):
    """Shift ASCII letters of `text` by `shift` places (wrapping, keeping case); other
    characters are unchanged."""
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - 97 + shift) % 26 + 97))
        elif "A" <= ch <= "Z":
            out.append(chr((ord(ch) - 65 + shift) % 26 + 65))
        else:
            out.append(ch)
    return "".join(out)


def word_counts(text):
    """A dict from each lower-cased whitespace-separated word of `text` to its count."""
    counts = {}
    for word in text.lower().split():
        counts[word] = counts.get(word, 0) + 1
    return counts


def is_palindrome(text):
    """Whether the letters and digits of `text`, lower-cased, read the same backwards."""
    chars = [c.lower() for c in text if c.isalnum()]
    return chars == chars[::-1]
