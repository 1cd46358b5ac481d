"""What arrives and when: a seeded multi-turn arrival model, and replay of recorded traces.

Both produce ``Conversation`` values in order of first arrival. A conversation is a shared
system prompt (or none) plus turns; each turn appends ``prompt_tokens + output_tokens`` tokens.
When a turn may start:

* model (closed loop): ``think_s`` after the conversation's previous turn finished (the first
  turn at the conversation's ``start_s``), as users answer a reply;
* trace (open loop): at ``arrival_s`` seconds after the run started, or once the previous turn
  of the same conversation finished if that is later.

Trace format: JSON lines, one turn each, e.g.
``{"arrival_s": 0.25, "conversation": "c17", "prompt_tokens": 120, "output_tokens": 40}``.
``arrival_s`` is a finite number >= 0, ``conversation`` a str or an int, the token counts ints
up to ``MAX_TURN_TOKENS`` (``prompt_tokens`` >= 1). Blank lines and lines starting with ``#``
are skipped; anything else that is not such an object is refused with a ``TraceError`` naming
the file, the line number, the field and the value.
"""

from __future__ import annotations

import json
import math
import os
import random
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, shortened, shown

TRACE_PREFIX = "trace:"
MULTITURN = "multiturn"


class TraceError(ConfigError):
    """A trace file that cannot be replayed; the message names the file and the line."""


@dataclass(frozen=True)
class SystemPrompt:
    """A prompt shared by many conversations: its tokens are cached once, in shared pages."""

    prompt_id: str
    tokens: int


@dataclass(frozen=True)
class Turn:
    prompt_tokens: int
    output_tokens: int
    think_s: float = 0.0  #: model: wait after the previous turn of the conversation finished
    arrival_s: float | None = None  #: trace: not before this many seconds after the start

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class Conversation:
    conversation_id: str
    start_s: float  #: first arrival, seconds after the run started
    system_prompt: SystemPrompt | None
    turns: tuple[Turn, ...]


# --- the seeded model ----------------------------------------------------------------------


