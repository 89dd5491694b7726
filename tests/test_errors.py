"""The library's errors name its parameters; each front end rewords them in the names its user typed."""

from __future__ import annotations

import pytest

from sparsespec.errors import ConfigError, UserError, reworded, user_message

FLAGS = {"gamma": "--gamma", "budget": "--budget", "sinks": "--sinks"}


def test_a_config_error_names_the_parameters_and_a_front_end_its_flags():
    error = ConfigError("{sinks} {s} exceed {budget} {b}.", s=8, b=4)
    assert str(error) == "sinks 8 exceed budget 4." and error.params == ("sinks", "budget")
    assert user_message(error, FLAGS) == "--sinks 8 exceed --budget 4."
    assert error.render({"sinks": "--draft-sinks"}) == "--draft-sinks 8 exceed budget 4."  # unnamed: as it is
    assert isinstance(error, UserError)


def test_values_are_text_even_with_braces():
    error = ConfigError("{gamma} must be an integer (got {value!r}).", value="{budget}")
    assert error.params == ("gamma",)
    assert user_message(error, FLAGS) == "--gamma must be an integer (got '{budget}')."


def test_other_errors_keep_their_message():
    assert user_message(UserError("--prompt is empty."), FLAGS) == "--prompt is empty."
    assert user_message(ValueError("bad"), FLAGS) == "bad"


def test_an_error_after_the_clause_that_led_to_it():
    inner = ConfigError("{budget} {b} is too small.", b=2)
    outer = inner.after("{gamma} {g} leaves {left} slots: ", g=3, left=2)
    assert user_message(outer, FLAGS) == "--gamma 3 leaves 2 slots: --budget 2 is too small."
    with pytest.raises(TypeError):
        inner.after("{b} again: ", b=5)  # one value, two meanings


def test_reworded_turns_a_config_error_into_the_front_ends_sentence():
    with pytest.raises(UserError) as info, reworded({"budget": "--draft-budget"}):
        raise ConfigError("{budget} must not be negative (got {value}).", value=-1)
    assert str(info.value) == "--draft-budget must not be negative (got -1)."
    assert not isinstance(info.value, ConfigError)  # worded once, by the one who knew the flags
