"""`kvcache serve`: an OpenAI-compatible HTTP server over one engine.

Owns the HTTP side only: the request and response bodies (protocol.py with messages.py and
structured.py, responses.py), the engine loop thread that alone calls the engine (engine_loop.py)
and the events it exchanges with the handlers (events.py), one call's life from submit to its last
chunk (calls.py), chat templates rendered off the engine's thread within bounds (templates.py),
/tokenize's work on threads of its own (tokenizing.py), structures compiled off the engine's thread
within bounds (grammar_work.py), tool calls (tool_calls.py: formats and schemas; tool_answers.py:
answers read for them, whole or streamed), what the routes share (state.py), the FastAPI app
(app.py) with its routes (completion_route.py, chat_route.py, and vLLM's utility_routes.py), the API
key check it shares with the routers (auth.py), secrets masked in what it shows (masking.py), the
bound on a request body's arrival (body_deadline.py), uvicorn with its SIGTERM drain (server.py),
Prometheus metrics (metrics.py; vLLM's names: vllm_metrics.py) and the click command (command.py).
May import: kvcache (its redaction of URLs, CacheStats), engine (the engine as an `EngineInterface`,
never its parts; the LLM it builds, streaming, outputs), sampling (SamplingParams, its text checks),
cli (the engine's options). Never imports runner.disagg, which extends it: the serve command starts
its worker through a `RoleStarter` (command.py) that cli.py hands it, disagg's
serve_role.start_role. Nothing in the engine imports this package. Importing it imports nothing
heavy.
"""
