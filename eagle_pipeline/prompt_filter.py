"""Which self-written user turns become training prompts, and what topic each is about.

A sampled user turn is dropped when it is
- too short or too long (data.self_written.min_words / max_words), or cut off at its token budget;
- really an answer: it opens like a reply ("Sure, here is ..."), is laid out as a list, or carries chat
  markup (the model wrote past its turn);
- a duplicate of a kept one: the same normalised text (case, punctuation, spacing ignored), or a near
  duplicate, the same set of content words (word order, stop words and plurals ignored as well);
- overlapping the eval prompts, which must stay held out: the same text or content words as one, or
  every content word of an eval topic ("acids and bases": acid, base) among its own.

A kept turn's topic (for the validation split by topic) is its first content word: the thing a request
is about usually comes first once the request words ("explain", "write", "tips", ...) are removed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

# Function words, request words and the forms a request asks for: none of them says what it is about.
STOP_WORDS = frozenset("""
a an the of to in on for and or nor is are was were be been being am do does did doing have has had having
what how why when where which who whom whose can could would should will shall may might must
i me my mine myself you your yours yourself we us our they them their he him his she her it its this that
these those there here with without about above below from into onto at by as than then so but if not no
yes very too also just only some any each every all both more most much many few other another such same
please give write explain describe tell list make create help need want like know get use using show
between among up down out over under again further once am im ive id youre dont doesnt isnt cant
one two three four five ten simple short good best better way ways thing things something someone anyone
story paragraph essay poem haiku limerick summary tips facts questions question examples example steps
step explanation idea ideas key benefits drawbacks difference misconception common main interesting
everyday life matter sentences sentence few new kind type types lot lots really
""".split())

ANSWER_OPENERS = re.compile(
    r"^(sure|certainly|of course|absolutely|here is|here's|here are|great question|i'd be happy|i would be happy|"
    r"as an ai|hello! i|hi! i|thank you for|thanks for)\b", re.IGNORECASE)
LIST_LINE = re.compile(r"^\s*(\d+[.)]|[-*\u2022])\s+\S", re.MULTILINE)
CHAT_MARKUP = re.compile(r"<\||\|>|^\s*(assistant|user|system)\s*:", re.IGNORECASE | re.MULTILINE)


def normalise(text: str) -> str:
    """Lower case, letters and digits only, single spaces."""
    return " ".join(re.findall(r"[a-z0-9]+", text.lower().replace("'", "")))


def _stem(word: str) -> str:
    if len(word) > 4 and word.endswith("ies"):
        return word[:-3] + "y"
    if len(word) > 3 and word.endswith("s") and not word.endswith("ss"):
        return word[:-1]
    return word


def content_words(text: str) -> list[str]:
    """The words that say what a text is about, in order, stemmed (plurals folded)."""
    return [_stem(w) for w in normalise(text).split() if w not in STOP_WORDS and not w.isdigit() and len(w) > 1]


def topic_key(text: str) -> str:
    words = content_words(text)
    return words[0] if words else normalise(text) or "(none)"


def looks_like_answer(text: str) -> bool:
    return bool(ANSWER_OPENERS.match(text.strip()) or len(LIST_LINE.findall(text)) >= 2 or CHAT_MARKUP.search(text))


@dataclass
class PromptFilter:
    """Decides on sampled user turns one at a time; a kept turn is remembered for the duplicate checks."""

    min_words: int
    max_words: int
    eval_texts: set[str] = field(default_factory=set)
    eval_signatures: set[frozenset[str]] = field(default_factory=set)
    eval_topics: list[frozenset[str]] = field(default_factory=list)
    kept_texts: set[str] = field(default_factory=set)
    kept_signatures: set[frozenset[str]] = field(default_factory=set)

    @classmethod
    def against(cls, eval_prompts: Iterable[dict], min_words: int, max_words: int) -> "PromptFilter":
        """A filter that keeps clear of `eval_prompts` (load_prompts records: id, topic, messages)."""
        f = cls(min_words, max_words)
        for prompt in eval_prompts:
            text = prompt["messages"][-1]["content"]
            f.eval_texts.add(normalise(text))
            f.eval_signatures.add(frozenset(content_words(text)))
            # A prompt without a topic of its own (its topic is its id) is kept clear of by its words.
            topic = text if prompt["topic"] == prompt["id"] else prompt["topic"]
            words = frozenset(content_words(topic))
            if words:
                f.eval_topics.append(words)
        return f

    def verdict(self, text: str, finished: bool = True) -> str | None:
        """Why `text` is dropped, or None if it is kept (and then remembered)."""
        words = normalise(text).split()
        if not finished:
            return "unfinished"
        if len(words) < self.min_words:
            return "too_short"
        if len(words) > self.max_words:
            return "too_long"
        if looks_like_answer(text):
            return "answer_like"
        key, signature = " ".join(words), frozenset(content_words(text))
        if key in self.eval_texts or signature in self.eval_signatures or any(t <= signature for t in self.eval_topics):
            return "eval_overlap"
        if key in self.kept_texts:
            return "duplicate"
        if signature in self.kept_signatures:
            return "near_duplicate"
        self.kept_texts.add(key)
        self.kept_signatures.add(signature)
        return None
