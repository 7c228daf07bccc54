"""TextTracker (incremental detokenisation + stop strings) with the real tiny tokenizer."""

import pytest

from tandem.inference.stop import TextTracker, decoder
from tandem.models.tokenizer import train_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


TEXTS = ["Reverse the following text: hello", "naïve café — 日本語 🚀 done", "a\nb  c\t{}"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_decoding_all(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    tracker = TextTracker(tokenizer)
    streamed = ""
    for token in ids:
        assert tracker.add([token]) == 1
        streamed += tracker.take_delta()
        assert "\ufffd" not in streamed  # never hands out half a character
    tracker.finish()
    streamed += tracker.take_delta(final=True)
    assert streamed == tracker.text == tokenizer.decode(ids) == text


def test_decoder_gives_the_tokenizers_text(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[1]) + [tokenizer.eos_token_id] + tokenizer.encode(TEXTS[2])
    decode = decoder(tokenizer)
    assert decode is not tokenizer.decode  # (the backend's: this tokenizer cleans up no spaces)
    for skip in (True, False):
        assert decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)


def test_lazy_mode_decodes_once_at_the_end(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[1])
    tracker = TextTracker(tokenizer, incremental=False)
    assert tracker.add(ids) == len(ids) and tracker.text == ""
    tracker.finish()
    assert tracker.text == TEXTS[1]


def test_stop_string_cuts_text_and_drops_later_tokens(tokenizer) -> None:
    text = "first line\nsecond line\nthird"
    ids = tokenizer.encode(text)
    tracker = TextTracker(tokenizer, stop=["\nsec", "never"])
    used = tracker.add(ids)
    assert tracker.stopped_by == "\nsec" and tracker.text == "first line"
    kept = ids[:used]
    assert "\nsec" in tokenizer.decode(kept) and "\nsec" not in tokenizer.decode(kept[:-1])
    assert tracker.add([5]) == 0  # nothing is taken after a stop


def test_earliest_of_several_stop_strings_wins_and_include_stop(tokenizer) -> None:
    ids = tokenizer.encode("abc STOP xyz END")
    tracker = TextTracker(tokenizer, stop=["END", "STOP"], include_stop=True)
    tracker.add(ids)
    assert tracker.text == "abc STOP" and tracker.stopped_by == "STOP"


def test_stop_string_spanning_many_tokens_and_a_multibyte_character(tokenizer) -> None:
    ids = tokenizer.encode("weather: 🚀🚀 launch")
    tracker = TextTracker(tokenizer, stop=["🚀 la"])
    for token in ids:
        tracker.add([token])
    assert tracker.text == "weather: 🚀" and tracker.stopped_by == "🚀 la"


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer) -> None:
    tracker = TextTracker(tokenizer, stop=["<END>"])
    deltas = []
    for token in tokenizer.encode("one <EN two <END> three"):
        tracker.add([token])
        deltas.append(tracker.take_delta())
        assert not "".join(deltas).endswith(("<", "<E", "<EN", "<END"))
    assert "".join(deltas) + tracker.take_delta(final=True) == "one <EN two "


@pytest.mark.parametrize("incremental", [True, False])
def test_the_ending_token_leaves_the_text_unless_include_stop(tokenizer, incremental: bool) -> None:
    """A sample ended by its end-of-sequence (or a stop) token: with skip_special_tokens = false
    the token's text is not part of the answer, as in vLLM (tool-call parsers read the text)."""
    ids = tokenizer.encode("answer") + [tokenizer.eos_token_id]
    for include_stop, expected in [(False, "answer"), (True, "answer<|im_end|>")]:
        tracker = TextTracker(
            tokenizer, include_stop=include_stop, skip_special_tokens=False, incremental=incremental
        )
        tracker.add(ids)
        tracker.finish(ended_by_token=True)
        assert tracker.text == expected
    tracker = TextTracker(tokenizer, skip_special_tokens=False, incremental=incremental)
    tracker.add(ids)
    tracker.finish()  # ended by length: the text is what was sampled
    assert tracker.text == "answer<|im_end|>"
