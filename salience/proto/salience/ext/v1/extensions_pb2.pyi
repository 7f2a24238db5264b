from salience.proto.salience.v1 import salience_pb2 as _salience_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Patch(_message.Message):
    __slots__ = ("point", "layer", "positions", "rows")
    POINT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    point: str
    layer: int
    positions: _containers.RepeatedScalarFieldContainer[int]
    rows: bytes
    def __init__(self, point: _Optional[str] = ..., layer: _Optional[int] = ..., positions: _Optional[_Iterable[int]] = ..., rows: _Optional[bytes] = ...) -> None: ...

class PatchSweepRequest(_message.Message):
    __slots__ = ("clean", "corrupted", "answer", "foil", "points", "layers", "positions", "metric")
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    FOIL_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    METRIC_FIELD_NUMBER: _ClassVar[int]
    clean: _containers.RepeatedScalarFieldContainer[int]
    corrupted: _containers.RepeatedScalarFieldContainer[int]
    answer: _containers.RepeatedScalarFieldContainer[int]
    foil: _containers.RepeatedScalarFieldContainer[int]
    points: _containers.RepeatedScalarFieldContainer[str]
    layers: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    metric: str
    def __init__(self, clean: _Optional[_Iterable[int]] = ..., corrupted: _Optional[_Iterable[int]] = ..., answer: _Optional[_Iterable[int]] = ..., foil: _Optional[_Iterable[int]] = ..., points: _Optional[_Iterable[str]] = ..., layers: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., metric: _Optional[str] = ...) -> None: ...

class PatchSweepEvent(_message.Message):
    __slots__ = ("progress", "grid")
    class Progress(_message.Message):
        __slots__ = ("done", "total")
        DONE_FIELD_NUMBER: _ClassVar[int]
        TOTAL_FIELD_NUMBER: _ClassVar[int]
        done: int
        total: int
        def __init__(self, done: _Optional[int] = ..., total: _Optional[int] = ...) -> None: ...
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    GRID_FIELD_NUMBER: _ClassVar[int]
    progress: PatchSweepEvent.Progress
    grid: SweepGrid
    def __init__(self, progress: _Optional[_Union[PatchSweepEvent.Progress, _Mapping]] = ..., grid: _Optional[_Union[SweepGrid, _Mapping]] = ...) -> None: ...

class SweepGrid(_message.Message):
    __slots__ = ("metric", "points", "layers", "positions", "clean", "corrupted", "grids")
    class PointGrid(_message.Message):
        __slots__ = ("point", "values")
        POINT_FIELD_NUMBER: _ClassVar[int]
        VALUES_FIELD_NUMBER: _ClassVar[int]
        point: str
        values: _containers.RepeatedScalarFieldContainer[float]
        def __init__(self, point: _Optional[str] = ..., values: _Optional[_Iterable[float]] = ...) -> None: ...
    METRIC_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    CLEAN_FIELD_NUMBER: _ClassVar[int]
    CORRUPTED_FIELD_NUMBER: _ClassVar[int]
    GRIDS_FIELD_NUMBER: _ClassVar[int]
    metric: str
    points: _containers.RepeatedScalarFieldContainer[str]
    layers: _containers.RepeatedScalarFieldContainer[int]
    positions: _containers.RepeatedScalarFieldContainer[int]
    clean: float
    corrupted: float
    grids: _containers.RepeatedCompositeFieldContainer[SweepGrid.PointGrid]
    def __init__(self, metric: _Optional[str] = ..., points: _Optional[_Iterable[str]] = ..., layers: _Optional[_Iterable[int]] = ..., positions: _Optional[_Iterable[int]] = ..., clean: _Optional[float] = ..., corrupted: _Optional[float] = ..., grids: _Optional[_Iterable[_Union[SweepGrid.PointGrid, _Mapping]]] = ...) -> None: ...

