"""Ember's HTTP front end: OpenAI- and Anthropic-compatible endpoints over the engine, parsers and grammar.

- `ember.server.cli.main(argv)`: the `ember` console script (`serve`, `convert-llama2c`, `quantize-nvfp4`).
- `ember.server.app.load_runtime(ServeConfig) -> ModelRuntime`, `create_app(runtime, config) -> FastAPI`,
  `BackgroundServer(app).start()` (uvicorn in a thread, for tests and benchmarks).
- `ember.server.openai_encoder` / `anthropic_encoder`: pure functions from pipeline events to wire chunks/events,
  and the folds that make non-streaming bodies.
"""
