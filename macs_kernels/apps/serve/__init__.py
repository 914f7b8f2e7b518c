"""`macs-kernels serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on transformers' continuous
batching engine, with MACS attribution per request and a live attribution page at `/`.

Needs the `serve` extra (fastapi, uvicorn). Modules: engine (the batching manager and attribution; a
vision-language model's engine, one request at a time), images (image_url data URLs), schemas (request bodies),
app (routes, errors, streaming), cli (the subcommand), static/ (the page).
"""