class DefineConceptRequest(_message.Message):
    __slots__ = ("name", "positive", "negative", "method", "layers", "vector", "vectors")
    class VectorsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: bytes
        def __init__(self, key: _Optional[int] = ..., value: _Optional[bytes] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    POSITIVE_FIELD_NUMBER: _ClassVar[int]
    NEGATIVE_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    name: str
    positive: _containers.RepeatedScalarFieldContainer[str]
    negative: _containers.RepeatedScalarFieldContainer[str]
    method: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    vector: bytes
    vectors: _containers.ScalarMap[int, bytes]
    def __init__(self, name: _Optional[str] = ..., positive: _Optional[_Iterable[str]] = ..., negative: _Optional[_Iterable[str]] = ..., method: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., vector: _Optional[bytes] = ..., vectors: _Optional[_Mapping[int, bytes]] = ...) -> None: ...

class DefineConceptResponse(_message.Message):
    __slots__ = ("name", "manifest_version", "info", "table")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    TABLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    manifest_version: int
    info: ConceptInfo
    table: str
    def __init__(self, name: _Optional[str] = ..., manifest_version: _Optional[int] = ..., info: _Optional[_Union[ConceptInfo, _Mapping]] = ..., table: _Optional[str] = ...) -> None: ...

class DeleteConceptRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteConceptResponse(_message.Message):
    __slots__ = ("manifest_version",)
    MANIFEST_VERSION_FIELD_NUMBER: _ClassVar[int]
    manifest_version: int
    def __init__(self, manifest_version: _Optional[int] = ...) -> None: ...

class SaveConceptsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveConceptsResponse(_message.Message):
    __slots__ = ("concept_set", "concepts")
    CONCEPT_SET_FIELD_NUMBER: _ClassVar[int]
    CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    concept_set: bytes
    concepts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, concept_set: _Optional[bytes] = ..., concepts: _Optional[_Iterable[str]] = ...) -> None: ...

class ExtendedGenerateRequest(_message.Message):
    __slots__ = ("generate", "interventions", "readout_format", "monitors", "residual", "features", "constraint", "patches")
    class ReadoutFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        READOUT_FORMAT_RAW: _ClassVar[ExtendedGenerateRequest.ReadoutFormat]
        READOUT_FORMAT_PROBABILITY: _ClassVar[ExtendedGenerateRequest.ReadoutFormat]
        READOUT_FORMAT_TOKEN: _ClassVar[ExtendedGenerateRequest.ReadoutFormat]
        READOUT_FORMAT_RUNNING: _ClassVar[ExtendedGenerateRequest.ReadoutFormat]
    READOUT_FORMAT_RAW: ExtendedGenerateRequest.ReadoutFormat
    READOUT_FORMAT_PROBABILITY: ExtendedGenerateRequest.ReadoutFormat
    READOUT_FORMAT_TOKEN: ExtendedGenerateRequest.ReadoutFormat
    READOUT_FORMAT_RUNNING: ExtendedGenerateRequest.ReadoutFormat
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    INTERVENTIONS_FIELD_NUMBER: _ClassVar[int]
    READOUT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    MONITORS_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    PATCHES_FIELD_NUMBER: _ClassVar[int]
    generate: _salience_pb2.GenerateRequest
    interventions: _containers.RepeatedCompositeFieldContainer[Intervention]
    readout_format: ExtendedGenerateRequest.ReadoutFormat
    monitors: _containers.RepeatedCompositeFieldContainer[Monitor]
    residual: Residual
    features: Features
    constraint: Constraint
    patches: _containers.RepeatedCompositeFieldContainer[Patch]
    def __init__(self, generate: _Optional[_Union[_salience_pb2.GenerateRequest, _Mapping]] = ..., interventions: _Optional[_Iterable[_Union[Intervention, _Mapping]]] = ..., readout_format: _Optional[_Union[ExtendedGenerateRequest.ReadoutFormat, str]] = ..., monitors: _Optional[_Iterable[_Union[Monitor, _Mapping]]] = ..., residual: _Optional[_Union[Residual, _Mapping]] = ..., features: _Optional[_Union[Features, _Mapping]] = ..., constraint: _Optional[_Union[Constraint, _Mapping]] = ..., patches: _Optional[_Iterable[_Union[Patch, _Mapping]]] = ...) -> None: ...

