"""Text a tokenizer must never see: a hypothesis strategy for a text holding one lone surrogate, with the
words every path refuses it with (`tessel.text.check_text`)."""

from __future__ import annotations

from hypothesis import strategies as st

SURROGATES = st.integers(0xD800, 0xDFFF).map(chr)  # U+D800..U+DFFF: never valid alone
PLAIN = st.text(st.characters(codec="utf-8"), max_size=12)  # anything UTF-8 can encode


@st.composite
def lone_surrogate_texts(draw: st.DrawFn) -> tuple[str, str]:
    """(a text with one lone surrogate somewhere, what the refusal says of it)."""
    head, tail, bad = draw(PLAIN), draw(PLAIN), draw(SURROGATES)
    return head + bad + tail, f"lone surrogate U+{ord(bad):04X} at character {len(head)}"
