"""How a generated answer is scored against its reference: exact match, surrounding whitespace
aside. The one rule that held-out accuracy (both tasks), ``slmoe-generate`` and the shapes task's
scoring by question kind share."""

from __future__ import annotations


def exact_match(answer: str, reference: str) -> bool:
    return answer.strip() == reference.strip()
