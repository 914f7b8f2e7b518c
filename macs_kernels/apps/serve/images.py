"""Images in chat requests: OpenAI `image_url` content parts carrying the picture inline as a base64 data URL.

The server has no network, so a remote URL is refused; `check_image_url` is the cheap check the request schema
makes, `decode_image` the decoding (base64, then the picture, bounded in pixels) made in a worker thread before
any generation.
"""
from __future__ import annotations

import base64
import binascii
import io

# Far above what a vision-language processor keeps (it resizes to a few megapixels at most), far below what
# makes decoding hold gigabytes: a 4096 x 4096 picture is 48 MiB as RGB.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096
_INLINE = "send the picture inline as a data URL: data:image/png;base64,<base64 of the file>"


def check_image_url(url: str) -> None:
    """Refuse, naming the problem, an image URL that is not a base64 data URL of an image (before decoding)."""
    if url.lower().startswith(("http://", "https://")):
        raise ValueError(f"remote image URLs are not fetched: this server has no network; {_INLINE}")
    header, comma, _ = url.partition(",")
    if not header.lower().startswith("data:") or not comma:
        raise ValueError(f"an image URL must be a data URL ({url[:40]!r} is not); {_INLINE}")
    media, *parameters = header[len("data:"):].split(";")
    if not media.lower().startswith("image/"):
        raise ValueError(f"the data URL's media type is {media or 'missing'!r}, not an image type (image/png, "
                         "image/jpeg, ...)")
    if "base64" not in (p.lower() for p in parameters):
        raise ValueError(f"the data URL is not base64-encoded (no ';base64' before the comma); {_INLINE}")


def decode_image(url: str, *, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
    """The PIL RGB image of a base64 data URL (checked by check_image_url), or a ValueError naming the problem:
    bad base64, bytes that are no image PIL reads, more than `max_pixels` pixels (checked from the file's header,
    before the pixels are decoded), an animated image (several frames: a video)."""
    from PIL import Image

    check_image_url(url)
    try:
        data = base64.b64decode(url.partition(",")[2], validate=True)
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"the data URL's base64 does not decode ({error})") from None
    try:
        image = Image.open(io.BytesIO(data))
    except (OSError, Image.DecompressionBombError) as error:
        raise ValueError(f"the data URL's {len(data)} bytes are not an image this server can read ({error})") from None
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"the image is {width} x {height} = {width * height} pixels; this server takes up to "
                         f"{max_pixels} (macs-kernels serve --max-image-pixels)")
    if getattr(image, "n_frames", 1) > 1:
        raise ValueError(f"the image is animated ({image.n_frames} frames): video inputs are not supported")
    try:
        return image.convert("RGB")
    except (OSError, ValueError) as error:  # a header that reads but pixels that do not (a truncated file)
        raise ValueError(f"the image's pixels do not decode ({error})") from None
