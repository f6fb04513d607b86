"""The stack file's validation models: what each key takes, checked by pydantic.

Values are read by :mod:`hold_supervisor.stackfile.values`; checks that span units
(dependencies, placeholders, ports, what each kind takes) are
:mod:`hold_supervisor.stackfile.checks`; :mod:`hold_supervisor.stackfile.load` loads a file with
these and gives the plain specs of :mod:`hold_supervisor.stackfile.spec` (:func:`to_spec`),
which is all the supervisor keeps: these models never leave the loading.
"""

from __future__ import annotations

import re
import signal
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, PrivateAttr, model_validator

from hold_supervisor.stackfile import spec as stackspec
from hold_supervisor.stackfile import values
from hold_supervisor.stackfile.spec import LIVENESS_KINDS, READY_KINDS

# What each key takes: the readers of stackvalues, as pydantic types.
Duration = Annotated[float, PlainValidator(values.duration)]
Grace = Annotated[float, PlainValidator(values.grace)]
Cpus = Annotated[frozenset[int], PlainValidator(values.cpus)]
Arg = Annotated[str, PlainValidator(values.arg)]
EnvName = Annotated[str, PlainValidator(values.env_name)]
Size = Annotated[int, PlainValidator(values.size)]
PathText = Annotated[str, PlainValidator(values.path_text)]
Text = Annotated[str, PlainValidator(values.text)]
Flag = Annotated[bool, PlainValidator(values.flag)]
Port = Annotated[int | str, PlainValidator(values.port)]
Signal = Annotated[int, PlainValidator(values.stop_signal)]
Regex = Annotated[re.Pattern[str], PlainValidator(values.regex)]
Policy = Annotated[str, PlainValidator(values.policy)]
Count = Annotated[int, PlainValidator(values.count)]
Positive = Annotated[int, PlainValidator(values.positive)]
Kind = Annotated[str, PlainValidator(values.kind)]
StackName = Annotated[str, PlainValidator(values.stack_name)]
HttpPath = Annotated[str, PlainValidator(values.http_path)]
TcpPort = Annotated[str, PlainValidator(values.tcp_port)]
ExecArgv = Annotated[tuple[str, ...], PlainValidator(values.exec_argv)]
ArgName = Annotated[str, PlainValidator(values.arg_name)]
ArgType = Annotated[str, PlainValidator(values.arg_type)]
Number = Annotated[int | float, PlainValidator(values.number)]
Choices = Annotated[tuple[Any, ...], PlainValidator(values.choices)]
NotifyFlag = Annotated[bool, PlainValidator(values.notify_flag)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)


class HoldModel(_Strict):
    device: Text
    ttl: Duration | None = None
    label: Text | None = None


def _exactly_one(model: BaseModel, kinds: tuple[str, ...]) -> None:
    given = [k for k in kinds if getattr(model, k) is not None]
    if len(given) != 1:
        raise ValueError(
            f"exactly one of {', '.join(kinds)} is needed"
            + (f" (got {', '.join(given)})" if given else "")
        )


class ReadyModel(_Strict):
    http: HttpPath | None = None
    tcp: TcpPort | None = None
    log: Regex | None = None
    exec: ExecArgv | None = None
    file: Text | None = None
    notify: NotifyFlag | None = None
    timeout: Duration = 60.0

    @model_validator(mode="after")
    def _one_kind(self) -> ReadyModel:
        _exactly_one(self, READY_KINDS)
        return self


class LivenessModel(_Strict):
    http: HttpPath | None = None
    tcp: TcpPort | None = None
    exec: ExecArgv | None = None
    file: Text | None = None
    period: Duration = 10.0
    timeout: Duration = 5.0
    failures: Positive = 3

    @model_validator(mode="after")
    def _one_kind(self) -> LivenessModel:
        _exactly_one(self, LIVENESS_KINDS)
        return self


