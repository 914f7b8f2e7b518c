"""`macs-kernels serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) on transformers' continuous
batching engine, with MACS attribution per request and a live attribution page at `/`.

Needs the `serve` extra (fastapi, uvicorn). Modules: engine (the batching manager and attribution), schemas
(request bodies), app (routes, errors, streaming), cli (the subcommand), static/ (the page).
"""
