"""Request body encodings: which ``Content-Encoding`` values the gateway accepts, and body errors.

Decision: bodies are *decoded* here, not refused. aiohttp's parser decompresses ``gzip`` and
``deflate`` (and ``br``/``zstd`` when their optional decoders are installed) while it reads the
body, the size limit (``server.max_body_bytes``) applies to the decoded bytes, and the forwarder
sends the decoded body without ``Content-Encoding``: engines (vLLM, TGI) do not decode request
bodies, and a client that compresses a long prompt saves its upload. Any other encoding
(``compress``, ``x-gzip``, stacked ``gzip, gzip``, ...) gets ``415`` naming the supported ones;
a body that is not valid data of its encoding gets ``400``. Owns no state.
"""

from __future__ import annotations

from aiohttp import web
from aiohttp.compression_utils import HAS_BROTLI, HAS_ZSTD
from aiohttp.http_exceptions import ContentEncodingError, DecompressSizeError, PayloadEncodingError

from hetroute.proxy.api_errors import ApiError

SUPPORTED_ENCODINGS: tuple[str, ...] = (
    ("gzip", "deflate") + (("br",) if HAS_BROTLI else ()) + (("zstd",) if HAS_ZSTD else ())
)
"""Request ``Content-Encoding`` values that are decoded (``identity`` is also accepted)."""


def check_content_encoding(request: web.Request) -> None:
    """Raise ``415`` unless the body's ``Content-Encoding`` is one the parser decodes."""
    values = request.headers.getall("Content-Encoding", ())
    if not values:
        return
    tokens = [t.strip().lower() for v in values for t in v.split(",") if t.strip()]
    if not tokens or tokens == ["identity"]:
        return
    if len(tokens) == 1 and tokens[0] in SUPPORTED_ENCODINGS:
        return
    raise ApiError(
        415,
        f"unsupported Content-Encoding {', '.join(tokens)[:64]!r}; "
        f"supported: {', '.join(SUPPORTED_ENCODINGS)} or identity",
        code="unsupported_content_encoding",
    )


def body_error(exc: web.RequestPayloadError, max_body_bytes: int) -> ApiError:
    """The client error for a body aiohttp could not read (bad framing or bad compressed data)."""
    cause = exc.__cause__
    if isinstance(cause, DecompressSizeError):
        return ApiError(413, f"decompressed request body exceeds the limit of {max_body_bytes} bytes")
    if isinstance(cause, ContentEncodingError):
        return ApiError(400, "request body is not valid data of its Content-Encoding")
    if isinstance(cause, PayloadEncodingError):
        return ApiError(400, "malformed request body framing (Content-Length / Transfer-Encoding)")
    return ApiError(400, "the request body could not be read")
