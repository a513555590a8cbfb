"""Every environment setting of the engine plugins, written once: its name,
how it is parsed and validated, its default and the message of a bad value.

The entry shims (:mod:`torch_sdcp_plugins.vllm`, :mod:`torch_sdcp_plugins.sglang`)
and the library's engine faces (:mod:`torch_sdcp.integrations`) both read the
settings here, so it is a package of its own, below both. It imports nothing
but the standard library: a shim runs in every engine process and must not
load torch or torch_sdcp while its switch is off.

Per engine (``SDCP_VLLM``, ``SDCP_SGLANG``):

- ``<PREFIX>``: ``1/true/yes/on`` switches the plugin on, ``require`` too and
  fails start-up when a requested seam cannot be taken, ``0/false/no/off`` or
  unset leaves it off; anything else is logged once and counts as off;
- ``<PREFIX>_SEAMS``: the seams to take, comma-separated (unset or empty: all);
- ``<PREFIX>_MAX_ROWS``: a positive int capping the engine's row bound;
- ``<PREFIX>_TIMEOUT_S``: a positive number of seconds a workspace waits for a
  peer (default 600: ranks skew by many seconds at start-up; NCCL waits 10 min).

SGLang's plugin also takes them as command-line options (``--sdcp``,
``--sdcp-seams``, ``--sdcp-max-rows``, ``--sdcp-timeout-s``: :attr:`EngineSettings.options`),
parsed by the same functions; an option given wins over its variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["MODES", "SGLANG", "SWITCH_WORDS", "VLLM", "EngineSettings", "parse_positive", "positive_number",
           "read_switch"]

_ON = ("1", "true", "yes", "on")
_REQUIRE = ("require",)
_OFF = ("", "0", "false", "no", "off")

#: How the accepted words read in a log line: (on, off).
SWITCH_WORDS = ("/".join(_ON + _REQUIRE), "/".join(_OFF[1:]))

#: The plugin modes a switch selects.
MODES = ("off", "on", "require")


def _raw(name: str) -> str | None:
    """The variable's value, None when unset or blank."""
    raw = os.environ.get(name)
    return None if raw is None or not raw.strip() else raw


def read_mode(name: str) -> tuple[str, str | None]:
    """The switch ``name``: (one of :data:`MODES`, the raw value when it is no
    accepted word, for the caller to log once; the mode is then "off")."""
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in _ON:
        return "on", None
    if value in _REQUIRE:
        return "require", None
    return "off", None if value in _OFF else raw


def read_switch(name: str) -> tuple[bool, str | None]:
    """The switch ``name`` as (on, the raw value when it is no accepted word)."""
    mode, bad = read_mode(name)
    return mode != "off", bad


def parse_positive(raw: str, kind: type, source: str) -> float | int:
    """``raw`` as a positive ``kind`` (int or float). A bad value is a
    ValueError naming ``source`` (the variable or option), the expected and
    the actual value."""
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value > 0:
        raise ValueError(f"torch_sdcp: {source}: expected a positive {kind.__name__}, got {raw!r}")
    return value


def positive_number(name: str, kind: type, default: float | int | None) -> float | int | None:
    """The variable ``name`` as a positive ``kind`` (int or float), or
    ``default`` when unset or blank. A bad value is a ValueError naming the
    variable, the expected and the actual value."""
    raw = _raw(name)
    if raw is None:
        return default
    return parse_positive(raw, kind, f"environment variable {name}")


class EngineSettings:
    """The settings of one engine's plugin, all named from one prefix."""

    def __init__(self, engine: str, prefix: str, seams: tuple[str, ...], default_timeout_s: float = 600.0,
                 cli: str | None = None) -> None:
        self.engine = engine
        self.ENABLE = prefix
        self.SEAMS = f"{prefix}_SEAMS"
        self.MAX_ROWS = f"{prefix}_MAX_ROWS"
        self.TIMEOUT_S = f"{prefix}_TIMEOUT_S"
        self.all_seams = seams
        self.default_timeout_s = default_timeout_s
        #: The engine's command-line option of each variable (``cli``: the
        #: switch's option; the others append ``-seams``, ...), or none.
        self.options: dict[str, str] = {} if cli is None else {
            self.ENABLE: cli, self.SEAMS: f"{cli}-seams", self.MAX_ROWS: f"{cli}-max-rows",
            self.TIMEOUT_S: f"{cli}-timeout-s"}

    def names(self) -> tuple[str, ...]:
        return (self.ENABLE, self.SEAMS, self.MAX_ROWS, self.TIMEOUT_S)

    def mode(self) -> tuple[str, str | None]:
        """(off/on/require, the raw switch value when it is no accepted word)."""
        return read_mode(self.ENABLE)

    def switch_on(self, log_bad: Callable[[str], object]) -> bool:
        """Whether the switch turns the plugin on (``1`` or ``require``); an
        unrecognised value is passed to ``log_bad`` as a message and counts
        as off."""
        mode, bad = self.mode()
        if bad is not None:
            log_bad(f"torch_sdcp: {self.ENABLE}={bad!r} is not one of {SWITCH_WORDS[0]} (on) or {SWITCH_WORDS[1]} "
                    f"(off); the {self.engine} plugin stays off")
        return mode != "off"

    def required(self) -> bool:
        return self.mode()[0] == "require"

    def seams(self) -> tuple[str, ...]:
        """The selected seams, in :attr:`all_seams` order (unset or empty:
        all). An unknown name is a ValueError."""
        raw = _raw(self.SEAMS)
        if raw is None:
            return self.all_seams
        return self.parse_seams(raw, f"environment variable {self.SEAMS}")

    def parse_seams(self, raw: str, source: str) -> tuple[str, ...]:
        """``raw`` (comma-separated names) as seams in
        :attr:`all_seams` order. An unknown name is a ValueError naming
        ``source``, the expected and the actual value."""
        names = [n.strip().lower() for n in raw.split(",") if n.strip()]
        unknown = [n for n in names if n not in self.all_seams]
        if unknown:
            raise ValueError(f"torch_sdcp: {source}: expected comma-separated names from "
                             f"{','.join(self.all_seams)}, got {raw!r} (unknown: {', '.join(unknown)})")
        return tuple(s for s in self.all_seams if s in names)

    def max_rows_cap(self) -> int | None:
        """The row-bound cap, None when unset."""
        cap = positive_number(self.MAX_ROWS, int, None)
        return None if cap is None else int(cap)

    def timeout_s(self) -> float:
        return float(positive_number(self.TIMEOUT_S, float, self.default_timeout_s) or self.default_timeout_s)

    def validate(self) -> None:
        """Every setting but the switch, checked (before anything is patched):
        the first bad one raises its ValueError."""
        self.seams()
        self.max_rows_cap()
        self.timeout_s()


VLLM = EngineSettings("vLLM", "SDCP_VLLM", ("combine", "query", "topk"))
SGLANG = EngineSettings("SGLang", "SDCP_SGLANG", ("combine", "query"), cli="--sdcp")
