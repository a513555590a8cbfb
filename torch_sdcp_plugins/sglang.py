"""The ``sglang.srt.plugins`` entry point ``torch_sdcp``: SGLang calls
:func:`register` in every process it starts (and catches the ``Exception``
a plugin raises; this one raises none, and ends the process in the
``require`` mode when the plugin cannot install). Off unless ``SDCP_SGLANG=1`` (or ``require``), or the
command line's ``--sdcp on`` (or ``require``); while off it imports nothing of
torch_sdcp. On, it registers :mod:`torch_sdcp.integrations.sglang`'s hooks with
SGLang (docs/SGLANG.md).

The command-line options (:data:`CLI_HOOKS`, registered on or off: an option
must be known to the parser before the switch is read) are hooks on SGLang's
``ServerArgs``: ``add_cli_args`` adds them to SGLang's parser (``--help``
shows them); ``from_cli_args``, which drops what is not a ``ServerArgs``
field, writes each option given into its environment variable, so that the
processes SGLang starts after parsing (the schedulers) read it, as they read
a variable set by the user (the option wins; a different value of the
variable is logged); ``resolved_dict`` (SGLang's server-args dump) adds the
values in effect. These hooks import argparse and this package's settings
only."""

from __future__ import annotations

import argparse
import functools
import logging
import os
from typing import Any

from torch_sdcp_settings import MODES, SGLANG, parse_positive

ENV_ENABLE = SGLANG.ENABLE
_REGISTRY = "sglang.srt.plugins.hook_registry"
_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

_logged: set = set()


def _log_once(level: int, reason: str, msg: str, *args: object) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logging.getLogger("sglang.torch_sdcp").log(level, msg, *args)


def enabled() -> bool:
    """Whether ``SDCP_SGLANG`` switches the plugin on (``1`` or ``require``; off
    when unset). An unrecognised value is logged once and counts as off."""
    return SGLANG.switch_on(lambda msg: _log_once(logging.ERROR, "setting", "%s", msg))


# ---------------------------------------------------------------------------
# Command-line options
# ---------------------------------------------------------------------------


def _dest(option: str) -> str:
    return option.lstrip("-").replace("-", "_")


def _option_type(parse: Any) -> Any:
    """An argparse ``type`` from a settings parser: its ValueError becomes
    argparse's usage error (the message names the option, the expected and
    the actual value)."""
    def convert(raw: str) -> Any:
        try:
            return parse(raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("torch_sdcp: ")) from None
    return convert


def _seams_text(raw: str) -> str:
    return ",".join(SGLANG.parse_seams(raw, f"option {SGLANG.options[SGLANG.SEAMS]}"))


