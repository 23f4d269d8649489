"""ServeConfig: the server's own settings in one validated dataclass (the engine's are EngineConfig's).

    serve(model, ServeConfig(port=8001, max_waiting=16), EngineConfig(max_batch_size=8))
    serve(model, port=8001, max_waiting=16, max_batch_size=8)        # the same, as keywords

Each field is declared once, with its help text and bounds in its metadata: validate(), the `qkv serve`
flags (qkv.cli.flags) and docs/serving.md read it. Like EngineConfig's module, this one imports no torch
and no web framework, so that `qkv serve --help` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkv.config import check_fields, setting
from qkv.image_io import DEFAULT_LIMITS, ImageLimits

# qkv.nn.quant.MODES, written out: the CLI reads it without importing torch (a test checks they agree)
QUANTIZE_MODES = ("int8", "int4")


@dataclass
class ServeConfig:
    host: str = setting("127.0.0.1", "address to listen on (any other than loopback: whoever reaches it may "
                                        "use the model)")
    port: int = setting(8000, "port (0: any free one, printed at start)", ge=0, le=65535)
    name: str | None = setting(None, "the model name clients send", none="the folder's name")
    max_waiting: int = setting(64, "queued requests beyond the running batch before 429", ge=0)
    # below 0 uvicorn would cancel every request at once (and NaN compares false: check_fields refuses it)
    shutdown_timeout: float = setting(30.0, "seconds running requests get to finish on SIGINT / SIGTERM",
                                      ge=0, unit="seconds")
    max_tokens_cap: int = setting(1024, "tokens a chat request without max_tokens may generate at most "
                                        "(and what fits)", ge=1)
    quantize: str | None = setting(
        None, "weight-only quantized projections and output head for inference: int8 (per output channel) "
        "or int4 (per group of 64 inputs); fastest with a bf16 model (docs/llm.md)", choices=QUANTIZE_MODES,
        none="full precision")
    # what one request may make the server read and decode: each checked before the bytes are held or the
    # pixels decoded (docs/robustness.md)
    max_request_bytes: int = setting(50 * 2**20, "request body size; a larger one is a 413, refused before "
                                     "it is read (OpenAI's limit is 50 MB)", ge=1, unit="bytes")
    max_messages: int = setting(4096, "messages per chat request, and content parts in all of them (each "
                                "is validated and rendered before the context is checked)", ge=1)
    max_images: int = setting(16, "image_url parts per chat request (each is decoded and embedded)", ge=0)
    max_image_bytes: int = setting(DEFAULT_LIMITS.max_bytes, "bytes of one image (decoded from base64)",
                                   ge=1, unit="bytes")
    max_image_pixels: int = setting(DEFAULT_LIMITS.max_pixels, "width x height one image may declare",
                                    ge=1, unit="pixels")

    @property
    def image_limits(self) -> ImageLimits:
        """The image_url parts' limits: PNG and JPEG only, as the API documents (serve/images.py)."""
        return ImageLimits(max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels,
                           formats=("PNG", "JPEG"))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        check_fields(self, "")
