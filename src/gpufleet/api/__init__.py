"""REST API v1 (FastAPI): thin routers over ``services``."""
