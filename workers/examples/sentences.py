"""Split prose into sentences and pick the most informative ones: pure and deterministic,
so a summary can be recomputed and compared byte for byte."""

import re
from collections import Counter

# CJK full stop, exclamation and question marks, escaped because they look like ASCII.
_CJK_TERMINATORS = "\u3002\uff01\uff1f"
# Closing quotes and brackets (ASCII, curly, CJK corner, fullwidth) stay with the sentence.
_CLOSERS = "\"')\\]\u201d\u2019\u300d\u300f\uff09"
_TERMINATOR = re.compile(rf"(?P<punct>[.!?\u2026]+|[{_CJK_TERMINATORS}]+)[{_CLOSERS}]*")
# Abbreviations that are practically never the last word of a sentence: split never.
_ALWAYS_CONTINUE = frozenset({"e.g", "i.e", "mr", "mrs", "ms", "dr", "prof", "vs", "cf"})
# Abbreviations that may end a sentence: split only if the next word is not lowercase.
_MAY_END = frozenset({"etc", "al", "inc", "ltd", "co"})
_SPACES = re.compile(r"\s*")
_ABBREVIATION = re.compile(r"(?:[A-Za-z]\.)*[A-Za-z]+$")

_WORD = re.compile(r"[^\W\d_]+")
_STOP_WORDS = frozenset({
    "a", "about", "after", "all", "also", "an", "and", "any", "are", "as", "at", "be", "been",
    "but", "by", "can", "could", "did", "do", "does", "for", "from", "had", "has", "have", "he",
    "her", "his", "how", "i", "if", "in", "into", "is", "it", "its", "may", "more", "most", "no",
    "not", "of", "on", "or", "our", "she", "so", "than", "that", "the", "their", "them", "then",
    "there", "these", "they", "this", "those", "to", "was", "we", "were", "what", "when", "which",
    "who", "will", "with", "would", "you", "your",
})  # fmt: skip


def split_sentences(text: str) -> list[str]:
    """Split ``text`` into trimmed sentences that keep their terminal punctuation."""
    sentences: list[str] = []
    start = 0
    for match in _TERMINATOR.finditer(text):
        if _ends_sentence(text, match):
            sentences.append(text[start : match.end()].strip())
            start = match.end()
    sentences.append(text[start:].strip())
    return [sentence for sentence in sentences if sentence]


def _ends_sentence(text: str, match: re.Match[str]) -> bool:
    punct = match["punct"]
    if punct[0] in _CJK_TERMINATORS:
        # CJK prose has no spaces between sentences, so the mark alone decides.
        return True
    # Read by index: a copy of the text after each mark made a text of marks quadratic.
    end = match.end()
    if end < len(text) and not text[end].isspace():
        # "3.14", the inner dot of "e.g." and URLs continue without a space.
        return False
    spaces = _SPACES.match(text, end)
    after = spaces.end() if spaces else end
    next_char = text[after : after + 1]
    if not next_char:
        return True
    if punct.startswith("..") or "\u2026" in punct:
        # An ellipsis trails off mid-sentence unless a capital starts a new one.
        return next_char.isupper()
    if punct == ".":
        # A short look-back suffices: the longest abbreviation is four letters.
        word = _ABBREVIATION.search(text[max(0, match.start() - 8) : match.start()])
        abbreviation = word[0].lower() if word else ""
        if abbreviation in _ALWAYS_CONTINUE:
            return False
        if abbreviation in _MAY_END:
            return not next_char.islower()
    return True


def summarize(sentences: list[str], max_sentences: int) -> list[str]:
    """Return the ``max_sentences`` highest-scoring sentences, in their original order.

    A sentence scores the mean corpus frequency of its content words, so it ranks by how
    central its vocabulary is rather than by sheer length. Ties go to the earlier one.
    """
    if max_sentences < 0:
        raise ValueError("max_sentences must not be negative")
    words = [_content_words(sentence) for sentence in sentences]
    frequency = Counter(word for sentence_words in words for word in sentence_words)

    def score(index: int) -> float:
        found = words[index]
        return sum(frequency[word] for word in found) / len(found) if found else 0.0

    ranked = sorted(range(len(sentences)), key=lambda index: (-score(index), index))
    return [sentences[index] for index in sorted(ranked[:max_sentences])]


def _content_words(sentence: str) -> list[str]:
    return [w for w in (m.lower() for m in _WORD.findall(sentence)) if w not in _STOP_WORDS]