@dataclass(frozen=True)
class MultiTurnModel:
    """Poisson arrivals of conversations over a few popular system prompts.

    Sizes scale with ``context_tokens``, the most one conversation may hold on the device:
    system prompts of 1/16 to 1/3 of it, prompts up to 1/6, outputs up to 1/8. Turns per
    conversation: 1 + geometric (mean ``mean_turns``); think time: exponential (mean
    ``mean_think_s``). System prompt popularity is Zipf-like, so a few are shared widely.
    Everything comes from ``random.Random(seed)``: the same seed gives the same conversations,
    whatever the run's timing.
    """

    seed: int
    context_tokens: int
    arrival_rate_per_s: float = 4.0
    system_prompts: int = 4
    mean_turns: float = 4.0
    mean_think_s: float = 1.0

    def __post_init__(self) -> None:
        if self.context_tokens < 128:
            raise ConfigError(f"context_tokens must be >= 128, got {self.context_tokens}")
        if not (self.arrival_rate_per_s > 0 and math.isfinite(self.arrival_rate_per_s)):
            raise ConfigError(f"arrival rate must be a positive number of conversations per "
                              f"second, got {self.arrival_rate_per_s}")
        if self.system_prompts < 1 or self.mean_turns < 1 or self.mean_think_s < 0:
            raise ConfigError("system_prompts and mean_turns must be >= 1, mean_think_s >= 0")

    def conversations(self) -> Iterator[Conversation]:
        """An endless, deterministic stream of conversations in arrival order."""
        rng = random.Random(self.seed)
        ctx = self.context_tokens
        prompts = tuple(
            SystemPrompt(f"system-{i}", rng.randint(max(64, ctx // 16), max(64, ctx // 3)))
            for i in range(self.system_prompts))
        weights = [1.0 / (i + 1) for i in range(len(prompts))]
        continue_p = 1.0 - 1.0 / self.mean_turns  # 1 + geometric turns with this mean
        clock = 0.0
        for number in range(1 << 62):
            clock += rng.expovariate(self.arrival_rate_per_s)
            prompt = rng.choices(prompts, weights)[0]
            turns = []
            while True:
                think = 0.0
                if turns and self.mean_think_s > 0:
                    think = rng.expovariate(1.0 / self.mean_think_s)
                turns.append(Turn(prompt_tokens=rng.randint(16, max(16, ctx // 6)),
                                  output_tokens=rng.randint(16, max(16, ctx // 8)),
                                  think_s=think))
                if rng.random() >= continue_p:
                    break
            yield Conversation(f"conversation-{number}", clock, prompt, tuple(turns))


# --- traces --------------------------------------------------------------------------------

_FIELDS = ("arrival_s", "conversation", "output_tokens", "prompt_tokens")
#: Most tokens one turn may name: far beyond any model's context; more is a corrupt line.
MAX_TURN_TOKENS = 2**31 - 1
_MAX_INT_DIGITS = 64  #: longer integer literals are kept as text (only an id may be one)


class _Literal(str):
    """A JSON number that is no usable number, kept as its text for the message: a float
    beyond a float's range (``1e400``), ``NaN`` or ``Infinity``."""


class _LongInt(_Literal):
    """An integer literal longer than any number here (``int()`` refuses beyond 4,300
    digits); only a conversation id may be one (kept as its text)."""


def _parse_int(text: str) -> int | _LongInt:
    return _LongInt(text) if len(text.lstrip("-")) > _MAX_INT_DIGITS else int(text)


def _parse_float(text: str) -> float | _Literal:
    value = float(text)
    return value if math.isfinite(value) else _Literal(text)


def _shown(value: object) -> str:
    """A trace value for a message: a kept literal as its text, anything else as ``shown``."""
    return shortened(value) if isinstance(value, _Literal) else shown(value)


class _RepeatedKey(Exception):
    """A JSON object names one key twice (``json`` would keep the last value silently)."""


def _no_repeated_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    record: dict[str, object] = {}
    for key, value in pairs:
        if key in record:
            raise _RepeatedKey(key)
        record[key] = value
    return record


def _parse_line(text: str, where: str) -> tuple[float, str, int, int]:
    try:
        record = json.loads(text, parse_int=_parse_int, parse_float=_parse_float,
                            parse_constant=_Literal, object_pairs_hook=_no_repeated_keys)
    except _RepeatedKey as exc:
        raise TraceError(f"{where}: key {shown(exc.args[0])} appears twice; give each field "
                         f"once") from None
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except RecursionError:
        raise TraceError(f"{where}: not a trace line (JSON nested too deeply)") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object with keys {sorted(_FIELDS)}, "
                         f"got {type(record).__name__}")
    missing = sorted(set(_FIELDS) - set(record))
    unknown = sorted(set(record) - set(_FIELDS))
    if missing or unknown:
        parts = ([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else [])
        raise TraceError(f"{where}: {' and '.join(parts)} keys; each line needs exactly "
                         f"{sorted(_FIELDS)}")
    arrival, conversation = record["arrival_s"], record["conversation"]
    prompt, output = record["prompt_tokens"], record["output_tokens"]
    if (isinstance(conversation, bool) or not isinstance(conversation, (str, int))
            or type(conversation) is _Literal):
        raise TraceError(f"{where}: conversation must be str or int, got {_shown(conversation)}")
    if (isinstance(arrival, bool) or not isinstance(arrival, (int, float))
            or isinstance(arrival, _Literal) or not arrival >= 0):
        raise TraceError(f"{where}: arrival_s must be a finite number >= 0 (seconds), "
                         f"got {_shown(arrival)}")
    for key, value, low in (("prompt_tokens", prompt, 1), ("output_tokens", output, 0)):
        if not (isinstance(value, _LongInt) or type(value) is int):
            raise TraceError(f"{where}: {key} must be int, got {_shown(value)}")
        if isinstance(value, _LongInt) or not low <= value <= MAX_TURN_TOKENS:
            raise TraceError(f"{where}: {key} must be >= {low} and <= {MAX_TURN_TOKENS:,}, "
                             f"got {_shown(value)}")
    return float(arrival), str(conversation), prompt, output


def parse_trace_lines(lines: Iterator[str] | list[str], name: str = "trace") -> tuple[Conversation, ...]:
    """Parse trace lines into conversations, ordered by first arrival (ties: first in file).

    Turns of one conversation keep their order by ``arrival_s`` (ties: file order). Raises
    ``TraceError`` naming ``name`` and the 1-based line number of the first bad line.
    """
    turns: dict[str, list[tuple[float, int, Turn]]] = {}
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        arrival, key, prompt, output = _parse_line(text, f"{name} line {number}")
        turns.setdefault(key, []).append(
            (arrival, number, Turn(prompt, output, arrival_s=arrival)))
    if not turns:
        raise TraceError(f"{name}: no turns (every line is blank or a comment)")
    conversations = []
    for key, rows in turns.items():
        rows.sort(key=lambda r: (r[0], r[1]))
        conversations.append((rows[0][0], rows[0][1], Conversation(
            key, rows[0][0], None, tuple(r[2] for r in rows))))
    conversations.sort(key=lambda c: (c[0], c[1]))
    return tuple(c[2] for c in conversations)


def parse_trace(path: str | Path) -> tuple[Conversation, ...]:
    """Read and parse a trace file (see the module docstring). Blocking file read.

    Only a regular file is read (a FIFO or a device would block or never end); lines end at
    ``\n`` alone (``\r\n`` too), so line numbers are those ``wc -l`` and editors count."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO: no wait
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                        else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
                raise TraceError(f"trace {str(path)!r} is {kind}; give a JSON-lines file")
            handle = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        with handle:
            return parse_trace_lines(_text_lines(handle, str(path)), str(path))
    except OSError as exc:
        raise TraceError(f"cannot read trace {str(path)!r}: {exc.strerror or exc}") from None


def _text_lines(handle, name: str) -> Iterator[str]:
    """The lines of a binary file as UTF-8 text, split at ``\n`` only; a line that is not
    UTF-8 is a ``TraceError`` naming it."""
    for number, raw in enumerate(handle, start=1):
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise TraceError(f"{name} line {number}: not UTF-8 text ({exc.reason} at byte "
                             f"{exc.start + 1} of the line)") from None


@dataclass(frozen=True)
class WorkloadSpec:
    """``multiturn`` or ``trace:PATH``, as ``--workload`` spells it."""

    trace_path: Path | None = None

    @classmethod
    def parse(cls, text: str) -> WorkloadSpec:
        if text == MULTITURN:
            return cls()
        if text.startswith(TRACE_PREFIX) and len(text) > len(TRACE_PREFIX):
            return cls(Path(text[len(TRACE_PREFIX):]))
        raise ConfigError(f"workload {text!r} is not known; use '{MULTITURN}' or "
                          f"'{TRACE_PREFIX}PATH' (a JSON-lines trace)")

    def __str__(self) -> str:
        return MULTITURN if self.trace_path is None else f"{TRACE_PREFIX}{self.trace_path}"
