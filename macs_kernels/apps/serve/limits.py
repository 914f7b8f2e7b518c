"""Request body limits, torch-free: `macs-kernels serve --help` reads them without loading the server."""

# A request body larger than this is refused unread (413): far above any prompt the KV cache holds (a token
# is a few bytes of JSON), far below what keeps the parser and the tokenizer busy for seconds.
DEFAULT_MAX_BODY_BYTES = 1 << 20

# Images travel inline as base64: a photograph of a few megabytes is a request of a few more.
DEFAULT_MAX_IMAGE_BODY_BYTES = 16 << 20