class Constraint(_message.Message):
    __slots__ = ("json", "regex", "choice", "grammar", "json_object")
    JSON_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    CHOICE_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    json: str
    regex: str
    choice: Choices
    grammar: str
    json_object: bool
    def __init__(self, json: _Optional[str] = ..., regex: _Optional[str] = ..., choice: _Optional[_Union[Choices, _Mapping]] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ...) -> None: ...

class Choices(_message.Message):
    __slots__ = ("texts",)
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, texts: _Optional[_Iterable[str]] = ...) -> None: ...

class ChatGenerateRequest(_message.Message):
    __slots__ = ("turn", "messages")
    TURN_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    turn: ExtendedGenerateRequest
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, turn: _Optional[_Union[ExtendedGenerateRequest, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "parts", "name", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    parts: _containers.RepeatedCompositeFieldContainer[ContentPart]
    name: str
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., name: _Optional[str] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image_url")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
    text: str
    image_url: str
    def __init__(self, text: _Optional[str] = ..., image_url: _Optional[str] = ...) -> None: ...

class ChatAppended(_message.Message):
    __slots__ = ("offset", "tokens")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    offset: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, offset: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class ChatGenerateEvent(_message.Message):
    __slots__ = ("appended", "event", "reply")
    APPENDED_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    appended: ChatAppended
    event: ExtendedGenerateEvent
    reply: ChatMessage
    def __init__(self, appended: _Optional[_Union[ChatAppended, _Mapping]] = ..., event: _Optional[_Union[ExtendedGenerateEvent, _Mapping]] = ..., reply: _Optional[_Union[ChatMessage, _Mapping]] = ...) -> None: ...

class Features(_message.Message):
    __slots__ = ("sae", "k", "ranges")
    SAE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    sae: str
    k: int
    ranges: _containers.RepeatedCompositeFieldContainer[_salience_pb2.PositionRange]
    def __init__(self, sae: _Optional[str] = ..., k: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[_salience_pb2.PositionRange, _Mapping]]] = ...) -> None: ...

class FeatureActivation(_message.Message):
    __slots__ = ("id", "activation")
    ID_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    id: int
    activation: float
    def __init__(self, id: _Optional[int] = ..., activation: _Optional[float] = ...) -> None: ...

class FeatureRef(_message.Message):
    __slots__ = ("sae", "id")
    SAE_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    sae: str
    id: int
    def __init__(self, sae: _Optional[str] = ..., id: _Optional[int] = ...) -> None: ...

class GetSAEManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SAEManifest(_message.Message):
    __slots__ = ("saes",)
    SAES_FIELD_NUMBER: _ClassVar[int]
    saes: _containers.RepeatedCompositeFieldContainer[SAEInfo]
    def __init__(self, saes: _Optional[_Iterable[_Union[SAEInfo, _Mapping]]] = ...) -> None: ...

class SAEInfo(_message.Message):
    __slots__ = ("name", "layer", "d_in", "d_sae", "architecture", "k", "top", "hook_name", "sha256", "point", "transcoder", "hook_name_out", "d_out")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    D_IN_FIELD_NUMBER: _ClassVar[int]
    D_SAE_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    HOOK_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    TRANSCODER_FIELD_NUMBER: _ClassVar[int]
    HOOK_NAME_OUT_FIELD_NUMBER: _ClassVar[int]
    D_OUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    layer: int
    d_in: int
    d_sae: int
    architecture: str
    k: int
    top: int
    hook_name: str
    sha256: str
    point: str
    transcoder: str
    hook_name_out: str
    d_out: int
    def __init__(self, name: _Optional[str] = ..., layer: _Optional[int] = ..., d_in: _Optional[int] = ..., d_sae: _Optional[int] = ..., architecture: _Optional[str] = ..., k: _Optional[int] = ..., top: _Optional[int] = ..., hook_name: _Optional[str] = ..., sha256: _Optional[str] = ..., point: _Optional[str] = ..., transcoder: _Optional[str] = ..., hook_name_out: _Optional[str] = ..., d_out: _Optional[int] = ...) -> None: ...

