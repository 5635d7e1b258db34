"""Unit tests for sentence splitting and frequency summaries, read as given/when/expect."""

import pytest

from workers.examples.sentences import split_sentences, summarize

# --- split_sentences -----------------------------------------------------------------------


def test_given_prose_when_split_expect_sentences_with_their_punctuation() -> None:
    text = "Hello world. How are you? I am fine!"
    assert split_sentences(text) == ["Hello world.", "How are you?", "I am fine!"]


def test_given_surrounding_whitespace_and_newlines_expect_trimmed_sentences() -> None:
    text = "  First one.\n\n   Second one!  \n"
    assert split_sentences(text) == ["First one.", "Second one!"]


@pytest.mark.parametrize("text", ["", "   ", "\n\t\n"])
def test_given_empty_or_blank_text_expect_no_sentences(text: str) -> None:
    assert split_sentences(text) == []


def test_given_trailing_text_without_terminator_expect_it_kept() -> None:
    assert split_sentences("Done. And then") == ["Done.", "And then"]


def test_given_cjk_terminators_expect_split_without_spaces() -> None:
    text = "你好。我很好！真的吗？"  # noqa: RUF001
    assert split_sentences(text) == ["你好。", "我很好！", "真的吗？"]  # noqa: RUF001


def test_given_mixed_scripts_expect_both_terminator_sets() -> None:
    assert split_sentences("Hi there. 你好。Bye!") == ["Hi there.", "你好。", "Bye!"]


def test_given_repeated_terminators_expect_them_kept_together() -> None:
    assert split_sentences("Really?! Yes!!! Ok.") == ["Really?!", "Yes!!!", "Ok."]


def test_given_a_closing_quote_expect_it_stays_with_its_sentence() -> None:
    assert split_sentences('He said "Stop." Then he left.') == ['He said "Stop."', "Then he left."]


@pytest.mark.parametrize(
    "sentence",
    [
        "Bring tools, e.g. hammers and saws.",
        "Bring tools, i.e. Hammers only.",
        "Mr. Smith met Mrs. Jones.",
        "Ask Dr. Who about it.",
        "Apples, pears, etc. are fruit.",
    ],
)
def test_given_an_abbreviation_inside_a_sentence_expect_no_split(sentence: str) -> None:
    assert split_sentences(f"{sentence} Next one.") == [sentence, "Next one."]


def test_given_etc_followed_by_a_capital_expect_a_split() -> None:
    text = "We ate apples, pears etc. Then we left."
    assert split_sentences(text) == ["We ate apples, pears etc.", "Then we left."]


def test_given_decimals_expect_no_split() -> None:
    text = "Pi is about 3.14 and e is 2.718. Both are irrational."
    assert split_sentences(text) == ["Pi is about 3.14 and e is 2.718.", "Both are irrational."]


@pytest.mark.parametrize("ellipsis", ["...", "…"])
def test_given_an_ellipsis_inside_a_sentence_expect_no_split(ellipsis: str) -> None:
    text = f"Wait{ellipsis} what happened? Nothing."
    assert split_sentences(text) == [f"Wait{ellipsis} what happened?", "Nothing."]


def test_given_an_ellipsis_before_a_capital_or_at_the_end_expect_a_split() -> None:
    text = "I waited... Then he came... "
    assert split_sentences(text) == ["I waited...", "Then he came..."]


# --- summarize -----------------------------------------------------------------------------

SENTENCES = ["The weather is mild.", "Mice fear cats.", "Cats purr."]


def test_given_sentences_when_summarized_expect_top_scorers_in_original_order() -> None:
    # "cats" occurs twice, so "Cats purr." scores highest and "Mice fear cats." second;
    # the result keeps document order, not score order.
    assert summarize(SENTENCES, 2) == ["Mice fear cats.", "Cats purr."]


def test_given_stop_words_expect_they_do_not_score() -> None:
    sentences = ["The the the and of.", "Rust compiles.", "Rust is fast."]
    assert summarize(sentences, 1) == ["Rust compiles."]


def test_given_tied_scores_expect_the_earlier_sentence() -> None:
    assert summarize(["Alpha beta.", "Gamma delta."], 1) == ["Alpha beta."]


def test_given_max_at_least_the_count_expect_all_in_order() -> None:
    assert summarize(SENTENCES, 10) == SENTENCES


def test_given_zero_or_no_sentences_expect_empty() -> None:
    assert summarize(SENTENCES, 0) == []
    assert summarize([], 3) == []


def test_given_a_negative_max_expect_value_error() -> None:
    with pytest.raises(ValueError):
        summarize(SENTENCES, -1)


def test_given_the_same_input_twice_expect_the_same_summary() -> None:
    text = "Cats purr. Dogs bark at cats. Birds sing. Cats and dogs sleep. Fish swim."
    sentences = split_sentences(text)
    assert summarize(sentences, 2) == summarize(list(sentences), 2)


def test_given_the_input_list_expect_it_is_not_mutated() -> None:
    sentences = list(SENTENCES)
    summarize(sentences, 1)
    assert sentences == SENTENCES


def test_a_text_of_marks_splits_at_each_mark_before_a_space_and_none_without() -> None:
    """Each mark copied the rest of the text to look after it (quadratic: a text of 500 KB
    took 16 s)."""
    assert split_sentences("?a" * 50_000) == ["?a" * 50_000]
    assert split_sentences("Why? " * 3 + "Done.") == ["Why?"] * 3 + ["Done."]
    assert split_sentences("Wait...   then more.") == ["Wait...   then more."]
