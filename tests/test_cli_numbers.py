"""Every number option of every command: ASCII numerals only, 64-bit integers, exit 2 on bad
text before anything runs. The options are found by walking the real parser, so an option added
later is covered without touching this file."""

from __future__ import annotations

import argparse

import pytest

from dsa_async.cli import build_parser, main, numbers

def _is_integer_type(kind) -> bool:
    try:
        kind("1.5")
    except argparse.ArgumentTypeError:
        return True
    return False


def _number_options() -> list[tuple[str, str, bool]]:
    """(command, option, is_integer) for every option parsed by one of the CLI's own types
    (all of them numbers but the workload spec)."""
    found = []
    subparsers = next(a for a in build_parser()._actions
                      if isinstance(a, argparse._SubParsersAction))
    for command, parser in subparsers.choices.items():
        for action in parser._actions:
            kind = action.type
            if (callable(kind) and getattr(kind, "__module__", "").startswith("dsa_async.cli")
                    and kind.__name__ != "workload"):
                found.append((command, action.option_strings[0], _is_integer_type(kind)))
    return found


OPTIONS = _number_options()


def test_the_walk_finds_the_number_options_of_both_commands():
    names = {(command, option) for command, option, _ in OPTIONS}
    assert {option for _, option, is_int in OPTIONS if is_int} >= {
        "--ranks-per-host", "--seed", "--layers", "--device-pages", "--metrics-port",
        "--compute-dim"}
    assert {("plan", "--host-pool-gb"), ("plan", "--ranks-per-host"), ("plan", "--reserve-gb"),
            ("serve", "--seed"), ("serve", "--layers"), ("serve", "--duration-s"),
            ("serve", "--metrics-port"), ("serve", "--arrival-rate")} <= names


def _args(command: str, option: str, value: str) -> list[str]:
    """The option with ``value``; anything else a short, small run (should the value be
    taken after all, the test fails instead of running a service until stopped)."""
    rest = {"plan": {"--host-pool-gb": "1"},
            "serve": {"--backend": "cpu", "--duration-s": "0.5", "--layers": "2",
                      "--device-pages": "8", "--host-pool-gb": "0.01"}}.get(command, {})
    args = [command, option, value]
    for name, default in rest.items():
        if name != option:
            args += [name, default]
    return args + (["--quiet"] if command == "serve" else [])


@pytest.mark.parametrize("numeral", ["\u0663", "\uff13", "\u0969", "\U0001d7d1"],
                         ids=["arabic-indic", "fullwidth", "devanagari", "math-bold"])
@pytest.mark.parametrize(("command", "option", "is_int"), OPTIONS,
                         ids=[f"{c}{o}" for c, o, _ in OPTIONS])
def test_numerals_of_other_scripts_are_not_numbers(command, option, is_int, numeral, capsys):
    """Python's int()/float() read '٣' as 3: an option must not take it by accident."""
    assert main(_args(command, option, numeral)) == 2
    err = capsys.readouterr().err
    assert f"argument {option}: " in err and "ASCII digits" in err, err


@pytest.mark.parametrize(("command", "option", "is_int"),
                         [o for o in OPTIONS if o[2]], ids=[f"{c}{o}" for c, o, i in OPTIONS if i])
def test_integers_beyond_64_bits_are_out_of_range(command, option, is_int, capsys):
    assert main(_args(command, option, str(2**64))) == 2  # beyond 64 bits, signed or not
    assert "is out of range: use " in capsys.readouterr().err


@pytest.mark.parametrize("text", ["1", " 3 ", "+7", "1_000", "0012"])
def test_ascii_integers_parse_as_python_reads_them(text):
    assert numbers.positive_int(text) == int(text)


@pytest.mark.parametrize("text", ["1_", "_1", "1__0", "1.0", "0x10", "", " ", "1 2"])
def test_malformed_integers_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not an integer"):
        numbers.positive_int(text)


@pytest.mark.parametrize("parse", [numbers.host_pool_bytes, numbers.reserve_bytes])
@pytest.mark.parametrize("text", ["1e10", "9.3e9", "1e299", "1e300", "1.7e308"])
def test_a_size_beyond_64_bits_of_bytes_is_refused_naming_the_largest(parse, text):
    # however large, a finite size gets the same reason (1e300 GB overflows to inf bytes)
    with pytest.raises(argparse.ArgumentTypeError, match="use at most 9,223,372,036 GB"):
        parse(text)


def test_the_largest_pool_named_is_accepted():
    assert numbers.host_pool_bytes("9223372036") == 9223372036 * 10**9
