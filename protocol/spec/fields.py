"""The building blocks of the run spec's models: bounded field types, the frozen strict base
model, and the one place where pydantic's ValidationError becomes a one-line SpecError.

Every field is strict (a bool is not an int, an int is not a str; a float field takes an int and
stores a float), finite and bounded on both sides, so that no spec, however hostile, can make a
peer hang or overflow before the error reaches it.
"""

from __future__ import annotations

import typing
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Tuple, Type

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer
from pydantic.fields import FieldInfo

from protocol.errors import SpecError

_SHOWN_CHARS = 48  # the most characters of a bad value an error line quotes
_BOUND_ATTR = {
    annotated_types.Ge: "ge",
    annotated_types.Gt: "gt",
    annotated_types.Le: "le",
    annotated_types.Lt: "lt",
    annotated_types.MinLen: "min_length",
    annotated_types.MaxLen: "max_length",
}


def Int(*, ge: Optional[int] = None, gt: Optional[int] = None, le: Optional[int] = None, lt: Optional[int] = None):
    """An int field (never a bool or a float) within the given bounds."""
    return typing.Annotated[int, Field(strict=True, ge=ge, gt=gt, le=le, lt=lt)]


def Float(*, ge: Optional[float] = None, gt: Optional[float] = None, le: Optional[float] = None, lt: Optional[float] = None):
    """A finite float field within the given bounds; an int is accepted and stored as a float."""
    return typing.Annotated[float, Field(strict=True, allow_inf_nan=False, ge=ge, gt=gt, le=le, lt=lt)]


def OptionalFloat(*, gt: Optional[float] = None, le: Optional[float] = None):
    """Like Float, or None (unset: a default applies)."""
    return typing.Annotated[Optional[float], Field(strict=True, allow_inf_nan=False, gt=gt, le=le)]


Bool = typing.Annotated[bool, Field(strict=True)]


def Str(*, min_length: int = 0, max_length: int = 4096):
    return typing.Annotated[str, Field(strict=True, min_length=min_length, max_length=max_length)]


def merge(base: Dict[str, Any], changes: Mapping[str, Any]) -> Dict[str, Any]:
    """``base`` with ``changes`` applied; a nested dict of changes updates a nested dict."""
    out = dict(base)
    for key, value in changes.items():
        out[key] = merge(out[key], value) if isinstance(value, Mapping) and isinstance(out.get(key), dict) else value
    return out


class SpecModel(BaseModel):
    """A frozen, strict section of the run spec; a bad value raises SpecError, never anything else."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    _path: ClassVar[str] = ""  # where this section sits in the run spec ("" for the spec itself)
    # fields added after runs existed: left out of the serialized spec at their default, so the
    # digests of runs that never set them are unchanged (tests/protocol/test_spec.py pins them)
    _omit_at_default: ClassVar[Tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit_defaults(self, handler):
        out = handler(self)
        for name in self._omit_at_default:
            if name in out and out[name] == type(self).model_fields[name].default:
                del out[name]
        return out

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise spec_error(e, type(self)) from None

    def check(self) -> None:
        """Validate again (every instance is validated when it is built; kept for callers)."""
        type(self)(**self.model_dump())

    def replace(self, **changes: Any):
        """A validated copy with some fields changed; nested sections may be given as dicts of changes."""
        return type(self)(**merge(self.model_dump(), changes))


# --- ValidationError -> SpecError ----------------------------------------------------------------


def spec_error(e: ValidationError, cls: Type[BaseModel]) -> SpecError:
    """One line naming the first bad field by its dotted path and saying what it accepts."""
    errors = e.errors()
    if not errors:  # pragma: no cover - pydantic always reports at least one
        return SpecError(f"invalid {cls._path or 'run spec'}")
    first = errors[0]
    prefix = [cls._path] if cls._path else []
    path = ".".join(prefix + [str(p) for p in first["loc"]])
    kind = first["type"]
    if kind == "extra_forbidden":
        unknown = [".".join(prefix + [str(p) for p in err["loc"]]) for err in errors if err["type"] == kind]
        return SpecError(f"unknown field(s) in the run spec: {', '.join(unknown)}")
    cause = (first.get("ctx") or {}).get("error")
    if kind == "value_error" and isinstance(cause, SpecError):
        return SpecError(str(cause))
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return SpecError(f"{path} must be a table/map, got {type(first['input']).__name__}")
    info = _field_at(cls, first["loc"])
    if info is None:
        return SpecError(f"{path or 'run spec'}: {first['msg']}")
    return SpecError(f"{path} must be {describe(info)}, got {_shown(first['input'])}")


def _field_at(cls: Type[BaseModel], loc: Tuple[Any, ...]) -> Optional[FieldInfo]:
    info: Optional[FieldInfo] = None
    for part in loc:
        fields = getattr(cls, "model_fields", None)
        if not isinstance(fields, dict) or part not in fields:
            return None
        info = fields[part]
        cls = info.annotation
    return info


def describe(info: FieldInfo) -> str:
    """What a field accepts, in words: 'an integer in [1, 1024]', 'one of 'fp16', 'fp32''..."""
    annotation = info.annotation
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    optional = typing.get_origin(annotation) is typing.Union and type(None) in args
    if optional:
        annotation = next(a for a in args if a is not type(None))
    if annotation is bool:
        return "true or false"
    if annotation is str:
        lo, hi = _bounds(info, annotated_types.MinLen, annotated_types.MaxLen)
        return f"a string of {lo or 0} to {hi} characters"
    what = "an integer" if annotation is int else "a finite number"
    return f"{what} in {_range(info)}" + (" (or unset)" if optional else "")


def _bounds(info: FieldInfo, low: type, high: type) -> Tuple[Any, Any]:
    """The values of the first ``low`` and ``high`` constraints (annotated_types) of a field."""
    found = {}
    for m in info.metadata:
        for cls in (low, high):
            if isinstance(m, cls) and cls not in found:
                found[cls] = getattr(m, _BOUND_ATTR[cls])
    return found.get(low), found.get(high)


def _range(info: FieldInfo) -> str:
    ge, gt = _bounds(info, annotated_types.Ge, annotated_types.Gt)
    le, lt = _bounds(info, annotated_types.Le, annotated_types.Lt)
    left = f"[{_num(ge)}" if ge is not None else f"({_num(gt)}"
    right = f"{_num(le)}]" if le is not None else f"{_num(lt)})"
    return f"{left}, {right}"


def _num(v: Any) -> str:
    if isinstance(v, int) and v > 1 << 20 and v & (v - 1) == 0:
        return f"2**{v.bit_length() - 1}"
    return f"{v:g}" if isinstance(v, float) else str(v)


def _shown(value: Any) -> str:
    """A bad value as an error line quotes it: short, and safe for any size of int."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 256:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


__all__: List[str] = ["Int", "Float", "OptionalFloat", "Bool", "Str", "SpecModel", "merge", "spec_error", "describe"]
