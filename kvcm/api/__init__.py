"""RPC method tables: request schemas and handlers, one module per area, each exporting ``methods(...)``."""
