"""Request body limits, torch-free: `macs-kernels serve --help` reads them without loading the server."""

# A request body larger than this is refused unread (413): far above any prompt the KV cache holds (a token
# is a few bytes of JSON), far below what keeps the parser and the tokenizer busy for seconds.
DEFAULT_MAX_BODY_BYTES = 1 << 20

# Images travel inline as base64: a photograph of a few megabytes is a request of a few more.
DEFAULT_MAX_IMAGE_BODY_BYTES = 16 << 20

# A request body over this is a long prompt (or an image), prepared in a thread of its own (app.create_app): 64 KiB of
# text takes the tokenizer tens of milliseconds, a body at the limit above seconds.
LONG_PROMPT_BYTES = 64 << 10
