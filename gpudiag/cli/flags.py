"""A command's flags, generated from the options' one definition (gpudiag.model.options): a
command decorated `@with_options(RunOptions, ...)` takes every field as a flag, and gets the
parsed values back as the dataclasses."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable
from typing import Annotated, Any

import typer

from gpudiag.model.options import OptionsT, option_fields


def _split(value: str | None) -> list[str] | None:
    return [s.strip() for s in value.split(",") if s.strip()] if value else None


def _option_parameters(cls: type[OptionsT]) -> list[inspect.Parameter]:
    """A command's options, from their one definition (gpudiag.model.options)."""
    params = []
    for f, spec, hint in option_fields(cls):
        # A tuple option (stages, fixes) is a repeatable flag, each value comma-separated.
        cli_hint = list[str] | None if _is_tuple(hint) else hint
        choices = f" One of: {', '.join(spec.choices)}." if spec.choices else ""
        params.append(inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default,
            annotation=Annotated[cli_hint, typer.Option(
                spec.flag, *spec.aliases, help=spec.help + choices,
                # "<list[str]>" widened the type column until an 80-column --help cut option
                # names ("--evidence-steps,--st…")
                metavar="<list>" if _is_tuple(hint) else None)]))
    return params


def _is_tuple(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple or tuple in {
        typing.get_origin(a) for a in typing.get_args(hint)}


def options_from_params(cls: type[OptionsT], params: dict[str, Any]) -> OptionsT:
    """`cls` from parsed parameters (a list of strings for a tuple, each comma-separated where
    its option allows; click's own tuple where the parameters come from its context)."""
    values = {}
    for f, spec, hint in option_fields(cls):
        value = params[f.name]
        if isinstance(value, (list, tuple)) and _is_tuple(hint):
            value = (tuple(_split(",".join(value)) or ()) if spec.commas else tuple(value)
                     ) or f.default
        values[f.name] = value
    return cls(**values)


def with_options(*classes: type[Any]) -> Callable[[Callable[..., None]],
                                                  Callable[..., None]]:
    """`command(*options, **own)` as a Typer command taking every option of each of `classes`
    as a flag: the command's first parameters get an instance of each, in order."""

    def decorate(command: Callable[..., None]) -> Callable[..., None]:
        own: list[inspect.Parameter] = [
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY)
            for p in list(inspect.signature(command, eval_str=True).parameters.values())
            [len(classes):]]
        names = {f.name for cls in classes for f, _, _ in option_fields(cls)}
        declared = [f.name for cls in classes for f, _, _ in option_fields(cls)]
        assert len(declared) == len(names) and not names & {p.name for p in own}, (
            f"{command.__name__}: an option declared twice")

        @functools.wraps(command)
        def wrapper(**params: Any) -> None:
            command(*(options_from_params(cls, params) for cls in classes),
                    **{k: v for k, v in params.items() if k not in names})

        parameters = [*(p for cls in classes for p in _option_parameters(cls)), *own]
        wrapper.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
        wrapper.__annotations__ = {p.name: p.annotation for p in parameters}
        del wrapper.__wrapped__  # Typer must read the new signature, not the wrapped one's
        return wrapper

    return decorate