def add_cli_args(result: Any, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
    """After ``ServerArgs.add_cli_args(parser)``: the plugin's options, in
    their own group of SGLang's parser. Every default is None (not given:
    the environment variable decides). A parser that already has one of them
    is left as it is."""
    opts = SGLANG.options
    if any(o in getattr(parser, "_option_string_actions", {}) for o in opts.values()):
        _log_once(logging.WARNING, "cli-taken", "torch_sdcp: SGLang's parser already has an option named like "
                  "%s; the plugin's options are not added", ", ".join(opts.values()))
        return
    group = parser.add_argument_group("torch_sdcp", "MLA DCP collectives on peer memory (the torch_sdcp plugin; "
                                      "docs/SGLANG.md). Each option, when given, wins over its environment "
                                      "variable; not given, the variable decides.")
    group.add_argument(opts[SGLANG.ENABLE], choices=MODES, default=None,
                       help=f"Switch the plugin: on, off, or require (a selected seam that stays SGLang's fails "
                            f"start-up). Default: {SGLANG.ENABLE} (unset: off).")
    group.add_argument(opts[SGLANG.SEAMS], type=_option_type(_seams_text), default=None, metavar="SEAMS",
                       help=f"The seams the plugin takes, comma-separated from {','.join(SGLANG.all_seams)}. "
                            f"Default: {SGLANG.SEAMS} (unset: all).")
    group.add_argument(opts[SGLANG.MAX_ROWS], default=None, metavar="N",
                       type=_option_type(lambda raw: parse_positive(raw, int, f"option {opts[SGLANG.MAX_ROWS]}")),
                       help=f"Cap the rows bound of the workspaces (memory); wider calls take SGLang's own "
                            f"functions. Default: {SGLANG.MAX_ROWS} (unset: SGLang's widest decode batch).")
    group.add_argument(opts[SGLANG.TIMEOUT_S], default=None, metavar="SECONDS",
                       type=_option_type(lambda raw: parse_positive(raw, float, f"option {opts[SGLANG.TIMEOUT_S]}")),
                       help=f"Bound of every wait on a peer. Default: {SGLANG.TIMEOUT_S} (unset: "
                            f"{SGLANG.default_timeout_s:g}).")


def from_cli_args(result: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ServerArgs.from_cli_args(args)`` (the parsed namespace is the
    last argument): each option given written into its environment variable
    for the processes SGLang starts from here. A variable the user set to
    another value is replaced, logged once."""
    namespace = kwargs.get("args", args[-1] if args else None)
    for env, option in SGLANG.options.items():
        value = getattr(namespace, _dest(option), None)
        if value is None:
            continue
        text = value if isinstance(value, str) else f"{value:g}" if isinstance(value, float) else str(value)
        before = os.environ.get(env)
        if before is not None and before.strip() and before.strip().lower() != text.lower():
            _log_once(logging.WARNING, f"cli-wins:{env}", "torch_sdcp: %s %s wins over %s=%r (the command line "
                      "overrides the environment)", option, text, env, before)
        os.environ[env] = text


def _in_effect() -> dict[str, Any]:
    """The plugin's settings as this process reads them, keyed like the
    options' argparse destinations; a bad value shows as given."""
    def read(fn: Any, env: str) -> Any:
        try:
            return fn()
        except ValueError:
            return os.environ.get(env)

    return {
        _dest(SGLANG.options[SGLANG.ENABLE]): SGLANG.mode()[0],
        _dest(SGLANG.options[SGLANG.SEAMS]): read(lambda: ",".join(SGLANG.seams()), SGLANG.SEAMS),
        _dest(SGLANG.options[SGLANG.MAX_ROWS]): read(SGLANG.max_rows_cap, SGLANG.MAX_ROWS),
        _dest(SGLANG.options[SGLANG.TIMEOUT_S]): read(SGLANG.timeout_s, SGLANG.TIMEOUT_S),
    }


def resolved_dict(result: Any, *args: Any, **kwargs: Any) -> Any:
    """After ``ServerArgs.resolved_dict()`` (SGLang's server-args dump: the
    ``server_args=`` start-up line, ``/server_info``): the plugin's settings
    in effect added. Never raises."""
    try:
        if isinstance(result, dict):
            result.update(_in_effect())
    except Exception:
        pass
    return result


#: (target, SGLang HookType name, hook) of the command-line options.
CLI_HOOKS = (
    (f"{_SERVER_ARGS}.add_cli_args", "AFTER", add_cli_args),
    (f"{_SERVER_ARGS}.from_cli_args", "AFTER", from_cli_args),
    (f"{_SERVER_ARGS}.resolved_dict", "AFTER", resolved_dict),
)

_cli_registered: list = []


def _never_raises(hook: Any) -> Any:
    """``hook`` as SGLang runs it: registered on or off, an option hook must
    never break SGLang's own parsing; a failure is logged once and SGLang's
    result is returned as it was."""
    @functools.wraps(hook)
    def guarded(result: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            hook(result, *args, **kwargs)
        except Exception as e:
            _log_once(logging.ERROR, f"cli-{hook.__name__}", "torch_sdcp: the SGLang plugin's %s hook failed "
                      "(%s: %s); use the environment variables", hook.__name__, type(e).__name__, e)
        return result
    return guarded


def register_cli() -> bool:
    """Register :data:`CLI_HOOKS` with SGLang's hook registry (once per
    process; SGLang applies them after its plugins ran). False outside SGLang
    (no registry) or on a failure, which is logged."""
    if _cli_registered:
        return True
    try:
        import importlib

        registry = importlib.import_module(_REGISTRY)
    except ImportError:
        return False
    except Exception as e:  # a half-imported SGLang (a failed import left its subpackages behind)
        _log_once(logging.ERROR, "cli-import", "torch_sdcp: SGLang's hook registry cannot be imported (%s: %s); "
                  "the plugin's command-line options are not available", type(e).__name__, e)
        return False
    try:
        for target, kind, hook in CLI_HOOKS:
            registry.HookRegistry.register(target, _never_raises(hook), getattr(registry.HookType, kind))
    except Exception as e:
        _log_once(logging.ERROR, "cli", "torch_sdcp: the SGLang plugin's command-line options are not available "
                  "(%s: %s); use the environment variables", type(e).__name__, e)
        return False
    _cli_registered.append(True)
    return True


def register() -> None:
    """The entry point. Registers the command-line options (on or off), then,
    when the switch is on, the plugin. A failure (a bad setting, a version
    outside the table, an extension that does not load) is logged once and
    the plugin stays off (SGLang runs its own DCP paths); with
    ``SDCP_SGLANG=require`` it ends the process instead: SGLang's plugin
    loader catches every ``Exception`` a plugin raises and goes on, so the
    entry raises ``SystemExit`` (which it does not catch) with the reason."""
    register_cli()
    try:
        if not enabled():
            return
        SGLANG.validate()
        from torch_sdcp.integrations import sglang as face

        if not face.install() and SGLANG.required():
            raise RuntimeError("the SGLang plugin could not install (see the error above)")
    except Exception as e:
        _log_once(logging.ERROR, "register", "torch_sdcp: the SGLang plugin stays off: %s: %s", type(e).__name__, e)
        if SGLANG.required():
            raise SystemExit(f"torch_sdcp: {ENV_ENABLE}=require: start-up stops: {type(e).__name__}: {e}") from e
