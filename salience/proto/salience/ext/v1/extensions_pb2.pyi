from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

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