class RestartModel(_Strict):
    policy: Policy = "no"
    max: Count = 3
    backoff: Grace = 1.0
    max_backoff: Grace = 30.0
    reset_after: Duration = 30.0


class StopModel(_Strict):
    signal: Signal = int(signal.SIGTERM)
    grace: Grace = 10.0


class ScratchModel(_Strict):
    keep: Flag = False
    min_free: Size | None = None


class ArgModel(_Strict):
    type: ArgType
    min: Number | None = None
    max: Number | None = None
    max_len: Count | None = None
    choices: Choices | None = None
    required: Flag = False

    @model_validator(mode="after")
    def _fits_type(self) -> ArgModel:
        values.arg_fits(self.type, self.min, self.max, self.max_len, self.choices)
        return self


class UnitModel(_Strict):
    kind: Kind = "service"
    cmd: Annotated[tuple[Arg, ...], Field(min_length=1)]
    cwd: PathText | None = None
    port: Port | None = None
    cpus: Cpus | None = None
    env: dict[EnvName, Arg] = Field(default_factory=dict)
    env_file: PathText | None = None
    pass_env: tuple[EnvName, ...] = ()
    ready: ReadyModel | None = None
    liveness: LivenessModel | None = None
    restart: RestartModel = Field(default_factory=RestartModel)
    stop: StopModel = Field(default_factory=StopModel)
    after: tuple[Text, ...] = ()
    essential: Flag = True
    scratch: ScratchModel | None = None
    timeout: Duration | None = None
    concurrency: Positive | None = None
    args: dict[ArgName, ArgModel] | None = None
    _conditions: dict[str, str] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _after_forms(cls, data: Any, handler: Any) -> UnitModel:
        # `after` is a list of names or a mapping name -> condition; the model
        # keeps the names in order and the conditions apart (checked, with
        # their lines, by stackchecks).
        conditions: dict[str, str] = {}
        if isinstance(data, dict) and isinstance(data.get("after"), dict):
            conditions = {k: v for k, v in data["after"].items() if isinstance(v, str)}
            data = {**data, "after": list(data["after"])}
        # `scratch: true` is `scratch: {}`; `scratch: false` is none.
        if isinstance(data, dict) and isinstance(data.get("scratch"), bool):
            data = {**data, "scratch": {} if data["scratch"] else None}
        unit: UnitModel = handler(data)
        unit._conditions = conditions
        return unit


class StackModel(_Strict):
    name: StackName
    hold: HoldModel | None = None
    units: dict[str, UnitModel]


# ---------------------------------------------------------------------- to the specs

_SPEC_OF: dict[type[BaseModel], Any] = {
    HoldModel: stackspec.HoldSpec,
    ReadyModel: stackspec.ReadySpec,
    LivenessModel: stackspec.LivenessSpec,
    RestartModel: stackspec.RestartSpec,
    StopModel: stackspec.StopSpec,
    ScratchModel: stackspec.ScratchSpec,
    ArgModel: stackspec.ArgSpec,
    UnitModel: stackspec.UnitSpec,
}


def to_spec(model: StackModel, path: str, lines: dict[stackspec.Path, int]) -> stackspec.StackSpec:
    """The plain spec of a valid stack file (what the supervisor keeps)."""
    units = {n: _spec(u) for n, u in model.units.items()}
    hold = _spec(model.hold) if model.hold is not None else None
    return stackspec.StackSpec(model.name, units, hold, path, lines)


def _spec(model: BaseModel) -> Any:
    kw = {name: _value(getattr(model, name)) for name in type(model).model_fields}
    if isinstance(model, UnitModel):
        kw["conditions"] = dict(model._conditions)
    return _SPEC_OF[type(model)](**kw)


def _value(v: Any) -> Any:
    if isinstance(v, BaseModel):
        return _spec(v)
    if isinstance(v, dict):
        return {k: _value(x) for k, x in v.items()}
    return v