class Residual(_message.Message):
    __slots__ = ("layers", "ranges", "point")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[int]
    ranges: _containers.RepeatedCompositeFieldContainer[_salience_pb2.PositionRange]
    point: str
    def __init__(self, layers: _Optional[_Iterable[int]] = ..., ranges: _Optional[_Iterable[_Union[_salience_pb2.PositionRange, _Mapping]]] = ..., point: _Optional[str] = ...) -> None: ...

class Monitor(_message.Message):
    __slots__ = ("concept", "layer", "above", "below", "action", "feature", "path")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        ACTION_UNSPECIFIED: _ClassVar[Monitor.Action]
        ACTION_FLAG: _ClassVar[Monitor.Action]
        ACTION_STOP: _ClassVar[Monitor.Action]
    ACTION_UNSPECIFIED: Monitor.Action
    ACTION_FLAG: Monitor.Action
    ACTION_STOP: Monitor.Action
    CONCEPT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    ABOVE_FIELD_NUMBER: _ClassVar[int]
    BELOW_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    concept: str
    layer: int
    above: float
    below: float
    action: Monitor.Action
    feature: FeatureRef
    path: str
    def __init__(self, concept: _Optional[str] = ..., layer: _Optional[int] = ..., above: _Optional[float] = ..., below: _Optional[float] = ..., action: _Optional[_Union[Monitor.Action, str]] = ..., feature: _Optional[_Union[FeatureRef, _Mapping]] = ..., path: _Optional[str] = ...) -> None: ...

class MonitorEvent(_message.Message):
    __slots__ = ("monitor", "concept", "layer", "position", "probability", "action", "feature", "path")
    MONITOR_FIELD_NUMBER: _ClassVar[int]
    CONCEPT_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    monitor: int
    concept: str
    layer: int
    position: int
    probability: float
    action: Monitor.Action
    feature: FeatureRef
    path: str
    def __init__(self, monitor: _Optional[int] = ..., concept: _Optional[str] = ..., layer: _Optional[int] = ..., position: _Optional[int] = ..., probability: _Optional[float] = ..., action: _Optional[_Union[Monitor.Action, str]] = ..., feature: _Optional[_Union[FeatureRef, _Mapping]] = ..., path: _Optional[str] = ...) -> None: ...

class ExtendedGenerateEvent(_message.Message):
    __slots__ = ("event", "monitors", "stopped_by", "residual", "features")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    MONITORS_FIELD_NUMBER: _ClassVar[int]
    STOPPED_BY_FIELD_NUMBER: _ClassVar[int]
    RESIDUAL_FIELD_NUMBER: _ClassVar[int]
    FEATURES_FIELD_NUMBER: _ClassVar[int]
    event: _salience_pb2.GenerateEvent
    monitors: _containers.RepeatedCompositeFieldContainer[MonitorEvent]
    stopped_by: MonitorEvent
    residual: bytes
    features: _containers.RepeatedCompositeFieldContainer[FeatureActivation]
    def __init__(self, event: _Optional[_Union[_salience_pb2.GenerateEvent, _Mapping]] = ..., monitors: _Optional[_Iterable[_Union[MonitorEvent, _Mapping]]] = ..., stopped_by: _Optional[_Union[MonitorEvent, _Mapping]] = ..., residual: _Optional[bytes] = ..., features: _Optional[_Iterable[_Union[FeatureActivation, _Mapping]]] = ...) -> None: ...

class GetConceptManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ConceptManifest(_message.Message):
    __slots__ = ("concepts", "version", "point")
    CONCEPTS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    POINT_FIELD_NUMBER: _ClassVar[int]
    concepts: _containers.RepeatedCompositeFieldContainer[Concept]
    version: int
    point: str
    def __init__(self, concepts: _Optional[_Iterable[_Union[Concept, _Mapping]]] = ..., version: _Optional[int] = ..., point: _Optional[str] = ...) -> None: ...

