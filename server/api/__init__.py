"""The OpenAI-compatible HTTP layer: `create_app(engine)` builds the FastAPI application."""
