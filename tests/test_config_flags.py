"""specmask.common.config_flags: a field's flag parses to the field's type, or the parser is not built."""

from __future__ import annotations

import argparse
import enum
from dataclasses import dataclass, field

import pytest

from specmask.common.config_flags import ConfigFlags, flag


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


def _port(value: int) -> int | None:
    return None if value == -1 else value


def _split(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


@dataclass(frozen=True)
class Sample:
    needed: str = field(metadata=flag("a field without a default is a required flag", name="--need"))
    count: int = field(default=3, metadata=flag("an int", aliases=("--n",)))
    ratio: float | None = field(default=None, metadata=flag("an optional float"))
    colour: Colour = field(default=Colour.RED, metadata=flag("an enum"))
    shade: Colour | None = field(default=None, metadata=flag("an optional enum"))
    loud: bool = field(default=False, metadata=flag("a bool"))
    tags: tuple[str, ...] = field(default=(), metadata=flag("repeatable", name="--tag"))
    hosts: tuple[str, ...] = field(default=("a",), metadata=flag("comma list", convert=_split, cli_default="a"))
    port: int | None = field(default=None, metadata=flag("-1 = off", convert=_port, cli_default=-1))
    mode: str = field(default="x", metadata=flag("a str with choices", choices=("x", "y")))
    widths: tuple[int, ...] = field(default=(), metadata=flag("repeatable, each read", name="--width", each=int))
    unflagged: int = 0  # no flag: set in code only


def _parse(flags: ConfigFlags, argv: list[str]) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    flags.add_to(parser)
    return flags.values(parser.parse_args(argv))


def test_defaults_come_back_as_the_fields_defaults() -> None:
    got = _parse(ConfigFlags(Sample), ["--need", "n"])
    want = Sample(needed="n")
    assert got == {name: getattr(want, name) for name in got}
    assert "unflagged" not in got and Sample(**got) == want  # type: ignore[arg-type]


def test_each_kind_of_field_parses_to_its_type() -> None:
    argv = ["--need", "n", "--n", "5", "--ratio", "0.5", "--colour", "blue", "--shade", "red", "--loud"]
    argv += ["--tag", "é", "--tag", "b", "--hosts", " h1 ,, h2 ", "--port", "0", "--mode", "y"]
    argv += ["--width", "3", "--width", "-1"]
    got = _parse(ConfigFlags(Sample), argv)
    assert got == {
        "needed": "n",
        "count": 5,
        "ratio": 0.5,
        "colour": Colour.BLUE,
        "shade": Colour.RED,
        "loud": True,
        "tags": ("é", "b"),
        "hosts": ("h1", "h2"),
        "port": 0,
        "mode": "y",
        "widths": (3, -1),
    }
    assert _parse(ConfigFlags(Sample, ["loud"]), ["--no-loud"]) == {"loud": False}


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--need", "n", "--colour", "green"],
        ["--need", "n", "--mode", "z"],
        ["--need", "n", "--count", "1.5"],
        ["--need", "n", "--ratio", "nan"],
        ["--need", "n", "--ratio", "-NaN"],
    ],
)
def test_bad_command_lines_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(ConfigFlags(Sample), argv)


def test_a_command_may_rename_default_and_explain_a_flag() -> None:
    flags = ConfigFlags(Sample, ["count", "port"], names={"port": "--grpc-port"}, defaults={"port": 9})
    parser = argparse.ArgumentParser()
    flags.add_to(parser)
    assert flags.values(parser.parse_args([])) == {"count": 3, "port": 9}
    assert flags.values(parser.parse_args(["--grpc-port", "-1"])) == {"count": 3, "port": None}
    with pytest.raises(SystemExit):
        parser.parse_args(["--port", "1"])  # renamed on this command


def test_unsupported_types_and_unknown_fields_fail_when_the_parser_is_built() -> None:
    @dataclass(frozen=True)
    class Odd:
        pairs: dict[str, int] = field(default_factory=dict, metadata=flag("no flag type for a dict"))

    with pytest.raises(TypeError, match=r"Odd\.pairs"):
        ConfigFlags(Odd)

    @dataclass(frozen=True)
    class Preset:
        sizes: tuple[int, ...] = field(default=(1,), metadata=flag("argparse would add to it", each=int))

    with pytest.raises(TypeError, match=r"Preset\.sizes: a repeated flag's default must be empty"):
        ConfigFlags(Preset)
    with pytest.raises(TypeError, match=r"Sample\.tags: a repeated flag's default must be empty"):
        ConfigFlags(Sample, ["tags"], defaults={"tags": ["x"]})

    @dataclass(frozen=True)
    class Needed:
        sizes: tuple[int, ...] = field(metadata=flag("required, each read", each=int))

    parser = argparse.ArgumentParser()
    ConfigFlags(Needed).add_to(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([])  # no default: the flag must be given
    with pytest.raises(ValueError):  # a value ``each`` refuses is a bad configuration, read back
        ConfigFlags(Needed).values(parser.parse_args(["--sizes", "x"]))
    with pytest.raises(TypeError, match="unflagged"):
        ConfigFlags(Sample, ["unflagged"])
    with pytest.raises(TypeError, match="not added"):
        ConfigFlags(Sample, ["count"], defaults={"ratio": 1.0})