class Concept(_message.Message):
    __slots__ = ("name", "info", "live")
    NAME_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    name: str
    info: ConceptInfo
    live: bool
    def __init__(self, name: _Optional[str] = ..., info: _Optional[_Union[ConceptInfo, _Mapping]] = ..., live: _Optional[bool] = ...) -> None: ...

class ConceptInfo(_message.Message):
    __slots__ = ("name", "recommended_layer", "method", "n_fit", "n_heldout", "layers", "validation", "writes_layer", "raises", "lowers", "n_positive", "n_negative", "n_pairs", "n_background", "warning")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RECOMMENDED_LAYER_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    N_FIT_FIELD_NUMBER: _ClassVar[int]
    N_HELDOUT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_FIELD_NUMBER: _ClassVar[int]
    WRITES_LAYER_FIELD_NUMBER: _ClassVar[int]
    RAISES_FIELD_NUMBER: _ClassVar[int]
    LOWERS_FIELD_NUMBER: _ClassVar[int]
    N_POSITIVE_FIELD_NUMBER: _ClassVar[int]
    N_NEGATIVE_FIELD_NUMBER: _ClassVar[int]
    N_PAIRS_FIELD_NUMBER: _ClassVar[int]
    N_BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    WARNING_FIELD_NUMBER: _ClassVar[int]
    name: str
    recommended_layer: int
    method: str
    n_fit: int
    n_heldout: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerFit]
    validation: str
    writes_layer: int
    raises: _containers.RepeatedScalarFieldContainer[str]
    lowers: _containers.RepeatedScalarFieldContainer[str]
    n_positive: int
    n_negative: int
    n_pairs: int
    n_background: int
    warning: str
    def __init__(self, name: _Optional[str] = ..., recommended_layer: _Optional[int] = ..., method: _Optional[str] = ..., n_fit: _Optional[int] = ..., n_heldout: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerFit, _Mapping]]] = ..., validation: _Optional[str] = ..., writes_layer: _Optional[int] = ..., raises: _Optional[_Iterable[str]] = ..., lowers: _Optional[_Iterable[str]] = ..., n_positive: _Optional[int] = ..., n_negative: _Optional[int] = ..., n_pairs: _Optional[int] = ..., n_background: _Optional[int] = ..., warning: _Optional[str] = ...) -> None: ...

