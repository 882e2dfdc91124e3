"""`ImageError`: why one image part of a request was refused, in words a user can act on.

The router turns it into a 400 (size limits too, as the API promises) whose message is the part's location followed
by `reason`, e.g. ``messages[0].content[1]: truncated image file``.
"""

from __future__ import annotations

# Codes the router can put in the OpenAI error's `code` field.
INVALID_IMAGE = "invalid_image"
UNSUPPORTED_IMAGE = "unsupported_image_format"
IMAGE_TOO_LARGE = "image_too_large"
IMAGE_URL_DISABLED = "image_url_disabled"
IMAGE_URL_FORBIDDEN = "image_url_forbidden"
IMAGE_FETCH_FAILED = "image_fetch_failed"


class ImageError(ValueError):
    """An image part that cannot be used; `reason` is short, user-facing and has no location prefix.

    >>> str(ImageError("truncated image file"))
    'truncated image file'
    """

    def __init__(self, reason: str, code: str = INVALID_IMAGE) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
