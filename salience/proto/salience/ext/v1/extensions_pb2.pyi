from salience.proto.salience.v1 import salience_pb2 as _salience_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SteeredGenerateRequest(_message.Message):
    __slots__ = ("generate", "interventions")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    INTERVENTIONS_FIELD_NUMBER: _ClassVar[int]
    generate: _salience_pb2.GenerateRequest
    interventions: _containers.RepeatedCompositeFieldContainer[Intervention]
    def __init__(self, generate: _Optional[_Union[_salience_pb2.GenerateRequest, _Mapping]] = ..., interventions: _Optional[_Iterable[_Union[Intervention, _Mapping]]] = ...) -> None: ...

class Intervention(_message.Message):
    __slots__ = ("direction", "layers", "op", "value", "prompt", "ranges", "generated")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[Intervention.Op]
        OP_ADD: _ClassVar[Intervention.Op]
        OP_SET: _ClassVar[Intervention.Op]
        OP_ABLATE: _ClassVar[Intervention.Op]
    OP_UNSPECIFIED: Intervention.Op
    OP_ADD: Intervention.Op
    OP_SET: Intervention.Op
    OP_ABLATE: Intervention.Op
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    direction: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    op: Intervention.Op
    value: float
    prompt: bool
    ranges: _containers.RepeatedCompositeFieldContainer[_salience_pb2.PositionRange]
    generated: bool
    def __init__(self, direction: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., op: _Optional[_Union[Intervention.Op, str]] = ..., value: _Optional[float] = ..., prompt: _Optional[bool] = ..., ranges: _Optional[_Iterable[_Union[_salience_pb2.PositionRange, _Mapping]]] = ..., generated: _Optional[bool] = ...) -> None: ...

class GetSteeringManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SteeringManifest(_message.Message):
    __slots__ = ("directions", "max_interventions", "max_magnitude")
    class Direction(_message.Message):
        __slots__ = ("name", "layers")
        NAME_FIELD_NUMBER: _ClassVar[int]
        LAYERS_FIELD_NUMBER: _ClassVar[int]
        name: str
        layers: _containers.RepeatedScalarFieldContainer[int]
        def __init__(self, name: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ...) -> None: ...
    DIRECTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_INTERVENTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_MAGNITUDE_FIELD_NUMBER: _ClassVar[int]
    directions: _containers.RepeatedCompositeFieldContainer[SteeringManifest.Direction]
    max_interventions: int
    max_magnitude: float
    def __init__(self, directions: _Optional[_Iterable[_Union[SteeringManifest.Direction, _Mapping]]] = ..., max_interventions: _Optional[int] = ..., max_magnitude: _Optional[float] = ...) -> None: ...

class ImageInfoRequest(_message.Message):
    __slots__ = ("bytes", "mime")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MIME_FIELD_NUMBER: _ClassVar[int]
    bytes: bytes
    mime: str
    def __init__(self, bytes: _Optional[bytes] = ..., mime: _Optional[str] = ...) -> None: ...

class ImageInfoResponse(_message.Message):
    __slots__ = ("pad_tokens", "block_tokens", "grid_t", "grid_h", "grid_w", "vision_start_token_id", "image_pad_token_id", "vision_end_token_id", "width", "height")
    PAD_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GRID_T_FIELD_NUMBER: _ClassVar[int]
    GRID_H_FIELD_NUMBER: _ClassVar[int]
    GRID_W_FIELD_NUMBER: _ClassVar[int]
    VISION_START_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    VISION_END_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    pad_tokens: int
    block_tokens: int
    grid_t: int
    grid_h: int
    grid_w: int
    vision_start_token_id: int
    image_pad_token_id: int
    vision_end_token_id: int
    width: int
    height: int
    def __init__(self, pad_tokens: _Optional[int] = ..., block_tokens: _Optional[int] = ..., grid_t: _Optional[int] = ..., grid_h: _Optional[int] = ..., grid_w: _Optional[int] = ..., vision_start_token_id: _Optional[int] = ..., image_pad_token_id: _Optional[int] = ..., vision_end_token_id: _Optional[int] = ..., width: _Optional[int] = ..., height: _Optional[int] = ...) -> None: ...