class LayerFit(_message.Message):
    __slots__ = ("layer", "scale", "offset", "auroc", "accuracy", "token_auroc", "token_accuracy", "brier", "ece", "running_scale", "running_offset", "auroc_low", "auroc_high", "accuracy_low", "accuracy_high", "running_token_auroc", "token_mean_auroc", "background_fpr", "background_fpr_low", "background_fpr_high", "background_texts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SCALE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    AUROC_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_AUROC_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    BRIER_FIELD_NUMBER: _ClassVar[int]
    ECE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SCALE_FIELD_NUMBER: _ClassVar[int]
    RUNNING_OFFSET_FIELD_NUMBER: _ClassVar[int]
    AUROC_LOW_FIELD_NUMBER: _ClassVar[int]
    AUROC_HIGH_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_LOW_FIELD_NUMBER: _ClassVar[int]
    ACCURACY_HIGH_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TOKEN_AUROC_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MEAN_AUROC_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FPR_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FPR_LOW_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_FPR_HIGH_FIELD_NUMBER: _ClassVar[int]
    BACKGROUND_TEXTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    scale: float
    offset: float
    auroc: float
    accuracy: float
    token_auroc: float
    token_accuracy: float
    brier: float
    ece: float
    running_scale: float
    running_offset: float
    auroc_low: float
    auroc_high: float
    accuracy_low: float
    accuracy_high: float
    running_token_auroc: float
    token_mean_auroc: float
    background_fpr: float
    background_fpr_low: float
    background_fpr_high: float
    background_texts: int
    def __init__(self, layer: _Optional[int] = ..., scale: _Optional[float] = ..., offset: _Optional[float] = ..., auroc: _Optional[float] = ..., accuracy: _Optional[float] = ..., token_auroc: _Optional[float] = ..., token_accuracy: _Optional[float] = ..., brier: _Optional[float] = ..., ece: _Optional[float] = ..., running_scale: _Optional[float] = ..., running_offset: _Optional[float] = ..., auroc_low: _Optional[float] = ..., auroc_high: _Optional[float] = ..., accuracy_low: _Optional[float] = ..., accuracy_high: _Optional[float] = ..., running_token_auroc: _Optional[float] = ..., token_mean_auroc: _Optional[float] = ..., background_fpr: _Optional[float] = ..., background_fpr_low: _Optional[float] = ..., background_fpr_high: _Optional[float] = ..., background_texts: _Optional[int] = ...) -> None: ...

class SteeredGenerateRequest(_message.Message):
    __slots__ = ("generate", "interventions")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    INTERVENTIONS_FIELD_NUMBER: _ClassVar[int]
    generate: _salience_pb2.GenerateRequest
    interventions: _containers.RepeatedCompositeFieldContainer[Intervention]
    def __init__(self, generate: _Optional[_Union[_salience_pb2.GenerateRequest, _Mapping]] = ..., interventions: _Optional[_Iterable[_Union[Intervention, _Mapping]]] = ...) -> None: ...

class Intervention(_message.Message):
    __slots__ = ("direction", "layers", "op", "value", "prompt", "ranges", "generated", "lo", "hi", "vector", "feature")
    class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        OP_UNSPECIFIED: _ClassVar[Intervention.Op]
        OP_ADD: _ClassVar[Intervention.Op]
        OP_SET: _ClassVar[Intervention.Op]
        OP_ABLATE: _ClassVar[Intervention.Op]
        OP_CAP: _ClassVar[Intervention.Op]
    OP_UNSPECIFIED: Intervention.Op
    OP_ADD: Intervention.Op
    OP_SET: Intervention.Op
    OP_ABLATE: Intervention.Op
    OP_CAP: Intervention.Op
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    LO_FIELD_NUMBER: _ClassVar[int]
    HI_FIELD_NUMBER: _ClassVar[int]
    VECTOR_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FIELD_NUMBER: _ClassVar[int]
    direction: str
    layers: _containers.RepeatedScalarFieldContainer[int]
    op: Intervention.Op
    value: float
    prompt: bool
    ranges: _containers.RepeatedCompositeFieldContainer[_salience_pb2.PositionRange]
    generated: bool
    lo: float
    hi: float
    vector: bytes
    feature: FeatureRef
    def __init__(self, direction: _Optional[str] = ..., layers: _Optional[_Iterable[int]] = ..., op: _Optional[_Union[Intervention.Op, str]] = ..., value: _Optional[float] = ..., prompt: _Optional[bool] = ..., ranges: _Optional[_Iterable[_Union[_salience_pb2.PositionRange, _Mapping]]] = ..., generated: _Optional[bool] = ..., lo: _Optional[float] = ..., hi: _Optional[float] = ..., vector: _Optional[bytes] = ..., feature: _Optional[_Union[FeatureRef, _Mapping]] = ...) -> None: ...

class GetSteeringManifestRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SteeringManifest(_message.Message):
    __slots__ = ("directions", "max_interventions", "max_magnitude", "vector_columns")
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
    VECTOR_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    directions: _containers.RepeatedCompositeFieldContainer[SteeringManifest.Direction]
    max_interventions: int
    max_magnitude: float
    vector_columns: int
    def __init__(self, directions: _Optional[_Iterable[_Union[SteeringManifest.Direction, _Mapping]]] = ..., max_interventions: _Optional[int] = ..., max_magnitude: _Optional[float] = ..., vector_columns: _Optional[int] = ...) -> None: ...

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
